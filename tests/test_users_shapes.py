"""The shapes users run, on one CPU box: two `local` launchers of two processes each (= 2 nodes x N GPUs),
bf16, one run folder the nodes share (NFS), a tiny validation split, unequal nodes, a node that differs.

The probes watch every run: the quiet steps read nothing back to the host (AURA_PROBE_STEPS), and every
collective of the whole run, start-up, link measurement, evaluation, checkpoints and DiLoCo's meetings
included, gets only tensors made where its group's tensors live, and nothing reseeds every GPU's
generator (AURA_PROBE_RUN). What a CPU run cannot see: NCCL itself, CUDA streams and the bf16 kernels
of a GPU (docs/speed.md names that gap)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_MODEL, cli_env, free_port

STEPS, NAN_STEP, INF_STEP = 20, 7, 13
# Meetings every 4 steps in int8, each landing 2 steps later (selftest's settings), one replica per node.
DILOCO = ("dist.sync_every=4", "dist.diloco_overlap=2", "dist.diloco_wire=int8", "dist.diloco_replicas=0")
DEEPSPEED_SITES = ("deepspeed/runtime/utils.py", "deepspeed/runtime/zero/stage3.py", "deepspeed/runtime/zero/stage_1_and_2.py")


def _node_args(folder: Path, name: str, prepared: Path, port: int, rank: int, nproc: int, *sets: str) -> list[str]:
    args = [
        "local", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--nproc-per-node", str(nproc), "--output-dir", str(folder), "--run-name", name, "--set", f"data.path={prepared}",
        *SMALL_MODEL, "--set", f"train.max_steps={STEPS}", "--set", "train.warmup_steps=2",
    ]  # fmt: skip
    for kv in sets:
        args += ["--set", kv]
    return args


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", *args], env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _two_nodes(runs: dict[str, tuple[list[str], list[str], dict[str, str]]], timeout: float = 900) -> dict[str, list[str]]:
    """Each run's two launchers (node 0 first; node 1 once node 0 has written the run's secret, which it
    reads from the folder they share), every run at once. The output of each launcher, node 0 first."""
    procs = {name: [_launch(node0, env)] for name, (node0, _, env) in runs.items()}
    for name, (node0, node1, env) in runs.items():
        secret = Path(node0[node0.index("--output-dir") + 1]) / name / "run.secret"
        deadline = time.monotonic() + 120
        while not secret.exists() and time.monotonic() < deadline and procs[name][0].poll() is None:
            time.sleep(0.1)
        procs[name].append(_launch(node1, env))
    out: dict[str, list[str]] = {}
    for name, pair in procs.items():
        texts = []
        for p in pair:
            try:
                texts.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                texts.append(p.communicate()[0] + "\n[hung: killed by the test]")
            texts[-1] += f"\n[exit {p.returncode}]"
        out[name] = texts
    return out


def _two_nodes_secrets(node0: list[str], node1: list[str], env0: dict[str, str], env1: dict[str, str]) -> list[str]:
    """One run's two launchers, each with its own environment (node 1 started once node 0 listens)."""
    first = _launch(node0, env0)
    time.sleep(3)
    second = _launch(node1, env1)
    texts = []
    for p in (first, second):
        try:
            texts.append(p.communicate(timeout=300)[0] + f"\n[exit {p.returncode}]")
        except subprocess.TimeoutExpired:
            p.kill()
            texts.append(p.communicate()[0] + "\n[hung: killed by the test]\n[exit -9]")
    return texts


def _exit(text: str) -> int:
    return int(text.rsplit("[exit ", 1)[1].split("]")[0])


def _run_probe(run: Path, rank: int) -> dict:
    return json.loads((run / "probes" / f"run_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> tuple[Path, dict[str, list[str]]]:
    """ddp, fsdp, zero2, zero3 and DiLoCo (one replica per node) on 2 nodes x 2 processes, bf16, sharing
    one run folder: 20 steps, a NaN loss on the last rank at step 7, an inf in one gradient of rank 1 at
    step 13 (its loss finite: DeepSpeed 0.17+ under bf16 skipped that step itself, unsaid), evaluation of 9 sequences in batches of 2
    (rank 0 holds 3, two forwards; the others 2, one: the shorter ranks run one more, counted zero),
    checkpoints and samples at 10."""
    folder = tmp_path_factory.mktemp("shapes")
    # 128 wide: the embedding (1,024 x 128) is above DeepSpeed's stage3_param_persistence_threshold, so under
    # zero3 it is partitioned and evaluation, samples and the exported weights all go through the gather.
    common = (
        "model.n_embd=128", "train.precision=bf16", "train.batch_size=2", "train.eval_sequences=9", "train.eval_every=10",
        "train.checkpoint_every=10", "train.sample_every=10", "train.log_every=10", "train.fused_optimizer=true",
    )  # fmt: skip
    strategies = {"ddp": (), "fsdp": (), "zero2": (), "zero3": (), "diloco": DILOCO}
    env = {"AURA_PROBE_STEPS": f"3-{STEPS - 2}", "AURA_PROBE_RUN": "1", "AURA_FAULT_NAN": f"3:{NAN_STEP}:1"}
    env["AURA_FAULT_GRADINF"] = f"1:{INF_STEP}"
    runs = {}
    for name, extra in strategies.items():
        port = free_port()
        sets = (*common, f"dist.strategy={name}", *extra)
        runs[name] = (
            _node_args(folder, name, prepared, port, 0, 2, *sets),
            _node_args(folder, name, prepared, port, 1, 2, *sets),
            env,
        )
    return folder, _two_nodes(runs)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero2", "zero3", "diloco"])
def test_two_nodes_of_two_processes_train_in_bf16_with_nothing_a_gpu_would_refuse(shapes: tuple[Path, dict], name: str) -> None:
    folder, outputs = shapes
    node0, node1 = outputs[name]
    assert _exit(node0) == 0 and _exit(node1) == 0, node0[-3000:] + "\n=====\n" + node1[-3000:]
    run = folder / name
    # Ranks numbered node by node from the node the user calls 0; each node read its own settings file.
    assert "start rank=0 local_rank=0 world_size=4 node_rank=0" in node0 and (run / "config.node1.yaml").is_file()
    # The NaN on rank 3 skipped that update on every rank, alone, and so did the inf gradient (named where it
    # was seen: the rank, or under ZeRO the ranks whose partitions it reached); no rollback followed.
    assert f"non-finite loss or gradient on rank(s) [3] at step {NAN_STEP}: update skipped (1 in a row)" in node0
    assert re.search(rf"on rank\(s\) \[[\d, ]*\] at step {INF_STEP}: update skipped \(1 in a row\)", node0), node0[-3000:]
    assert node0.count("update skipped") == 2 and "rolled back" not in node0
    # Evaluation of 9 sequences in batches of 2 over 4 ranks (sharded: every forward is collective) finished.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [10, 20], rows
    for rank in range(4):
        step_probe = json.loads((run / "probes" / f"rank{rank}.json").read_text())
        sites = [s for s in [*step_probe["syncs"], *step_probe["placement"]] if not any(d in s for d in DEEPSPEED_SITES)]
        assert step_probe["syncs_counted"] and not sites, (rank, sites)
        probe = _run_probe(run, rank)
        assert probe["host_tensors_tracked"] and not probe["host_tensors"] and not probe["reseeds"], (rank, probe)
    # The link between the nodes was measured (collectives on the group's device, timed after a sync).
    assert "DDP would spend" in node0


def test_the_exported_weights_are_the_fp32_masters(shapes: tuple[Path, dict]) -> None:
    """bf16 trains a bf16 copy under ZeRO (the fp32 masters live in DeepSpeed's optimizer) and bf16
    compute under fsdp and ddp (fp32 parameters): model/ holds the fp32 weights, what the shards hold."""
    from safetensors.torch import load_file

    from aura_hpc.train.checkpoint.consolidate import _from_dcp, _from_deepspeed

    folder, _ = shapes
    for name in ("zero2", "zero3", "fsdp"):
        ckpt = folder / name / "checkpoints" / f"step_{STEPS:08d}"
        exported = load_file(str(ckpt / "model" / "model.safetensors"))
        shards = _from_dcp(ckpt / "sharded") if name == "fsdp" else _from_deepspeed(ckpt / "sharded")
        masters = {k.removeprefix("model."): v for k, v in shards.items()}
        assert all(v.dtype == torch.float32 for v in exported.values())
        assert set(exported) <= set(masters), set(exported) - set(masters)
        assert all(torch.equal(exported[k], masters[k].float()) for k in exported), name
        # Not a bf16 copy: the masters are not bf16 values.
        assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in exported.values()), name
        # The precision DeepSpeed named its optimizer files by is recorded: a resume in fp32 is refused in one line.
        assert json.loads((ckpt / "meta.json").read_text())["bf16"] is True
        optim_files = list((ckpt / "sharded").rglob("*optim_states.pt"))
        assert name == "fsdp" or (optim_files and all(f.name.startswith("bf16_") for f in optim_files)), optim_files
    # The checkpoint at step 10 holds shards alone: `generate` makes its full weights from DeepSpeed's
    # partitions (zero_to_fp32) on demand, and its stdout holds the samples only.
    from tests.conftest import run_cli

    earlier = folder / "zero3" / "checkpoints" / "step_00000010"
    assert not (earlier / "model" / "model.safetensors").exists()
    run = folder / "zero3-copy"
    import shutil

    shutil.copytree(folder / "zero3", run, ignore=shutil.ignore_patterns(f"step_{STEPS:08d}"))
    g = run_cli(["generate", "--run", str(run), "--max-new-tokens", "5"], timeout=300)
    assert g.returncode == 0 and g.stdout.strip() and "zero checkpoint" not in g.stdout and "Gathering" not in g.stdout, g.stdout + g.stderr
    assert (run / "checkpoints" / "step_00000010" / "model" / "model.safetensors").is_file()


def test_diloco_puts_one_copy_of_a_meeting_per_node_on_the_wire(shapes: tuple[Path, dict]) -> None:
    """One replica per node: only each node's first rank (the replica's leader) meets the other node, and
    hands the result to its node's other rank. Meetings at 4, 8, 12, 16 (int8, over 2 steps) and 20."""
    folder, _ = shapes
    sent = {rank: _run_probe(folder / "diloco", rank)["bytes"] for rank in range(4)}
    payload = sent[0].get("diloco-outer", 0)
    assert payload > 0 and sent[2].get("diloco-outer") == payload, sent
    assert "diloco-outer" not in sent[1] and "diloco-outer" not in sent[3], sent
    # int8: one byte a parameter plus a scale per 4,096, five meetings; the other ranks of a node get it inside the node.
    n_params = json.loads((folder / "diloco" / "summary.json").read_text())["n_params"]
    blocks = -(-n_params // 4096)
    per_meeting = blocks * 4096 + 4 * blocks
    assert payload == 5 * per_meeting, (payload, per_meeting)
    assert sent[1].get("diloco-inner", 0) > 0


def test_nodes_compare_a_deepspeed_configs_contents_not_its_path(tmp_path: Path) -> None:
    """dist.deepspeed_config was compared as a path: two laptops with another JSON at one path trained on (ZeRO's
    buckets then differ: a hang), and one JSON kept at two paths was refused."""
    from aura_hpc.config import load_config
    from aura_hpc.train.parts.build import _shared_settings

    def settings(name: str, text: str) -> dict[str, str]:
        (tmp_path / name).write_text(text)
        return _shared_settings(load_config("tiny", ["dist.strategy=zero2", f"dist.deepspeed_config={tmp_path / name}"]))

    bucket = '{"zero_optimization": {"reduce_bucket_size": %d}}'
    assert settings("a.json", bucket % 5e7) == settings("b.json", bucket % 5e7)  # elsewhere on each machine: the same
    first = settings("a.json", bucket % 5e7)
    assert first != settings("a.json", bucket % 2e8)  # the same path, another content
    # The same settings in another key order, and the paths each machine places itself (offload's NVMe, a monitor's
    # folder), were refused as different.
    nvme = '{"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "%s"}, "reduce_bucket_size": 50000000}}'
    reordered = '{"zero_optimization": {"reduce_bucket_size": 50000000, "offload_param": {"nvme_path": "%s", "device": "nvme"}}}'
    assert settings("a.json", nvme % "/local_nvme") == settings("b.json", reordered % "/mnt/ssd")
    assert settings("a.json", nvme % "/local_nvme") != settings("b.json", (nvme % "/mnt/ssd").replace('nvme"', 'cpu"', 1))


def test_unequal_nodes_train_and_differing_settings_or_secrets_are_refused(tmp_path: Path, prepared: Path) -> None:
    """A 2-process node beside a 1-process one (a 2-GPU desktop and a 1-GPU laptop): DiLoCo trains one
    replica per node (before: mismatched groups, hung until killed). Two nodes sharing a run folder with
    another train.lr: refused (before: node 1's config.yaml replaced node 0's, and both trained at it).
    A node that does not hold the run's secret (a stranger at the port, or a mistyped one): both stop
    at once, before any collective. A sharded strategy on nodes that share no storage: refused before step 1."""
    port_a, port_b, port_c, port_d = free_port(), free_port(), free_port(), free_port()
    unequal = ("dist.strategy=diloco", "dist.sync_every=4", "train.eval_every=0", "train.checkpoint_every=10", "train.max_steps=12")
    runs = {
        "unequal": (
            _node_args(tmp_path, "unequal", prepared, port_a, 0, 2, *unequal),
            _node_args(tmp_path, "unequal", prepared, port_a, 1, 1, *unequal),
            {"AURA_PROBE_RUN": "1"},
        ),
        "differ": (
            _node_args(tmp_path, "differ", prepared, port_b, 0, 1, "train.lr=0.001"),
            _node_args(tmp_path, "differ", prepared, port_b, 1, 1, "train.lr=0.01"),
            {},
        ),
        # No storage shared between the nodes, under a sharded strategy: each rank writes its shards into rank 0's
        # checkpoint folder, and node 1 wrote them into its own (rank 0 committed checkpoints that lacked them).
        "apart": (
            _node_args(tmp_path / "a0", "apart", prepared, port_d, 0, 1, "dist.strategy=fsdp"),
            _node_args(tmp_path / "a1", "apart", prepared, port_d, 1, 1, "dist.strategy=fsdp"),
            {},
        ),
    }
    out = _two_nodes(runs, timeout=300)
    ours, theirs = {"AURA_RUN_SECRET": "the-runs-own-secret-000"}, {"AURA_RUN_SECRET": "another-secret-00000000"}
    node0, node1 = _two_nodes_secrets(
        _node_args(tmp_path / "n0", "stranger", prepared, port_c, 0, 1),
        _node_args(tmp_path / "n1", "stranger", prepared, port_c, 1, 1),
        ours,
        theirs,
    )
    for text in (node0, node1):
        assert _exit(text) == 2 and "did not prove this run's secret" in text and "step 1" not in text, text[-2000:]
    node0, node1 = out["unequal"]
    assert _exit(node0) == 0 and _exit(node1) == 0, node0[-3000:] + "\n=====\n" + node1[-3000:]
    assert "all 3 ranks finished at step 12" in node0
    bytes_of = [_run_probe(tmp_path / "unequal", r)["bytes"] for r in range(3)]
    assert [("diloco-outer" in b) for b in bytes_of] == [True, False, True], bytes_of  # leaders: rank 0 (node 0), rank 2 (node 1)
    for text in out["apart"]:
        assert _exit(text) == 2 and "step 1" not in text, text[-2000:]
        assert "rank(s) 1 do not see rank 0's" in text and "fix: an output_dir on storage every node shares" in text, text[-2000:]
    for text in out["differ"]:
        assert _exit(text) == 2, text[-2000:]
        assert "runs a different config than rank" in text and "train.lr is" in text and "(fix: pass the same" in text
        assert "step 1" not in text  # refused before any collective that depends on the settings (a different dist section hung there)
