"""Config tree: shipped presets load; bad keys, types and combinations fail with one-line fixes."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aura_hpc.config import load_config, load_run_file, shipped_configs
from aura_hpc.errors import ConfigError
from tests.conftest import run_cli


def test_every_shipped_config_loads() -> None:
    shipped = shipped_configs()
    assert {"tiny", "gpt2-small", "gpt2-medium", "gpt2-1b"} <= set(shipped)
    params = {}
    for name in shipped:
        cfg = load_config(name)
        # A model preset names itself; a run preset (hrm-*, a cluster recipe) builds on a model one.
        if cfg.model.preset != name:
            assert name.startswith("hrm-") and load_config(cfg.model.preset).model.preset == cfg.model.preset
        m = cfg.model
        # GPT-2 parameter count without embeddings: ~12 * layers * width^2.
        params[name] = 12 * m.n_layer * m.n_embd**2
    assert 80e6 < params["gpt2-small"] < 90e6  # 124M with the 50k-token embedding
    assert 280e6 < params["gpt2-medium"] < 320e6
    assert 0.9e9 < params["gpt2-1b"] < 1.2e9
    assert 0.9e9 < params["hrm-1b-8xh200"] < 1.2e9
    assert 3.0e9 < params["gpt2-3b"] < 3.3e9


def test_defaults_are_the_tiny_preset() -> None:
    assert load_config(None) == load_config("tiny")


def test_override_precedence_and_types() -> None:
    cfg = load_config("gpt2-small", ["train.lr=3e-4", "train.batch_size=4", "train.allow_oversubscription=yes"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.batch_size == 4
    assert cfg.train.allow_oversubscription is True
    assert cfg.model.n_layer == 12  # from the file
    assert cfg.train.warmup_steps == 700


def test_model_preset_sets_the_model_shape() -> None:
    cfg = load_config(None, ["model.preset=gpt2-medium", "model.n_layer=6"])
    assert (cfg.model.n_embd, cfg.model.n_head, cfg.model.n_layer) == (1024, 16, 6)
    # Over a config file with its own model keys: the preset the command line names is the shape (it kept
    # gpt2-small's 12 x 768 under the label gpt2-medium).
    cfg = load_config("gpt2-small", ["model.preset=gpt2-medium"])
    assert (cfg.model.preset, cfg.model.n_embd, cfg.model.n_layer) == ("gpt2-medium", 1024, 24)


def test_cli_output_dir_and_run_name_win() -> None:
    cfg = load_config("tiny", ["output_dir=a", "run_name=b"], output_dir="/x", run_name="y")
    assert str(cfg.run_dir) == "/x/y"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.lrr=1"], "unknown config key 'train.lrr': did you mean 'train.lr'?"),
        (["trian.lr=1"], "unknown config key 'trian.lr'"),
        (["model.layers=3"], "unknown config key 'model.layers'"),
        (["train.batch_size=abc"], "train.batch_size must be a whole number, got 'abc'"),
        (["train.batch_size=2.5"], "train.batch_size must be a whole number"),
        (["train.lr=fast"], "train.lr must be a number"),
        (["train.allow_oversubscription=maybe"], "must be true or false"),
        (["train.batch_size=0"], "train.batch_size must be greater than 0"),
        (["model.n_layer=-1"], "model.n_layer must be greater than 0"),
        (["train.lr=0"], "train.lr must be greater than 0"),
        (["model.n_embd=130"], "model.n_embd (130) must be divisible by model.n_head (4)"),
        (["data.seq_len=512"], "data.seq_len (512) is longer than model.n_positions (256)"),
        (["dist.backend=mpi"], "dist.backend must be one of auto, nccl, gloo"),
        (["train.precision=fp8"], "train.precision must be one of"),
        (["train.stop_at=500"], "train.stop_at (500) is after train.max_steps"),
        (["run_name=../escape"], "run_name '../escape' must be"),
        (["model.preset=gpt5"], "model.preset 'gpt5' is unknown"),
        (["lr"], "is not KEY=VALUE"),
        (["tracking.finish_wait_s=-1"], "tracking.finish_wait_s must be 0 or more seconds"),
        (["health.screen_peer_fraction=1.5"], "health.screen_peer_fraction must be between 0 and 1, not 1.5"),
        # Each was a Python traceback (OverflowError) instead of a line.
        (["train.lr=1" + "0" * 400], "train.lr must be a number"),
        (["train.max_steps=1" + "0" * 400], "train.max_steps must be a whole number below 2**63"),
        # 30 for 3.0 opened the breaker on every healthy GPU (exit 76, "drain the node").
        (["health.temp_margin_c=30"], "health.temp_margin_c must be between 0 and 20 C"),
        (["health.throttle_samples=0"], "health.throttle_samples at least 1"),
        # `local` has a --nodes of its own (machines): the fix names the setting itself.
        (["slurm.nodes=0"], "(fix: --set slurm.nodes=1, or submit's --nodes 1)"),
        # A token in the query was stored in config.yaml, every checkpoint, and sent to the trackers.
        (["tracking.mlflow_uri=https://mlflow.example.com/?token=SECRET"], "tracking.mlflow_uri holds a user name, password or query"),
        # Accepted, then refused by MLflow inside the run (its file store is in maintenance mode): no tracker, a warning.
        (["tracking.mlflow_uri=file:/tmp/mlruns"], "which MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true"),
        # Each accepted, then refused by the tracker's own start: that tracker off for the whole run, one warning.
        (
            ["tracking.backends=wandb", "tracking.project=exp:v2#3"],
            "which W&B refuses in a project name (fix: --set tracking.project=expv23)",
        ),
        (["tracking.backends=trackio", "tracking.project=registry-es"], "begins with 'registry-', which trackio keeps"),
        (["tracking.backends=trackio", "tracking.project=model_artifacts"], "ends with '_artifacts', which trackio keeps"),
    ],
)
def test_bad_overrides_give_one_line_errors(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert expected in msg
    assert "\n" not in msg
    assert "fix" in msg or "valid keys" in msg or "did you mean" in msg


def test_unknown_key_is_one_short_line_with_the_closest_key_only_when_there_is_one(tmp_path: Path) -> None:
    for overrides, suggestion in (
        (["train.learning_rate=1"], None),
        (["train.nonexistent_key=1"], None),  # suggested train.weight_decay before
        (["trian.lr=1"], "train.lr"),
        (["train.wight_decay=1"], "train.weight_decay"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        msg = str(err.value)
        assert len(msg) < 200 and "config --keys" in msg and "section has" not in msg, msg
        assert (f"did you mean '{suggestion}'" in msg) if suggestion else ("did you mean" not in msg), msg
    keys = run_cli(["config", "--keys"])
    assert keys.returncode == 0 and "dist.backend" in keys.stdout and "train.max_steps" in keys.stdout
    shown = run_cli(["config", "--config", "gpt2-small", "--set", "train.lr=3e-4"])
    assert shown.returncode == 0 and "lr: 0.0003" in shown.stdout and "n_embd: 768" in shown.stdout
    # A preset or a run directory named plainly, as `local --config` and `status RUN_DIR` take them.
    assert run_cli(["config", "gpt2-small", "--set", "train.lr=3e-4"]).stdout == shown.stdout
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    made = run_cli(["config", "gpt2-small", "--output-dir", str(tmp_path / "runs"), "--run-name", "mine"])
    (run / "config.yaml").write_text(made.stdout)  # as `local` stores it: output_dir whole
    stored = run_cli(["config", str(run)])
    assert stored.returncode == 0 and stored.stdout == made.stdout and "run_name: mine" in made.stdout, stored.stderr
    two = run_cli(["config", "gpt2-small", "--config", "tiny"])
    assert two.returncode == 2 and "two configs given, gpt2-small and --config tiny (fix: name one" in two.stderr, two.stderr
    empty = run_cli(["config", str(tmp_path / "runs")])
    assert empty.returncode == 2 and "holds no config.yaml (fix: a run directory local or submit made" in empty.stderr, empty.stderr


def test_bad_yaml_files(tmp_path: Path) -> None:
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("train:\n  max_step: 10\n")
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'train.max_step': did you mean 'train.max_steps'")):
        load_config(str(bad_key))
    broken = tmp_path / "b.yaml"
    broken.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(broken))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="neither a file nor a shipped preset"):
        load_config("gpt2-huge")
    text_as_number = tmp_path / "d.yaml"  # became "1.5": another run directory than `--set run_name=1.50`
    text_as_number.write_text("run_name: 1.50\n")
    with pytest.raises(ConfigError, match=r"run_name is text, and YAML read 1\.5 as a number \(fix: quote it"):
        load_config(str(text_as_number))
    assert load_config(None, ["run_name=1.50"]).run_name == "1.50"
    long_number = tmp_path / "c.yaml"  # PyYAML's int() of 5,000 digits raised ValueError through everything
    long_number.write_text("train:\n  max_steps: 1" + "0" * 5000 + "\n")
    with pytest.raises(ConfigError, match="holds a value YAML cannot read"):
        load_config(str(long_number))


def test_a_preset_is_the_preset_whatever_the_folder_holds_and_paths_may_name_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config tiny --output-dir .` makes ./tiny; the same command then read it as the config ("a folder").
    `$SCRATCH` in a file's path was taken literally: the run went to a folder named `${SCRATCH}`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "gpt2-small").write_text("notes\n")
    assert load_config("tiny").model.n_layer == load_config(str(shipped_configs()["tiny"])).model.n_layer
    assert load_config("gpt2-small").model.n_embd == 768
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config("./gpt2-small")  # a path says it is one
    conf = tmp_path / "c.yaml"
    conf.write_text("output_dir: ${AURA_TEST_SCRATCH}/runs\ndata:\n  path: $AURA_TEST_SCRATCH/es\n")
    monkeypatch.setenv("AURA_TEST_SCRATCH", "/scratch/u")
    cfg = load_config(str(conf))
    assert (cfg.output_dir, cfg.data.path) == ("/scratch/u/runs", "/scratch/u/es")
    monkeypatch.delenv("AURA_TEST_SCRATCH")
    with pytest.raises(
        ConfigError, match=rf"^{conf}: output_dir names \$\{{AURA_TEST_SCRATCH\}}, which is not set here \(fix: export AURA_TEST_SCRATCH="
    ):
        load_config(str(conf))
    # Each refusal of a file's value names the file (with a preset, a file and --set, the user guessed which).
    conf.write_text("train:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=rf"^{conf}: unknown config key 'train.lrr': did you mean 'train.lr'\?"):
        load_config(str(conf), ["train.lr=1"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'train.lrr'"):
        load_config(None, ["train.lrr=1"])
    conf.write_text("trian:\n  lr: 1\n")  # a misspelled section: the file's usual slip had no suggestion
    with pytest.raises(ConfigError, match=rf"^{conf}: unknown config key 'trian': did you mean 'train'\?"):
        load_config(str(conf))
    # A section's key at the top of the file: the section that holds it, whatever its name's length.
    slips = (("keep_last: 2", "train.keep_last"), ("strategy: zero2", "dist.strategy"), ("val_fraction: 0.1", "data.val_fraction"))
    for line, meant in slips:
        conf.write_text(line + "\n")
        with pytest.raises(ConfigError, match=rf"^{conf}: unknown config key '{line.split(':')[0]}': did you mean '{meant}'\?"):
            load_config(str(conf))


def test_relative_data_path_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("data:\n  path: prepared/es\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.data.path == str(tmp_path / "prepared" / "es")


def test_values_mean_what_their_author_wrote_and_a_repeated_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """YAML 1.1 read `4:00:00` as 14400 (a job of 10 days, not 4 h), `0123` as 83, `on` as true; a
    section written twice dropped the first in silence; `~` became a folder named `~`."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    own = tmp_path / "sub" / "c.yaml"
    own.parent.mkdir()
    own.write_text(
        "output_dir: myruns\nslurm:\n  time: 4:00:00\n  account: 0123\n  partition: on\n"
        "data:\n  path: ~/prepared\ntrain:\n  max_steps: 1_000\n  lr: 3e-4\n  compile: true\n"
    )
    cfg = load_config(str(own))
    assert (cfg.slurm.time, cfg.slurm.account, cfg.slurm.partition) == ("4:00:00", "0123", "on")
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.compile) == (1000, 3e-4, "true")
    assert cfg.data.path == str(tmp_path / "home" / "prepared")
    assert cfg.output_dir == str(own.parent / "myruns")  # relative to the file, as docs/local.md says
    cli = load_config(None, ["slurm.time=30:00", "slurm.qos=0700", "data.cache_dir=~/cache", "data.tokenizer=null"])
    home = str(tmp_path / "home")
    assert (cli.slurm.time, cli.slurm.qos, cli.data.cache_dir, cli.data.tokenizer) == ("30:00", "0700", f"{home}/cache", "")
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 3e-4\nmodel:\n  n_layer: 2\ntrain:\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"line 5 .*key 'train' appears twice.*fix: keep one of them"):
        load_config(str(twice))
    merged = tmp_path / "merged.yaml"  # a YAML merge key is overridden by the keys beside it: not a repeat
    merged.write_text("train:\n  <<: {lr: 0.01, max_steps: 7}\n  lr: 3e-4\n")
    assert (load_config(str(merged)).train.lr, load_config(str(merged)).train.max_steps) == (3e-4, 7)


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("dist.timeout_s=0", "dist.timeout_s must be greater than 0"),
        ("dist.init_timeout_s=-1", "dist.init_timeout_s must be greater than 0"),
        ("train.seed=-1", "train.seed must be 0 or more"),
        ("train.eval_sequences=-1", "train.eval_sequences must be 0 or more"),
        ("train.sample_prompt=", "train.sample_prompt is empty"),
        ("train.sample_prompt=   ", "train.sample_prompt is empty"),
    ],
)
def test_values_a_worker_would_crash_on_are_refused_before_it_starts(setting: str, problem: str) -> None:
    """Each passed the checks, then crashed every rank (a 0 ms store wait, numpy's negative seed) or,
    for the empty prompt, the final sample after the whole run, and every re-run again."""
    with pytest.raises(ConfigError, match=re.escape(problem)) as refused:
        load_config(None, [setting])
    assert "fix: --set" in str(refused.value)


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config("gpt2-small", ["train.lr=1e-4"], output_dir=str(tmp_path), run_name="r")
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_run_file(path) == cfg


def test_cli_rejects_bad_config_before_launching(tmp_path: Path) -> None:
    r = run_cli(["local", "--set", "train.lrr=1", "--output-dir", str(tmp_path)], timeout=60)
    assert r.returncode == 2
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown config key 'train.lrr'" in lines[0]
    assert "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())  # nothing was written


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys\n"
        "from aura_hpc.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'deepspeed', 'numpy') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "local" in r.stdout and "prepare" in r.stdout
    import torch

    from aura_hpc import __version__

    # --version: what a bug report needs, the stack's versions too, without importing it.
    line = next(x for x in r.stdout.splitlines() if x.startswith("aura_hpc "))
    head = f"aura_hpc {__version__} (python {sys.version.split()[0]}, torch {torch.__version__},"
    assert line.startswith(head) and "submitit" in line, line
    assert "HEAVY []" in r.stdout


def test_a_refusal_of_local_on_a_machine_without_gpus_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from aura_hpc.cli import main\n"
        "print('EXIT', main(['local', '--nproc-per-node', '0', '--output-dir', sys.argv[1]]))\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "EXIT 2" in r.stdout and "--nproc-per-node must be at least 1" in r.stderr, r.stdout + r.stderr
    gpu_nodes = glob.glob("/dev/nvidia*") + [p for p in ("/dev/dxg", "/dev/kfd") if os.path.exists(p)]
    if sys.platform.startswith("linux") and not gpu_nodes:
        assert "TORCH False" in r.stdout, r.stdout


def test_a_worker_or_a_check_refuses_a_misspelt_setting_before_importing_torch(tmp_path: Path) -> None:
    """`worker` imported torch (seconds) before it read --set; `check` on one machine never read --config or --set."""
    code = (
        "import sys\n"
        "from aura_hpc.cli import main\n"
        "print('EXIT', main(['worker', '--server', '127.0.0.1', '--set', 'train.lrr=1', '--output-dir', sys.argv[1]]))\n"
        "print('EXIT', main(['check', '--set', 'train.lrr=1']))\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.stdout.count("EXIT 2") == 2 and r.stderr.count("unknown config key 'train.lrr'") == 2, r.stdout + r.stderr
    assert "TORCH False" in r.stdout, r.stdout


def test_generate_refuses_its_arguments_and_a_run_without_checkpoints_without_importing_torch(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    code = (
        "import sys\n"
        "from aura_hpc.cli import main\n"
        "print('EXIT', main(['generate', '--run', sys.argv[1], '--max-new-tokens', '-5']))\n"
        "print('EXIT', main(['generate', '--run', sys.argv[1]]))\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert r.stdout.count("EXIT 2") == 2, r.stdout + r.stderr
    assert "--max-new-tokens must be at least 1" in r.stderr and "no complete checkpoint" in r.stderr, r.stderr
    assert "TORCH False" in r.stdout, r.stdout


def test_a_literal_webhook_url_is_stored_redacted_and_reaches_the_workers_by_environment(tmp_path: Path) -> None:
    from aura_hpc.ops.webhook import resolve_url

    secret = "https://hooks.slack.com/services/T000/B000/SECRET-42"
    cfg = load_config("tiny", [f"health.webhook_url={secret}"])
    stored = cfg.to_yaml()
    assert "SECRET-42" not in stored and "https://hooks.slack.com/<redacted>" in stored
    # A token in a query without a path, in a fragment, or as a password: nothing of it is kept.
    for url in ("https://hooks.example.com?token=SECRET-42", "https://h.example.com:8443#SECRET-42", "https://u:SECRET-42@h.example.com/x"):
        kept = load_config("tiny", [f"health.webhook_url={url}"]).to_yaml()
        assert "SECRET-42" not in kept and "<redacted>" in kept, kept
    path = tmp_path / "config.yaml"
    path.write_text(stored)
    h = load_run_file(path).health
    assert h.webhook_url_env == "AURA_WEBHOOK_URL"
    assert resolve_url(h.webhook_url, h.webhook_url_env, h.webhook_url_file) in ("", secret)
    import os

    os.environ["AURA_WEBHOOK_URL"] = secret
    try:
        assert resolve_url(h.webhook_url, h.webhook_url_env, h.webhook_url_file) == secret
    finally:
        del os.environ["AURA_WEBHOOK_URL"]
    with pytest.raises(ConfigError, match="more than one is set") as exc:
        load_config("tiny", [f"health.webhook_url={secret}", "health.webhook_url_env=HOOK"])
    assert "SECRET-42" not in str(exc.value)
    with pytest.raises(ConfigError, match="not an environment variable name"):
        load_config("tiny", ["health.webhook_url_env=my hook"])
    # Named, and not set where the run starts: every alert was dropped without a word.
    from aura_hpc.launch.run_setup import export_webhook_secret

    for setting in ("health.webhook_url_env=AURA_TEST_NEVER_SET", "health.webhook_url=env:AURA_TEST_NEVER_SET"):
        with pytest.raises(ConfigError, match=r"variable AURA_TEST_NEVER_SET, which is not set here.*\(fix: export AURA_TEST_NEVER_SET="):
            export_webhook_secret(load_config("tiny", [setting]))
    export_webhook_secret(load_config("tiny", [f"health.webhook_url={secret}"]))  # a URL given: exported for the workers
    assert os.environ.pop("AURA_WEBHOOK_URL") == secret


def test_line_breaks_in_values_are_refused_before_yaml_can_fold_them() -> None:
    with pytest.raises(ConfigError, match=r"slurm\.partition contains the character '\\n'"):
        load_config("tiny", ["slurm.partition=a\ntouch x #"])
    with pytest.raises(ConfigError, match=r"U\+0000"):
        load_config("tiny", ["data.path=a\0b"])
    assert load_config("tiny", ["train.sample_prompt=Capítulo I\nEn"]).train.sample_prompt == "Capítulo I\nEn"


def test_a_warmup_longer_than_the_run_is_clamped_with_a_warning() -> None:
    from aura_hpc.config import fit_to_horizon
    from aura_hpc.train.parts.schedule import lr_factor

    cfg = load_config(None, ["train.warmup_steps=1000", "train.max_steps=40"])
    notes = fit_to_horizon(cfg, 2)
    assert len(notes) == 1 and "longer than the run (40 steps): using 40" in notes[0]
    assert [lr_factor(s, cfg.train.warmup_steps, 40, "cosine", 0.1) for s in (0, 19, 39)] == [1 / 40, 0.5, 1.0]
    tokens = load_config(None, ["train.max_tokens=40960", "train.warmup_steps=15"])  # 40,960 / (8 x 4 x 128) = 10 steps
    assert "using 10" in fit_to_horizon(tokens, 4)[0] and fit_to_horizon(load_config(None, ["train.max_tokens=40960"]), 1) == []


def test_fsdp_on_cpu_is_refused_on_a_torch_whose_fsdp_cannot_run_there(tmp_path: Path) -> None:
    from aura_hpc.config.device import fsdp_on_cpu

    with pytest.raises(ConfigError, match=r"needs torch 2\.7 or newer, this is torch 2\.6\.0\+cu124 .*\(fix: --set dist\.strategy=ddp"):
        fsdp_on_cpu("2.6.0+cu124")
    for fine in ("2.7.0", "2.13.0+cpu", "3.0.0a0"):
        fsdp_on_cpu(fine)
    # `local` asks before any worker starts, with the torch its workers will import (the floor's 2.6 in CI).
    import torch

    r = run_cli(["local", "--output-dir", str(tmp_path / "runs"), "--set", "dist.strategy=fsdp", "--dry-run"], timeout=120)
    old = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 7)
    assert (r.returncode == 2 and "needs torch 2.7 or newer" in r.stderr) if old else r.returncode == 0, r.stdout + r.stderr


def test_a_deepspeed_json_is_judged_in_one_line_and_its_batch_size_at_the_real_world_size(tmp_path: Path) -> None:
    """Each was a traceback (ValueError, TypeError, IsADirectoryError, UnicodeDecodeError); and a train_batch_size
    right for 8 GPUs x 8 (64) was refused before launch, judged at world size 1, where a wrong 8 passed."""
    from aura_hpc.config.deepspeed import deepspeed_config

    def with_json(name: str, content: bytes | None) -> list[str]:
        path = tmp_path / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        return ["dist.strategy=zero2", f"dist.deepspeed_config={path}", "train.batch_size=8"]

    for name, content, said in (
        ("stage.json", b'{"zero_optimization": {"stage": "two"}}', "zero_optimization.stage must be 0 to 3, got 'two'"),
        ("section.json", b'{"zero_optimization": 5}', "zero_optimization must be a JSON object, got 5"),
        ("folder.json", None, "cannot be read (Is a directory) (fix: a JSON file)"),
        ("latin1.json", '{"steps_per_print": 1, "x": "año"}'.encode("latin-1"), "is not UTF-8 text (fix: save the JSON as UTF-8)"),
    ):
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_config(None, with_json(name, content))
    cfg = load_config(None, with_json("batch.json", b'{"train_batch_size": 64}'))  # for 8 ranks of 8: not refused at 1
    assert deepspeed_config(cfg, 8, bf16=False)["train_batch_size"] == 64
    with pytest.raises(ConfigError, match=re.escape("train_batch_size (64 vs 16)")):
        deepspeed_config(cfg, 2, bf16=False)  # each worker, at the world size it has
    # ...and each plan, at the world size it launches: only the workers said it, after a Slurm queue's wait.
    from aura_hpc.launch.local import plan_local
    from aura_hpc.slurm.plan import plan_submit

    json_path = str(tmp_path / "batch.json")
    sets = ["dist.strategy=zero2", f"dist.deepspeed_config={json_path}", "train.batch_size=8", f"output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=re.escape("train_batch_size (64 vs 16)")):
        plan_local(None, sets, str(tmp_path), "x", nproc=2)
    with pytest.raises(ConfigError, match=re.escape("train_batch_size (64 vs 32)")):
        plan_submit(None, sets, str(tmp_path), "x", {"nodes": 2, "gpus_per_node": 2})


def test_a_runs_deepspeed_json_is_its_own_copy_so_an_edit_after_submit_changes_nothing(tmp_path: Path, prepared: Path) -> None:
    """A Slurm job read the user's DeepSpeed JSON when it started, and again at each requeue: an edit made while it
    waited in the queue changed a run already submitted (a file in a folder the compute nodes do not mount stopped
    it there). The run directory keeps its own copy, and its config.yaml names it; a LAN node's config its own."""
    from aura_hpc.config import load_run_file
    from aura_hpc.config.deepspeed import deepspeed_config
    from aura_hpc.launch.run_setup import prepare_run_dir

    users = tmp_path / "mine" / "ds.json"
    users.parent.mkdir()
    users.write_text('{"zero_optimization": {"reduce_bucket_size": 50000000}}\n')
    sets = ["dist.strategy=zero2", f"dist.deepspeed_config={users}", f"data.path={prepared}", "train.batch_size=2"]
    cfg = load_config("tiny", sets, str(tmp_path / "runs"), "ds")
    prepare_run_dir(cfg, 2)
    prepare_run_dir(cfg, 2, check_lock=False, config_name="config.node1.yaml", secret=False)
    users.write_text('{"zero_optimization": {"reduce_bucket_size": 1}}\n')  # edited while the job waits
    for config, kept in (("config.yaml", "deepspeed.json"), ("config.node1.yaml", "deepspeed.node1.json")):
        run_cfg = load_run_file(cfg.run_dir / config)  # what the workers read
        assert run_cfg.dist.deepspeed_config == str(cfg.run_dir / kept)
        assert deepspeed_config(run_cfg, 2, bf16=False)["zero_optimization"]["reduce_bucket_size"] == 50000000
    users.unlink()  # or not there at all on the compute nodes
    assert deepspeed_config(load_run_file(cfg.run_dir / "config.yaml"), 2, bf16=False)["zero_optimization"]["stage"] == 2
    # Started again from its own config.yaml (a resume as run): the copy is what it names, not copied onto itself.
    again = load_run_file(cfg.run_dir / "config.yaml")
    prepare_run_dir(again, 2)
    assert load_run_file(cfg.run_dir / "config.yaml").dist.deepspeed_config == str(cfg.run_dir / "deepspeed.json")
    assert json.loads((cfg.run_dir / "deepspeed.json").read_text())["zero_optimization"]["reduce_bucket_size"] == 50000000
    assert not [p.name for p in cfg.run_dir.iterdir() if ".tmp-" in p.name]
    # A folder of the user's (a project's, with its own deepspeed.json) named as a run's: that file is not replaced.
    users.write_text('{"zero_optimization": {"reduce_bucket_size": 50000000}}\n')
    project = load_config("tiny", sets, str(tmp_path), "mine")
    (project.run_dir / "deepspeed.json").write_text('{"train_micro_batch_size_per_gpu": 4}\n')
    with pytest.raises(ConfigError, match=rf"^{project.run_dir / 'deepspeed.json'} is no copy this run made"):
        prepare_run_dir(project, 2)
    assert (project.run_dir / "deepspeed.json").read_text() == '{"train_micro_batch_size_per_gpu": 4}\n'
    assert not (project.run_dir / "config.yaml").exists()


def test_a_start_that_fails_while_the_run_directory_is_set_up_leaves_neither_its_lock_nor_a_part_file(
    tmp_path: Path, prepared: Path
) -> None:
    """The copy of the user's DeepSpeed JSON, made after the run lock was taken: a JSON broken since the checks left
    run.lock behind (another machine of a shared folder waited out its heartbeat), and a copy cut short by the disk
    left .deepspeed.json.tmp-PID in the run directory for good."""
    import resource
    import signal

    from aura_hpc.launch.run_setup import prepare_run_dir

    users = tmp_path / "ds.json"
    users.write_text('{"zero_optimization": {"reduce_bucket_size": 50000000}, "x": "' + "y" * 20000 + '"}\n')
    sets = ["dist.strategy=zero2", f"dist.deepspeed_config={users}", f"data.path={prepared}", "train.batch_size=2"]
    cfg = load_config("tiny", sets, str(tmp_path / "runs"), "ds")
    users.write_text("{ not json")  # edited between the launcher's checks and the copy
    with pytest.raises(ConfigError, match="is not valid JSON"):
        prepare_run_dir(cfg, 2, lock=True)
    assert not (cfg.run_dir / "run.lock").exists()
    users.write_text('{"zero_optimization": {"reduce_bucket_size": 50000000}, "x": "' + "y" * 20000 + '"}\n')
    was_signal, was_limit = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, was_limit[1]))  # a file may not grow past 8 KiB: a full disk's error
    try:
        with pytest.raises(OSError, match="too large"):
            prepare_run_dir(cfg, 2, lock=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, was_limit)
        signal.signal(signal.SIGXFSZ, was_signal)
    assert not [p.name for p in cfg.run_dir.iterdir() if ".tmp-" in p.name or p.name == "run.lock"]
    prepare_run_dir(cfg, 2, lock=True).release()  # the next try starts as if nothing had happened
    assert json.loads((cfg.run_dir / "deepspeed.json").read_text())["zero_optimization"]["reduce_bucket_size"] == 50000000


def test_the_settings_every_rank_compares_include_the_sample_order_and_leave_out_where_data_lives() -> None:
    """LAN nodes with data.shuffle_window 0 and 2 trained in silence, each reading its own order: 745 distinct
    sequences of 992 positions. Where a machine finds its data (path, cache, tokenizer folder) may differ."""
    from aura_hpc.config import RunConfig
    from aura_hpc.train.parts.build import _shared_settings

    cfg = RunConfig()
    settings = _shared_settings(cfg)
    assert {"data.shuffle_window", "data.seq_len", "data.stream", "data.val_fraction", "data.text_column"} <= set(settings)
    assert not {"data.path", "data.cache_dir", "data.cache_gb", "data.tokenizer", "train.threads"} & set(settings)
    other = RunConfig()
    other.data.shuffle_window, other.data.path, other.data.cache_dir = 2, "/elsewhere", "/scratch"
    assert [k for k in settings if settings[k] != _shared_settings(other)[k]] == ["data.shuffle_window"]


def test_an_auto_true_false_setting_takes_the_words_a_boolean_setting_takes() -> None:
    """YAML's `compile: True` was taken; --set train.compile=yes (or True, on, 1) was refused with the fix `=auto`."""
    for word, meant in [("yes", "true"), ("True", "true"), ("on", "true"), ("1", "true"), ("off", "false"), ("no", "false")]:
        cfg = load_config("tiny", [f"train.compile={word}", f"train.fused_optimizer={word}", f"tracking.sqlite_local={word}"])
        assert (cfg.train.compile, cfg.train.fused_optimizer, cfg.tracking.sqlite_local) == (meant, meant, meant), word
    with pytest.raises(ConfigError, match=r"train.compile must be one of auto, true, false, got 'maybe'"):
        load_config("tiny", ["train.compile=maybe"])
