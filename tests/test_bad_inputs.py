"""The bad-input battery: each row ends with exit != 0 and one readable line naming the problem and
the fix, before any training step (no checkpoint, no metrics, no worker output)."""

from __future__ import annotations

import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port, run_cli


@dataclass
class Row:
    name: str
    args: list[str]
    expect: str
    setup: Callable[[Path, Path], None] | None = None
    skip_if: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _small_data(tmp: Path, _prepared: Path) -> None:
    from aura_hpc.data.prepare import PrepareSpec, prepare

    (tmp / "small.txt").write_text("La panadera abrió la puerta del molino. " * 40, encoding="utf-8")
    prepare(PrepareSpec(out_dir=tmp / "small", inputs=[str(tmp / "small.txt")], vocab_size=300))


def _truncated(tmp: Path, prepared: Path) -> None:
    shutil.copytree(prepared, tmp / "trunc")
    with open(tmp / "trunc" / "shards" / "train-00000.bin", "r+b") as f:
        f.truncate(1000)


def _files(tmp: Path, _prepared: Path) -> None:
    (tmp / "typo.yaml").write_text("train:\n  max_step: 10\n")
    (tmp / "broken.yaml").write_text("model: {n_layer: 2\n")
    (tmp / "empty").mkdir()
    (tmp / "afile").write_text("not a directory")
    (tmp / "doc.docx").write_bytes(b"PK")
    (tmp / "latin1.txt").write_bytes("año y señal".encode("latin-1"))
    (tmp / "unicode.txt").write_bytes("año y señal".encode("utf-16"))  # Notepad's and Excel's "Unicode": a BOM, then UTF-16
    (tmp / "rows.jsonl").write_text('{"body": "hola"}\n')
    (tmp / "latin1.json").write_bytes('[{"text": "año y señal"}]'.encode("latin-1"))
    (tmp / "broken.json").write_text('{"text": "hola"}\n' * 60 + '{"text": roto\n')
    (tmp / "fake.parquet").write_text("not parquet")
    (tmp / "norun").mkdir()


def _fifo(tmp: Path, _prepared: Path) -> None:
    import os

    os.mkfifo(tmp / "corpus.txt")  # nobody writes to it: prepare used to wait forever in silence


def _hostile_configs(tmp: Path, _prepared: Path) -> None:
    # "Billion laughs": 272 bytes that expand to 10**9 values (a 39 MB error line, 6 GB at nine levels, before).
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    (tmp / "laughs.yaml").write_text("\n".join(lines) + "\ntrain:\n  lr: *i\n")
    (tmp / "latin1.yaml").write_bytes("run_name: año\n".encode("latin-1"))
    (tmp / "docs").mkdir()
    (tmp / "docs" / "a.txt").write_text("Mi tesis.\n\nOtro párrafo.\n" * 50, encoding="utf-8")


def _run_with(*settings: str) -> Callable[[Path, Path], None]:
    """A run directory with checkpoints, started with `settings`."""

    def setup(tmp: Path, _prepared: Path) -> None:
        from aura_hpc.config import load_config

        old = load_config(None, list(settings), output_dir=str(tmp / "runs"), run_name="tiny")
        old.run_dir.mkdir(parents=True)
        (old.run_dir / "config.yaml").write_text(old.to_yaml())
        (old.run_dir / "checkpoints").mkdir()

    return setup


def _other_tokenizer_run(tmp: Path, prepared: Path) -> None:
    """A run whose checkpoint was trained with another tokenizer than the data it is resumed on."""
    ckpt = tmp / "runs" / "tiny" / "checkpoints" / "step_00000005"
    shutil.copytree(prepared / "tokenizer", ckpt / "tokenizer")
    tok = ckpt / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"vocab"', '"vocab" ', 1))
    (ckpt / "COMPLETE.json").write_text("{}")
    from aura_hpc.config import load_config

    kept = load_config(None, [], output_dir=str(tmp / "runs"), run_name="tiny")
    (tmp / "runs" / "tiny" / "config.yaml").write_text(kept.to_yaml())  # the run's own, kept as it was


def _held_run_dir(tmp: Path, _prepared: Path) -> None:
    import json
    import os

    run = tmp / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": "now"}))


def _users_own_project(tmp: Path, _prepared: Path) -> None:
    project = tmp / "home" / "myproject"
    project.mkdir(parents=True)
    (project / "config.yaml").write_text("model: resnet50\nepochs: 90\n")


_listener: socket.socket | None = None


def _busy_port(tmp: Path, _prepared: Path) -> None:
    global _listener
    _listener = socket.socket()
    _listener.bind(("", 0))
    _listener.listen()
    (tmp / "port").write_text(str(_listener.getsockname()[1]))


NO_CUDA = not torch.cuda.is_available()
D = "--set=data.path={data}"

ROWS = [
    # config
    Row("unknown key", ["local", "--set", "train.lrr=1"], "unknown config key 'train.lrr': did you mean 'train.lr'?"),
    Row("misspelt key in a file", ["local", "--config", "{tmp}/typo.yaml"], "unknown config key 'train.max_step'", _files),
    Row("unknown section", ["local", "--set", "optim.lr=1"], "unknown config key 'optim.lr'"),
    # A key put in another section (the commonest slip) was "unknown" with no hint.
    Row(
        "a key of another section",
        ["local", "--set", "train.seq_len=512"],
        "unknown config key 'train.seq_len': did you mean 'data.seq_len'?",
    ),
    Row("checkpoint every -1 s", ["local", "--set", "train.checkpoint_every_s=-1"], "train.checkpoint_every_s must be"),
    Row(
        "a preset's name misspelt",
        ["local", "--config", "gpt2_small"],
        "config 'gpt2_small' is neither a file nor a shipped preset: did you mean 'gpt2-small'?",
    ),
    Row("check reads the config", ["check", "--set", "train.lrr=1"], "unknown config key 'train.lrr': did you mean 'train.lr'?"),
    Row(
        "memory in megabytes",
        ["submit", "--mem", "64", "--output-dir", "{tmp}/runs", "--dry-run"],
        "slurm.mem 64 is 64 megabytes to Slurm (fix: --mem 64G",
    ),
    # A whole section, or a key without its section: a traceback before (AttributeError: 'str' object has no attribute 'get').
    Row("a whole section", ["local", "--set", "model=x"], "--set model=... names a whole section (fix: one key of it, --set model.NAME"),
    Row("a key without its section", ["local", "--set", "lr=3e-4"], "unknown config key 'lr' (fix: --set train.lr=..."),
    Row("zero batch", ["local", "--set", "train.batch_size=0"], "train.batch_size must be greater than 0"),
    Row("negative layers", ["local", "--set", "model.n_layer=-2"], "model.n_layer must be greater than 0"),
    Row("zero lr", ["local", "--set", "train.lr=0"], "train.lr must be greater than 0"),
    Row("wrong type", ["local", "--set", "train.max_steps=many"], "train.max_steps must be a whole number"),
    Row("n_embd vs n_head", ["local", "--set", "model.n_embd=130"], "model.n_embd (130) must be divisible by model.n_head (4)"),
    Row("sequence too long", ["local", "--set", "data.seq_len=1024"], "data.seq_len (1024) is longer than model.n_positions (256)"),
    Row(
        "stop_at after the token budget",
        ["local", "--set", "train.max_tokens=20480", "--set", "train.stop_at=50"],
        "is after the end of the run (10 steps)",
    ),
    Row("bad backend value", ["local", "--set", "dist.backend=mpi"], "dist.backend must be one of auto, nccl, gloo"),
    Row("unknown preset", ["local", "--config", "gpt9"], "config 'gpt9' is neither a file nor a shipped preset"),
    Row("invalid YAML", ["local", "--config", "{tmp}/broken.yaml"], "is not valid YAML", _files),
    Row("bad run name", ["local", "--run-name", "../x"], "run_name '../x' must be ASCII letters"),
    Row("--set without =", ["local", "--set", "train.lr"], "is not KEY=VALUE"),
    Row("selftest with nothing to run", ["selftest", "--cpu", "--strategies", ",", "--no-bench"], "selftest has nothing to run"),
    Row(
        "check bandwidth sizes",
        ["check", "--nnodes", "2", "--master-addr", "127.0.0.1", "--sizes-mb", "0,abc"],
        "--sizes-mb '0,abc' is not a comma list of sizes in MB",
    ),
    Row("negative webhook timeout", ["local", "--set", "health.webhook_timeout_s=-1"], "health.webhook_timeout_s must be in (0, 120]"),
    Row("fp16 on CPU", ["local", "--set", "train.precision=fp16"], "fp16 needs a CUDA GPU", skip_if=not NO_CUDA),
    # fp16's routine overflow steps put inf into PowerSGD's error feedback: every later step NaN, skipped in silence.
    Row(
        "fp16 with PowerSGD",
        ["local", "--set", "train.precision=fp16", "--set", "dist.compress=powersgd"],
        "fp16's overflow steps put inf into PowerSGD's error feedback",
    ),
    # data
    Row("missing data dir", ["local", "--set", "data.path=/nonexistent/data"], "data.path /nonexistent/data does not exist (fix:"),
    Row("unprepared data dir", ["local", "--set", "data.path={tmp}/empty"], "python -m aura_hpc prepare", _files),
    Row("effective batch > dataset", ["local", "--set", "data.path={tmp}/small"], "fewer than one effective batch", _small_data),
    Row("vocab mismatch", ["local", D, "--set", "model.vocab_size=5000"], "model.vocab_size 5000 does not match the data's tokenizer"),
    Row("data.path is a text file", ["local", "--set", "data.path={tmp}/latin1.txt"], "is a file; the trainer reads a prepared", _files),
    Row("resume on data of another tokenizer", ["local", "--output-dir", "{tmp}/runs", D], "another tokenizer", _other_tokenizer_run),
    Row("run directory in use", ["local", "--output-dir", "{tmp}/runs", D], "is in use by PID", _held_run_dir),
    # A folder of the user's own named as the run directory: its config.yaml was replaced without a word.
    Row(
        "a folder not ours",
        ["local", "--output-dir", "{tmp}/home", "--run-name", "myproject", D],
        "myproject/config.yaml was not written by aura_hpc, and a run there would replace it (fix: another --run-name",
        _users_own_project,
    ),
    Row("line break in a value", ["local", "--set", "slurm.partition=a\ntouch x #"], "contains the character '\\n'"),
    Row("truncated token file", ["local", "--set", "data.path={tmp}/trunc"], "re-run prepare with --force", _truncated),
    Row(
        "resume with another model",
        ["local", "--output-dir", "{tmp}/runs", D],
        "holds checkpoints of a different model shape",
        _run_with("model.n_layer=4"),
    ),
    Row(
        "resume under another sharding",
        ["local", "--output-dir", "{tmp}/runs", D],
        "holds checkpoints written under dist.strategy=fsdp; ddp lays the weights and the optimizer's state out differently",
        _run_with("dist.strategy=fsdp"),
    ),
    Row(
        "resume with another optimizer",
        ["local", "--output-dir", "{tmp}/runs", D],
        "holds checkpoints of train.optimizer=sgd, whose state adamw cannot take (fix: resume with --set train.optimizer=sgd",
        _run_with("train.optimizer=sgd"),
    ),
    # filesystem
    Row("output_dir is a file", ["local", "--output-dir", "{tmp}/afile/runs", D], "afile is a file, not a directory", _files),
    Row(
        "submit: output_dir under a file",
        ["submit", "--output-dir", "{tmp}/afile/runs", D, "--dry-run"],
        "afile is a file, not a directory",
        _files,
    ),
    # CLI / launcher
    Row(
        "node-rank >= nnodes",
        ["local", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
        "--node-rank 2 is not below --nnodes 2",
    ),
    Row("zero nodes", ["local", "--nnodes", "0"], "--nnodes must be at least 1"),
    Row("nnodes without master", ["local", "--nnodes", "2"], "--nnodes > 1 needs --master-addr"),
    Row("zero processes", ["local", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    Row("port out of range", ["local", "--master-port", "70000"], "--master-port must be 1..65535"),
    Row("negative restarts", ["local", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    Row("zero rendezvous timeout", ["local", "--rdzv-timeout", "0"], "--rdzv-timeout must be positive"),
    Row("nccl without CUDA", ["local", "--backend", "nccl"], "--backend nccl needs CUDA GPUs", skip_if=not NO_CUDA),
    Row("more processes than GPUs", ["local", "--nproc-per-node", "64"], "is more than the", skip_if=NO_CUDA),
    # network
    Row(
        "port in use",
        ["local", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "{port}", D],
        "is already in use on this machine",
        _busy_port,
    ),
    Row(
        "master unreachable",
        ["local", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "{free}", "--rdzv-timeout", "2", D],
        "cannot reach the master at 127.0.0.1",
    ),
    Row(
        "node 0 started with another machine's address",
        ["local", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.255.255.1", D],
        "10.255.255.1 is not an address of this machine",
    ),
    Row(
        "master does not resolve",
        ["local", "--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid", "--rdzv-timeout", "2", D],
        "does not resolve",
    ),
    Row(  # said "does not resolve"
        "master is an IPv6 address",
        ["local", "--nnodes", "2", "--node-rank", "1", "--master-addr", "fd00::1", "--rdzv-timeout", "2", D],
        "master address 'fd00::1' is an IPv6 address: IPv4 only (fix: node 0's IPv4 address",
    ),
    # prepare
    Row("prepare: missing input", ["prepare", "/nonexistent.txt", "--out", "{tmp}/p"], "input '/nonexistent.txt' does not exist"),
    Row("prepare: unsupported type", ["prepare", "{tmp}/doc.docx", "--out", "{tmp}/p"], "unsupported type '.docx'", _files),
    Row(
        "prepare --submit: a line break in --partition",
        ["prepare", "--out", "{tmp}/p", "--submit", "--partition", "gpu\n#SBATCH --exclusive"],
        "--partition contains the character '\\n' (U+000A line feed), which would break the sbatch script",
    ),
    Row(
        "prepare: not UTF-8",
        ["prepare", "{tmp}/latin1.txt", "--out", "{tmp}/p"],
        "(fix: convert a copy, e.g. iconv -f WINDOWS-1252 -t UTF-8 ",
        _files,
    ),
    Row(  # told to convert it from WINDOWS-1252, the copy held NUL bytes and was refused again
        "prepare: UTF-16",
        ["prepare", "{tmp}/unicode.txt", "--out", "{tmp}/p"],
        "(fix: convert a copy, e.g. iconv -f UTF-16 -t UTF-8 ",
        _files,
    ),
    Row("prepare: missing text column", ["prepare", "{tmp}/rows.jsonl", "--out", "{tmp}/p"], "column 'text' not in", _files),
    # pyarrow's and the codec's tracebacks, without a file name, before
    Row("prepare: .json not UTF-8", ["prepare", "{tmp}/latin1.json", "--out", "{tmp}/p"], "latin1.json' could not be read as json", _files),
    Row("prepare: .json broken row", ["prepare", "{tmp}/broken.json", "--out", "{tmp}/p"], "in row 60 (fix: make it UTF-8 JSON", _files),
    Row("prepare: not Parquet", ["prepare", "{tmp}/fake.parquet", "--out", "{tmp}/p"], "(fix: make it a Parquet file", _files),
    Row("prepare: nothing to do", ["prepare", "--out", "{tmp}/p"], "nothing to prepare"),
    Row(  # the files were dropped in silence
        "prepare: files and a dataset",
        ["prepare", "{tmp}/latin1.txt", "--dataset", "org/corpus", "--out", "{tmp}/p"],
        "give input files or --dataset org/corpus, not both",
        _files,
    ),
    Row(  # ignored, exit 0
        "prepare: Slurm flags without --submit",
        ["prepare", "{tmp}/latin1.txt", "--nodes", "4", "--wait", "--out", "{tmp}/p"],
        "--nodes, --wait only apply with --submit (fix: add --submit",
        _files,
    ),
    Row("prepare: a named pipe", ["prepare", "{tmp}/corpus.txt", "--out", "{tmp}/p"], "is a pipe or device, and prepare reads", _fifo),
    Row(
        "prepare: tiny vocab",
        ["prepare", "{tmp}/latin1.txt", "--vocab-size", "10", "--out", "{tmp}/p"],
        "--vocab-size must be between",
        _files,
    ),
    Row("check: a timeout that is no time", ["check", "--timeout", "nan"], "--timeout must be a number of seconds above 0, got nan"),
    Row("monitor: a negative count", ["monitor", "--count", "-1"], "--count must be 0 (until Ctrl+C) or more, got -1 (fix: --count 10)"),
    Row(  # skipped, and all ok was reported
        "check: a shared dir with no other node",
        ["check", "--shared-dir", "{tmp}"],
        "--shared-dir is tested between nodes: each writes, the others read (fix: run it on every node with --nnodes N",
    ),
    Row(  # the worker said "connection refused at 127.0.0.1:70000 ... ufw allow 70000/tcp"
        "check: a port that is none",
        ["check", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "70000"],
        "--master-port 70000 is not a TCP port (fix: --master-port 29500",
    ),
    Row(  # check passed a master that `local` refuses
        "check: an IPv6 master",
        ["check", "--nnodes", "2", "--node-rank", "1", "--master-addr", "fd00::1", "--timeout", "2"],
        "master address 'fd00::1' is an IPv6 address: IPv4 only",
    ),
    # generate
    Row("generate: no checkpoint", ["generate", "{tmp}/norun"], "no complete checkpoint", _files),
    Row("generate: no run", ["generate"], "no run given (fix: python -m aura_hpc generate RUN_DIR"),  # argparse: "required: --run"
    Row("generate: two runs", ["generate", "{tmp}/a", "--run", "{tmp}/b"], "two runs given, one as --run ("),
    Row("generate: a job submitted from elsewhere", ["generate", "999999"], "job 999999 is not among the jobs submitted from here"),
    Row(
        "generate: nan temperature",
        ["generate", "--run", "{tmp}/norun", "--temperature", "nan"],
        "--temperature must be 0 (greedy) or above, got nan",
        _files,
    ),
    Row(
        "generate: negative length",
        ["generate", "--run", "{tmp}/norun", "--max-new-tokens", "-5"],
        "--max-new-tokens must be at least 1, got -5 (fix: --max-new-tokens 100)",
        _files,
    ),
    Row(  # it waited forever (77 s with --rdzv-timeout 25 for a user), with no line of its own
        "master port held by another program",
        ["local", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "{port}", "--rdzv-timeout", "5", D],
        "127.0.0.1:{port} accepted the connection but did not answer as a torch store within 5 s",
        _busy_port,
    ),
    Row(
        "check against a port held by another program",
        ["check", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "{port}", "--timeout", "8"],
        "did not answer as a torch store",
        _busy_port,
    ),
    Row(
        "node rank without other nodes",
        ["local", "--node-rank", "1", D],
        "--node-rank 1 needs a run across machines (fix: --nnodes 2 or more with --master-addr",
    ),
    Row(
        "ps worker with a malformed secret",
        ["worker", "--server", "127.0.0.1:{free}"],
        "fix: copy it exactly from the `AURA_PS_SECRET=...` that `ps` printed",
        env={"AURA_PS_SECRET": "short"},
    ),
    # hostile or absurd input (issue 19)
    Row("yaml alias bomb", ["local", "--config", "{tmp}/laughs.yaml"], "expands to more than 10,000 values", _hostile_configs),
    Row("config not UTF-8", ["local", "--config", "{tmp}/latin1.yaml"], "is not UTF-8 text", _hostile_configs),
    Row("lr overflows", ["local", "--set", "train.lr=1e300", D], "train.lr = 1e+300 is beyond any real run"),
    Row("lr infinite", ["local", "--set", "train.lr=inf", D], "train.lr must be a finite number"),
    Row("absurd warmup", ["local", "--set", "train.warmup_steps=1e18", D], "train.warmup_steps = 1e+18 is beyond"),
    Row("absurd depth", ["local", "--set", "model.n_layer=10000", D], "model.n_layer = 10000 is beyond"),
    Row(
        "more RAM than the machine has",
        ["local", "--set", "model.n_layer=200", "--set", "model.n_embd=4096", "--set", "model.n_head=32", D],
        "GiB of RAM for 2 process(es) on this CPU machine, more than its",
    ),
    Row("sample prompt longer than the context", ["local", "--set", "train.sample_prompt=" + "hola " * 300, D], "train.sample_prompt is"),
    Row(
        "prepare --dry-run: what the run refuses",
        ["prepare", "{tmp}/latin1.txt", "--out", "{tmp}/p", "--dry-run", "--val-fraction", "1.5"],
        "--val-fraction must be between 0 and 0.5",
        _files,
    ),
    Row("a run secret anyone could guess", ["local", D], "under the 16 a run's secret needs", env={"AURA_RUN_SECRET": "k9"}),
    Row("submit: a node range from 0", ["submit", "--dry-run", "--nodes", "0:4", "--output-dir", "{tmp}/runs"], "starts at 0 nodes"),
    # A requeue on 2 of 3 nodes found ZeRO shards of 3 nodes' ranks: refused at resume (exit 2), the job over. A sweep's
    # second point too.
    Row(
        "submit: a node range under ZeRO",
        ["submit", "--dry-run", "--nodes", "2:3", "--sweep", "dist.strategy=ddp,zero2", "--output-dir", "{tmp}/runs"],
        "(fix: exactly 3 nodes, --nodes 3 --set slurm.min_nodes=0; or dist.strategy=fsdp, whose checkpoints load at any world size)",
    ),
    # The fix offered the failing value itself (signal_lead_s=120 under a 1-minute limit).
    Row(
        "submit: a signal lead past a short limit",
        ["submit", "--dry-run", "--time", "0:01:00", "--output-dir", "{tmp}/runs"],
        "(fix: --set slurm.signal_lead_s=6, or a --time over 2 minutes)",
    ),
    Row(
        "submit: a sweep value twice",
        ["submit", "--dry-run", "--sweep", "train.lr=1e-3,1e-3", "--output-dir", "{tmp}/runs"],
        "share the run directory",
    ),
    Row("monitor: NaN interval", ["monitor", "--interval", "nan", "--count", "1"], "--interval must be positive"),
    Row(
        "monitor: samples into a missing folder",
        ["monitor", "--count", "1", "--json", "{tmp}/no/such/x.jsonl"],
        "x.jsonl: No such file or directory (fix: a file in a folder",
    ),
    Row("prepare into the input's folder", ["prepare", "{tmp}/docs/a.txt", "--out", "{tmp}/docs"], "contains the input", _hostile_configs),
]


def test_there_are_at_least_30_distinct_rows() -> None:
    assert len({r.name for r in ROWS}) == len(ROWS) >= 30
    assert sum(not r.skip_if for r in ROWS) >= 30


@pytest.mark.parametrize(
    "row", [pytest.param(r, id=r.name, marks=pytest.mark.skipif(r.skip_if, reason="needs the other hardware")) for r in ROWS]
)
def test_bad_input(row: Row, tmp_path: Path, prepared: Path) -> None:
    if row.setup:
        row.setup(tmp_path, prepared)
    port = (tmp_path / "port").read_text() if (tmp_path / "port").exists() else "0"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    args = [a.format(tmp=tmp_path, data=prepared, port=port, free=free_port()) for a in row.args]
    if args[0] == "local" and "--output-dir" not in args:
        args += ["--output-dir", str(tmp_path / "runs")]
    r = run_cli(args, cwd=tmp_path, timeout=60, **row.env)
    assert r.returncode not in (0, None), r.stdout[-1000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr  # one readable line, no traceback
    line = lines[0]
    assert line.startswith("error: ") and row.expect.format(port=port) in line, line
    # Short apart from the paths it names (how deep pytest's temporary directory is varies).
    short = line.replace(str(tmp_path), "TMP").replace(str(prepared), "DATA")
    assert len(short) < 400, f"{len(short)} characters: {short[:300]}"
    assert "fix" in line or "did you mean" in line, f"no fix named: {line}"
    # Nothing was trained: no worker started, no checkpoint or metrics.
    assert "start rank=" not in r.stdout
    assert not list(tmp_path.rglob("metrics.jsonl")) and not [p for p in tmp_path.rglob("step_*") if (p / "COMPLETE.json") not in before]
    # Nothing that was there changed (a refused resume keeps the run's config.yaml).
    assert all(p.read_bytes() == data for p, data in before.items() if p.exists() and p.name != "port")


def test_a_damaged_copy_of_a_checkpoints_tokenizer_is_not_another_tokenizer_and_a_streams_is_compared(
    tmp_path: Path, prepared: Path
) -> None:
    """The launcher compared the newest checkpoint's tokenizer.json with the data's: a damaged copy (an NFS server
    crash) refused the run as "prepared with another tokenizer", where the workers would set that checkpoint aside
    and resume from the one before. What its commit marker recorded is what it was trained with."""
    import hashlib
    import json

    from aura_hpc.config import load_config
    from aura_hpc.errors import DataError
    from aura_hpc.launch.run_setup import _check_same_tokenizer

    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "step_00000005"
    shutil.copytree(prepared / "tokenizer", ckpt / "tokenizer")
    tok = ckpt / "tokenizer" / "tokenizer.json"
    recorded = {"size": tok.stat().st_size, "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}
    (ckpt / "COMPLETE.json").write_text(json.dumps({"step": 5, "files": {"tokenizer/tokenizer.json": recorded}}))
    tok.write_bytes(tok.read_bytes()[:-10])  # damaged: cut short
    cfg = load_config(None, [f"data.path={prepared}"], output_dir=str(tmp_path / "runs"), run_name="tiny")
    _check_same_tokenizer(cfg)
    recorded["sha256"] = "0" * 64  # another tokenizer's, as the marker says: refused, whatever the copy holds
    (ckpt / "COMPLETE.json").write_text(json.dumps({"step": 5, "files": {"tokenizer/tokenizer.json": recorded}}))
    with pytest.raises(DataError, match="was prepared with another tokenizer than the one run"):
        _check_same_tokenizer(cfg)
    # A stream encodes with data.tokenizer: another one of the same size loaded the old embeddings for new ids, said
    # only as "other data" by the workers.
    recorded["sha256"] = hashlib.sha256((prepared / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    (ckpt / "COMPLETE.json").write_text(json.dumps({"step": 5, "files": {"tokenizer/tokenizer.json": recorded}}))
    other = tmp_path / "other-tokenizer"
    shutil.copytree(prepared / "tokenizer", other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"vocab"', '"vocab" ', 1))
    (tmp_path / "raw.txt").write_text("hola\n")
    for tokenizer, refused in ((prepared, False), (other, True)):
        stream = [f"data.path={tmp_path / 'raw.txt'}", "data.stream=true", f"data.tokenizer={tokenizer}"]
        cfg = load_config(None, stream, output_dir=str(tmp_path / "runs"), run_name="tiny")
        if not refused:
            _check_same_tokenizer(cfg)
            (ckpt / "config.yaml").write_text(cfg.to_yaml())  # what the checkpoint's run encoded with
            continue
        with pytest.raises(
            DataError, match=r"data.tokenizer .* is another tokenizer than the one run .* \(fix: --set data.tokenizer="
        ) as said:
            _check_same_tokenizer(cfg)
        assert f"data.tokenizer={prepared}, the one it was trained with" in str(said.value), said.value
        (ckpt / "config.yaml").unlink()  # unknown: a copy of the checkpoint's own, which pruning would remove
        with pytest.raises(DataError) as said:
            _check_same_tokenizer(cfg)
        assert f"a copy of {ckpt / 'tokenizer'} made outside checkpoints/" in str(said.value), said.value
    # A stream's own tokenizer folder with its tokenizer.json cut short (a copy interrupted): tokenizers' traceback before.
    from aura_hpc.data.tokenizer import STREAM_TOKENIZER_FIX
    from aura_hpc.launch.run_setup import preflight_stream

    (other / "tokenizer.json").write_bytes((prepared / "tokenizer" / "tokenizer.json").read_bytes()[:-10])
    cfg = load_config(None, [f"data.path={tmp_path / 'raw.txt'}", "data.stream=true", f"data.tokenizer={other}"], run_name="tiny")
    with pytest.raises(DataError, match=re.escape(f"{other / 'tokenizer.json'} could not be read as a tokenizer (")) as said:
        preflight_stream(cfg)
    assert str(said.value).endswith(f"(fix: {STREAM_TOKENIZER_FIX})"), said.value


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["local", "--max-step", "100"], "--max-step: did you mean --set train.max_steps=100?"),
        (["local", "--lr=0.01"], "--lr: did you mean --set train.lr=0.01?"),
        (["local", "--mastr-port", "5"], "--mastr-port: did you mean --master-port?"),
        (["local", "--nproc_per_node", "2"], "--nproc_per_node: did you mean --nproc-per-node?"),
        # torchrun's words for the default are taken (auto, gpu); anything else is named with the fix.
        (["local", "--nproc-per-node", "all"], "'all' is no count (fix: a number, or omit it for one per GPU, 2 on CPU)"),
    ],
)
def test_a_mistyped_flag_gets_one_line_naming_the_flag_or_setting_it_meant(args: list[str], hint: str) -> None:
    """argparse's 13-line usage block buried the hint, and a config key was matched against flags only
    (`--max-step` was "did you mean --master-port?")."""
    if args[-1] == "all":
        auto = run_cli(["local", "--dry-run", "--nproc-per-node", "auto"], timeout=60)
        assert auto.returncode == 0 and "2 processes" in auto.stdout, auto.stderr
    r = run_cli(args, timeout=60)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert hint in lines[0] and f"(see: python -m aura_hpc {args[0]} --help)" in lines[0], lines[0]


def test_a_dry_run_shows_a_memory_plan_that_does_not_fit_and_force_starts_it_anyway(tmp_path: Path, prepared: Path) -> None:
    """Before, a dry run of a model too big for this machine printed only the refusal, and --force (which
    says it starts anyway) changed nothing."""
    big = ["local", "--output-dir", str(tmp_path), "--set", f"data.path={prepared}", "--set", "model.n_layer=200"]
    big += ["--set", "model.n_embd=4096", "--set", "model.n_head=32", "--dry-run"]
    r = run_cli(big, timeout=60)
    assert r.returncode == 2, r.stderr  # the plan is shown, and the status is the run's (a script gating on it stops)
    assert "memory plan per device" in r.stdout and "total per process" in r.stdout, r.stdout
    assert "local would refuse this: the memory plan needs" in r.stderr and "or --force to try anyway" in r.stderr, r.stderr
    forced = run_cli([*big, "--force"], timeout=60)
    assert forced.returncode == 0 and "--force: starting although the memory plan needs" in forced.stderr, forced.stderr
    assert "would refuse" not in forced.stderr and not (tmp_path / "tiny").exists()


def test_a_dry_run_refuses_a_sample_prompt_longer_than_the_context_as_the_run_would() -> None:
    """A 5,000-character train.sample_prompt passed --dry-run and was refused by the real run."""
    r = run_cli(["local", "--dry-run", "--set", "train.sample_prompt=" + "hola " * 1000], timeout=60)
    assert r.returncode == 2 and "local would refuse this: train.sample_prompt is ~" in r.stderr, r.stderr
    assert "(fix: a shorter train.sample_prompt)" in r.stderr


def test_a_run_whose_killed_launchers_workers_still_run_is_refused_until_they_exit(tmp_path: Path, prepared: Path) -> None:
    """kill -9 of a launcher leaves its workers to finish their step and checkpoint: a re-run that took the lock
    meanwhile trained beside them (two trainers, one run directory). A stand-in worker: the same command line."""
    import json
    import os
    import subprocess
    import sys

    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "since": "now"}))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "-m", "aura_hpc.train", str(run / "config.yaml")])
    args = ["local", "--output-dir", str(tmp_path / "runs"), f"--set=data.path={prepared}", "--set", "train.max_steps=2"]
    try:
        refused = run_cli(args, cwd=tmp_path, timeout=60)
        said = refused.stderr.strip()
        assert refused.returncode == 2 and f"launcher (PID {gone.pid}) is gone but its workers still run (PIDs {worker.pid})" in said, said
        assert f"(fix: wait for them, or kill {worker.pid})" in said and not (run / "checkpoints").exists()
        # status lists it (that state raised, and `status` with no target failed for every run), cancel names the PIDs.
        (run / "config.yaml").write_text("run_name: tiny\noutput_dir: runs\nmodel: {}\ndata: {}\ntrain: {}\n")  # the killed launcher's
        (run / "summary.json").write_text('{"step": 5}')  # an earlier segment's (train.stop_at): it read as STOPPED
        listed = run_cli(["status", "--json"], cwd=tmp_path, timeout=60)
        [row] = [r for r in json.loads(listed.stdout)["jobs"] if r["job_id"] == "local"]
        assert row["state"] == "STOPPING" and f"(PIDs {worker.pid})" in row["reason"], listed.stdout + listed.stderr
        cancel = run_cli(["cancel", str(run)], cwd=tmp_path, timeout=60)
        assert cancel.returncode == 2 and f"kill {worker.pid}" in cancel.stderr, cancel.stderr
    finally:
        worker.kill()
        worker.wait()
    # A lock of an earlier boot (a power cut) names a PID another program may hold now.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    old_boot = {"host": socket.gethostname(), "pid": stranger.pid, "since": "before the reboot", "boot_id": "an-earlier-boot"}
    (run / "run.lock").write_text(json.dumps(old_boot))
    try:
        assert run_cli(args, cwd=tmp_path, timeout=300).returncode == 0
    finally:
        stranger.kill()
        stranger.wait()
    assert not os.path.exists(run / "run.lock")


def test_ifname_wins_over_an_exported_gloo_socket_ifname_on_a_lan_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--ifname on a LAN node was overridden, in silence, by a GLOO_SOCKET_IFNAME left in the shell (compose.yaml
    passes it through); on one machine the flag won. Without the flag, the environment still beats the route, when it
    names an interface of this machine (one that does not is refused before any worker starts)."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.launch.local import plan_local

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    lan = {"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1", "master_port": 29999}
    assert plan_local(None, [], str(tmp_path), "x", **lan, ifname="lo").env["GLOO_SOCKET_IFNAME"] == "lo"  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match=r"GLOO_SOCKET_IFNAME=bogus0 \(exported here\) names no interface"):
        plan_local(None, [], str(tmp_path), "x", **lan)  # type: ignore[arg-type]
    from aura_hpc.ops.network import _ipv4_interfaces, route_to

    # A real interface other than the route's, where there is one: the exported name, not the route's, reaches gloo.
    other = sorted(_ipv4_interfaces() - {route_to("127.0.0.1")[1]}) or sorted(_ipv4_interfaces())
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", other[0])
    assert plan_local(None, [], str(tmp_path), "x", **lan).env["GLOO_SOCKET_IFNAME"] == other[0]  # type: ignore[arg-type]
    # NCCL's variable is refused where NCCL runs, not on a GPU machine told to use gloo (it was).
    import aura_hpc.launch.local as local

    monkeypatch.setattr(local, "_cuda_count", lambda: 2)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "bogus1")
    on_gloo = plan_local(None, ["dist.backend=gloo"], str(tmp_path), "x")
    assert on_gloo.nproc == 2 and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in on_gloo.env
    with pytest.raises(LaunchError, match=r"NCCL_SOCKET_IFNAME=bogus1 \(exported here\) names no interface"):
        plan_local(None, [], str(tmp_path), "x")
    # NCCL's workers end at a failed collective without first aborting its communicators (which can hang), as under
    # the cluster profiles: torch's agent gives them TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless the launcher has one.
    import types

    import torch

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", other[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30, major=9))
    assert plan_local(None, [], str(tmp_path), "x").env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's own choice
    assert plan_local(None, [], str(tmp_path), "x").env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "bogus1")
    # `check` asks the same where NCCL would run (it looked at GLOO_SOCKET_IFNAME alone): told --backend nccl, or
    # auto on a GPU machine; not told gloo, nor given --ifname (which replaces both).
    import aura_hpc.ops.check as check

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", other[0])
    with pytest.raises(LaunchError, match=r"NCCL_SOCKET_IFNAME=bogus1 \(exported here\) names no interface"):
        check.cluster_args(2, 1, "127.0.0.1", 29999, backend="nccl")
    monkeypatch.setattr(check, "gpu_nodes_here", lambda: True)
    with pytest.raises(LaunchError, match=r"NCCL_SOCKET_IFNAME=bogus1"):
        check.cluster_args(2, 1, "127.0.0.1", 29999)
    assert check.cluster_args(2, 1, "127.0.0.1", 29999, backend="gloo") is not None
    assert check.cluster_args(2, 1, "127.0.0.1", 29999, backend="nccl", ifname="lo") is not None
