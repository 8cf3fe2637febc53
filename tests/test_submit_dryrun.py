"""`submit --dry-run`: the exact sbatch script per cluster profile (golden files), precedence, no side effects.

Needs no Slurm: a dry run only plans. Regenerate the golden files after an intended change with
AURA_UPDATE_GOLDEN=1 python -m pytest tests/test_submit_dryrun.py, and review the diff.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import REPO, run_cli

GOLDEN = REPO / "tests" / "golden"


def _normalised(text: str, out: Path) -> str:
    return text.replace(sys.executable, "PYTHON").replace(str(out), "/shared/aura/runs").replace(str(REPO), "REPO")


def _script(stdout: str) -> str:
    return stdout[stdout.index("#!/bin/bash") :]


@pytest.mark.parametrize("profile", ["generic", "h100-ib", "h200-ib", "h100-pyxis"])
def test_dry_run_script_matches_golden(profile: str, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    gpus = "0" if profile == "generic" else "8"
    # The pyxis profile mounts /shared; the test's output_dir lives elsewhere.
    mounts = ["--container-mounts", f"{out}:{out}"] if "pyxis" in profile else []
    res = run_cli(
        [
            "submit",
            "--cluster",
            profile,
            "--nodes",
            "4",
            "--gpus",
            gpus,
            "--output-dir",
            str(out),
            "--run-name",
            "gpt2",
            "--dry-run",
            *mounts,
        ]
    )
    assert res.returncode == 0, res.stderr
    assert "slurm.cpus_per_task is unset" not in res.stdout + res.stderr  # (the GPU profiles set --cpus-per-task)
    script = _normalised(_script(res.stdout), out)
    golden = GOLDEN / f"submit-{profile}.sh"
    if os.environ.get("AURA_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"the generated sbatch script for {profile} changed: review and regenerate {golden}"
    assert not out.exists(), "--dry-run must not write anything"
    # torch's own default: a failed or timed-out collective ends the process at once. 1 and 2 first call
    # ncclCommAbort, which can itself hang on a wedged link: the hang the setting is there to end.
    assert re.findall(r"^export TORCH_NCCL_ASYNC_ERROR_HANDLING=(\S*)$", script, re.M) == ["3"], script


def test_precedence_cli_over_config_over_profile(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"slurm": {"cluster": "h100-ib", "time": "02:00:00", "cpus_per_task": 4, "partition": "gpu"}}))
    res = run_cli(
        [
            "submit",
            "--config",
            str(cfg),
            "--partition",
            "debug",
            "--nodes",
            "2",
            "--gpus",
            "4",
            "--output-dir",
            str(tmp_path / "r"),
            "--dry-run",
        ]
    )
    assert res.returncode == 0, res.stderr
    script = _script(res.stdout)
    assert "#SBATCH --partition=debug" in script  # cli beats config
    assert "#SBATCH --time=120" in script  # config beats the profile's 24:00:00
    assert "#SBATCH --cpus-per-task=4" in script  # config beats the profile's 14
    # Slurm 22.05+: srun does not inherit it; each rank was left one core for its 4 threads.
    assert re.search(r"^srun .*--cpus-per-task=4", script, re.M), script
    assert "#SBATCH --mem=0" in script and "#SBATCH --exclusive" in script  # from the profile
    assert "#SBATCH --gpus-per-node=4" in script and "#SBATCH --ntasks-per-node=4" in script
    assert "module load cuda/12.4" in script and "NCCL_IB_HCA=mlx5" in script
    table = res.stdout[: res.stdout.index("#!/bin/bash")]
    for key, source in (("slurm.partition", "cli"), ("slurm.time", "config"), ("slurm.mem", "profile"), ("slurm.max_requeues", "default")):
        # Piped output is plain: one "setting=KEY  value=...  from=SOURCE" line per row, never wrapped.
        line = next(ln for ln in table.splitlines() if f"setting={key} " in ln)
        assert line.endswith(f"from={source}"), line


def test_a_profiles_screen_figures_yield_to_a_sweep_of_them(tmp_path: Path) -> None:
    """h100-ib states screen_gemm_tflops=790; a sweep of that figure (what a user runs to find the threshold
    their nodes pass) planned every point at 790: the profile's value replaced each point's own."""
    from aura_hpc.slurm.plan import plan_submit

    sweep = ["health.screen_gemm_tflops=500,600"]
    plan = plan_submit(None, ["slurm.cluster=h100-ib"], str(tmp_path), "s", {"nodes": 1, "gpus_per_node": 8}, sweep)
    assert [p.cfg.health.screen_gemm_tflops for p in plan.points] == [500.0, 600.0]
    assert {p.cfg.health.screen_allreduce_gbps for p in plan.points} == {440.0}  # not swept: the profile's
    one = plan_submit(None, ["slurm.cluster=h100-ib", "health.screen_gemm_tflops=500"], str(tmp_path), "o", {"gpus_per_node": 8})
    assert one.points[0].cfg.health.screen_gemm_tflops == 500.0


def test_nccl_debug_and_signal_settings(tmp_path: Path) -> None:
    res = run_cli(
        [
            "submit",
            "--nccl-debug",
            "--set",
            "slurm.signal=USR1",
            "--set",
            "slurm.signal_lead_s=300",
            "--output-dir",
            str(tmp_path),
            "--dry-run",
        ]
    )
    assert res.returncode == 0, res.stderr
    script = _script(res.stdout)
    assert "#SBATCH --signal=USR1@300" in script
    assert "export NCCL_DEBUG=INFO" in script and "NCCL_DEBUG_SUBSYS=INIT,NET" in script and "%h-%p.log" in script
    # GPUs on a profile that sets no CPUs per task: Slurm gives each rank one CPU, said with the fix.
    res = run_cli(["submit", "--cluster", "generic", "--gpus", "4", "--output-dir", str(tmp_path), "--dry-run"])
    said = res.stdout + res.stderr
    assert res.returncode == 0 and "slurm.cpus_per_task is unset: Slurm gives each rank one CPU" in said, said
    assert "(fix: --set slurm.cpus_per_task=N" in said


def test_both_spellings_of_the_size_flags_and_close_flags_suggested(tmp_path: Path) -> None:
    a = run_cli(["submit", "--profile", "h100-ib", "--nnodes", "2", "--nproc-per-node", "8", "--output-dir", str(tmp_path), "--dry-run"])
    b = run_cli(["submit", "--cluster", "h100-ib", "--nodes", "2", "--gpus", "8", "--output-dir", str(tmp_path), "--dry-run"])
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert "#SBATCH --nodes=2" in a.stdout and "#SBATCH --gpus-per-node=8" in a.stdout
    assert a.stdout.split("#!/bin/bash")[1] == b.stdout.split("#!/bin/bash")[1]
    loc = run_cli(["local", "--nodes", "1", "--gpus", "1", "--dry-run"], cwd=tmp_path)
    assert loc.returncode == 0 and "node 0/1, 1 process," in loc.stdout, loc.stderr
    typo = run_cli(["submit", "--clustr", "h100-ib", "--dry-run"])
    assert typo.returncode == 2 and "--clustr: did you mean --cluster?" in typo.stderr
    # 16 replicas divide 2 nodes of 8, not the 3 that --nodes 2-3 may start with: refused at once, not after the allocation.
    diloco = ["--set", "dist.strategy=diloco", "--set", "dist.diloco_replicas=16", "--output-dir", str(tmp_path), "--dry-run"]
    assert run_cli(["submit", "--cluster", "h100-ib", "--nodes", "2", "--gpus", "8", *diloco]).returncode == 0
    elastic = run_cli(["submit", "--cluster", "h100-ib", "--nodes", "2-3", "--gpus", "8", *diloco])
    assert elastic.returncode == 2 and "dist.diloco_replicas=16 does not divide the 24 ranks" in elastic.stderr, elastic.stderr


def test_a_profiles_node_range_is_planned_and_a_value_it_cannot_plan_with_names_its_line(tmp_path: Path) -> None:
    """sbatch's --nodes=2-4 in a profile was refused, and a value aura_hpc cannot plan with had a message that read
    "fix: --set #SBATCH in prof.sh: gpus_per_node=<int>", no command at all."""
    prof = tmp_path / "site.sh"
    prof.write_text("#SBATCH --nodes=2-4\n#SBATCH --gpus-per-node=8\n")
    ranged = run_cli(["submit", "--cluster", str(prof), "--output-dir", str(tmp_path / "runs"), "--dry-run"])
    assert ranged.returncode == 0 and "#SBATCH --nodes=2-4" in ranged.stdout, ranged.stdout + ranged.stderr
    prof.write_text("#SBATCH --cpus-per-task=lots\n")
    bad = run_cli(["submit", "--cluster", str(prof), "--output-dir", str(tmp_path / "runs"), "--dry-run"])
    expected = f"cluster profile {prof}: #SBATCH --cpus-per-task=lots is not a count aura_hpc can plan with"
    assert bad.returncode == 2 and expected in bad.stderr and "--set slurm.cpus_per_task=" in bad.stderr, bad.stderr


def test_gpus_asked_in_any_of_sbatchs_ways_plan_one_task_per_gpu_and_every_option_of_a_line_is_kept(tmp_path: Path) -> None:
    """A profile's --gres=gpu:8 (the commonest site form) was passed through while the plan saw no GPU: the job got
    16 GPUs and trained on one per node (1 task per node, NCCL on cuda:0). A typed count (h100:8) was refused with
    advice (--constraint) that selects node features, not GPU types; a line's second option was dropped."""
    prof = tmp_path / "site.sh"
    out = str(tmp_path / "runs")
    # A site's wckey: the profile's, never submitit's own "submitit" (refused where a site enforces wckeys).
    prof.write_text(
        "#SBATCH --partition=gpu --account=proj42 --wckey=nlp\n#SBATCH --gres=gpu:h100:8,nvme:1\n#SBATCH --exclusive --qos=high\n"
    )
    planned = run_cli(["submit", "--cluster", str(prof), "--nodes", "2", "--output-dir", out, "--dry-run"])
    assert planned.returncode == 0, planned.stdout + planned.stderr
    lines = set(_script(planned.stdout).splitlines())
    expected = {"#SBATCH --gpus-per-node=h100:8", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=nvme:1", "#SBATCH --account=proj42"}
    assert expected | {"#SBATCH --partition=gpu", "#SBATCH --qos=high", "#SBATCH --exclusive", "#SBATCH --wckey=nlp"} <= lines, (
        planned.stdout
    )
    assert "submitit" not in " ".join(x for x in lines if x.startswith("#SBATCH --wckey"))
    assert "tasks: 2 node(s) x 8 task(s) = world size 16" in planned.stdout
    # The CLI's count keeps the profile's type; the CLI's type wins over it.
    four = run_cli(["submit", "--cluster", str(prof), "--gpus", "a100:4", "--output-dir", out, "--dry-run"])
    assert "#SBATCH --gpus-per-node=a100:4" in four.stdout and "#SBATCH --ntasks-per-node=4" in four.stdout, four.stdout + four.stderr
    cpu = run_cli(["submit", "--cluster", str(prof), "--gpus", "0", "--output-dir", out, "--dry-run"])
    assert cpu.returncode == 0 and "--gpus-per-node" not in _script(cpu.stdout), cpu.stdout + cpu.stderr
    # A type in the config, the count from the profile (the check ran before the profile was read).
    typed = tmp_path / "typed.yaml"
    typed.write_text("slurm:\n  gpu_type: h100\n")
    prof.write_text("#SBATCH --gpus-per-node=8 --cpus-per-gpu=14\n")  # a per-GPU option is no GPU count: passed on
    by_config = run_cli(["submit", "--cluster", str(prof), "--config", str(typed), "--output-dir", out, "--dry-run"])
    assert by_config.returncode == 0, by_config.stdout + by_config.stderr
    assert {"#SBATCH --gpus-per-node=h100:8", "#SBATCH --cpus-per-gpu=14"} <= set(_script(by_config.stdout).splitlines())
    prof.write_text("#SBATCH --gres=gpu:4\n")
    untyped = run_cli(["submit", "--cluster", str(prof), "--output-dir", out, "--dry-run"])
    assert "#SBATCH --gpus-per-node=4" in untyped.stdout and "--gres" not in _script(untyped.stdout), untyped.stdout + untyped.stderr
    for line, option in [("#SBATCH --gpus=16", "--gpus"), ("#SBATCH --time=10 --gpus-per-task=1", "--gpus-per-task")]:
        prof.write_text(line + "\n")
        refused = run_cli(["submit", "--cluster", str(prof), "--output-dir", out, "--dry-run"])
        assert refused.returncode == 2 and f"#SBATCH {option} is not how aura_hpc asks for GPUs" in refused.stderr, refused.stderr
        assert "fix: write #SBATCH --gpus-per-node=[TYPE:]N" in refused.stderr and "Traceback" not in refused.stderr
    prof.write_text("#SBATCH --partition=gpu --ntasks-per-node=4\n")
    reserved = run_cli(["submit", "--cluster", str(prof), "--output-dir", out, "--dry-run"])
    assert reserved.returncode == 2 and "#SBATCH --ntasks-per-node is set by aura_hpc itself" in reserved.stderr, reserved.stderr
    bad = run_cli(["submit", "--gpus", "eight", "--output-dir", out, "--dry-run"])
    assert bad.returncode == 2 and "--gpus 'eight' is not a GPU count (fix: --gpus 8, or --gpus h100:8" in bad.stderr, bad.stderr
    # bash leaves `~` after `=` alone: `local` expanded it, `submit` said "not an absolute path".
    home = run_cli(["submit", "--output-dir=~/runs", "--dry-run"], HOME=str(tmp_path))
    assert home.returncode == 0 and f"run directory: {tmp_path}/runs/" in home.stdout, home.stdout + home.stderr


def test_a_missing_module_is_said_in_the_job_log(tmp_path: Path) -> None:
    import subprocess

    profile = REPO / "sbatch_templates" / "h100-ib.sh"
    # A site whose `module load` fails (Lmod prints its own error and returns 1).
    script = f'module() {{ [ "$1" = purge ] && return 0; echo "Lmod has detected the following error" >&2; return 1; }}\nsource {profile}\n'
    env = {**os.environ, "AURA_RUN_DIR": str(tmp_path)}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0
    assert "aura_hpc: module cuda/12.4 is not available on" in done.stderr and "fix: change the module line" in done.stderr
    without = subprocess.run(
        ["bash", "-c", f"source {profile}"], capture_output=True, text=True, env={**os.environ, "AURA_RUN_DIR": str(tmp_path)}
    )
    assert "no 'module' command" in without.stderr


def test_dry_run_checks_the_data_and_submit_refuses_it(tmp_path: Path) -> None:
    args = ["submit", "--output-dir", str(tmp_path / "runs"), "--set", f"data.path={tmp_path / 'missing'}"]
    dry = run_cli([*args, "--dry-run"])
    # The plan is shown, and the status is the run's (0 let a script that gates on the dry run go on to submit).
    assert dry.returncode == 2 and "effective batch 8 sequences = 1,024 tokens per step" in dry.stdout
    assert "submit would refuse this: data.path" in dry.stderr and "missing does not exist (fix:" in dry.stderr
    real = run_cli(args)
    assert real.returncode == 2 and "missing does not exist (fix:" in real.stderr and not (tmp_path / "runs").exists()


def test_a_master_address_outside_private_ranges_is_warned_about(tmp_path: Path) -> None:
    public = run_cli(["local", "--nnodes", "2", "--node-rank", "1", "--master-addr", "8.8.8.8", "--dry-run"], cwd=tmp_path)
    assert public.returncode == 0 and "8.8.8.8 is neither private nor loopback" in public.stderr, public.stderr
    lan = run_cli(["local", "--nnodes", "2", "--node-rank", "1", "--master-addr", "192.168.1.10", "--dry-run"], cwd=tmp_path)
    assert lan.returncode == 0 and "neither private" not in lan.stderr


def test_one_machine_listens_on_loopback_and_says_so_when_given_its_lan_address(tmp_path: Path) -> None:
    alone = run_cli(["local", "--master-addr", "localhost", "--dry-run"], cwd=tmp_path)
    assert alone.returncode == 0 and "listens on" not in alone.stderr, alone.stderr
    stranger = run_cli(["local", "--master-addr", "8.8.8.8", "--dry-run"], cwd=tmp_path)
    assert stranger.returncode == 2 and "8.8.8.8 is not an address of this machine (fix: omit --master-addr" in stranger.stderr
    own = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    if not own:
        pytest.skip("this machine has no IPv4 address beside loopback (CI's has docker0 at least)")
    lan = run_cli(["local", "--master-addr", own[0], "--dry-run"], cwd=tmp_path)
    assert lan.returncode == 0, lan.stderr
    assert f"--master-addr {own[0]} with --nnodes 1: this run's rendezvous listens on {own[0]}" in lan.stderr


def test_apptainer_wraps_the_jobs_python_and_matches_golden(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    sif = tmp_path / "aura.sif"
    sif.write_bytes(b"SIF")
    container = [
        "--container",
        "apptainer",
        "--container-image",
        str(sif),
        "--container-mounts",
        f"{tmp_path}:{tmp_path},/datasets:/datasets:ro",
    ]
    res = run_cli(["submit", "--nodes", "2", "--gpus", "8", "--output-dir", str(out), "--run-name", "gpt2", "--dry-run", *container])
    assert res.returncode == 0, res.stderr
    script = _normalised(_script(res.stdout), out).replace(str(tmp_path), "/shared/aura")
    golden = GOLDEN / "submit-apptainer.sh"
    if os.environ.get("AURA_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"the apptainer script changed: review and regenerate {golden}"
    command = script.strip().splitlines()[-1]
    assert command.startswith("srun ") and "apptainer exec --nv --bind /shared/aura:/shared/aura,/datasets:/datasets:ro" in command
    assert command.endswith("/shared/aura/aura.sif python3 -u -m submitit.core._submit /shared/aura/runs/gpt2/slurm"), command
    # `~/aura.sif` passed the check but reached the script quoted: no shell expanded it on the nodes.
    container[3] = "~/aura.sif"
    again = ["submit", "--nodes", "2", "--gpus", "8", "--output-dir", str(out), "--run-name", "g2", "--dry-run", *container]
    res = run_cli(again, HOME=str(tmp_path))
    assert res.returncode == 0 and "~" not in _script(res.stdout) and f"{sif} python3 -u" in _script(res.stdout), res.stdout + res.stderr


@pytest.mark.parametrize(
    ("flags", "problem", "fix"),
    [
        (
            ["--container", "apptainer", "--container-image", "/nowhere/aura.sif", "--container-mounts", "OUT:OUT"],
            "apptainer image /nowhere/aura.sif does not exist",
            "apptainer build",
        ),
        (
            ["--container", "pyxis", "--container-image", "nvcr.io#nvidia/pytorch:24.05-py3", "--container-mounts", "/data:/data"],
            "output_dir OUT is not in slurm.container_mounts",
            "add OUT:OUT to --container-mounts",
        ),
        (
            ["--container", "pyxis", "--container-image", "img:1", "--container-mounts", "OUT:/work"],
            "is mounted at another path inside the container",
            "mount it at the same path",
        ),
        (["--container", "pyxis", "--container-image", "img:1", "--container-mounts", "OUT:OUT:ro"], "is mounted read-only", "drop ':ro'"),
        (["--container", "pyxis", "--container-mounts", "OUT:OUT"], "no image is given", "--container-image"),
        (
            ["--container", "pyxis", "--container-image", "/images/missing.sqsh", "--container-mounts", "OUT:OUT"],
            "pyxis image file /images/missing.sqsh does not exist",
            "enroot import",
        ),
        (
            ["--container", "pyxis", "--container-image", "img $(id)", "--container-mounts", "OUT:OUT"],
            "holds spaces or shell characters",
            "a plain path or image name",
        ),
        (["--container-image", "img:1"], "slurm.container is none", "--container pyxis or apptainer"),
        (  # every missing mount in one line (they were named one re-run at a time)
            ["--container", "pyxis", "--container-image", "img:1", "--container-mounts", "/x:/x", "--set", "data.path=/datasets/es"],
            "output_dir OUT and data.path /datasets/es are not in slurm.container_mounts",
            "add OUT:OUT,/datasets/es:/datasets/es to --container-mounts",
        ),
    ],
)
def test_bad_container_combinations_are_refused_with_the_fix(flags: list[str], problem: str, fix: str, tmp_path: Path) -> None:
    out = str(tmp_path / "runs")
    flags = [f.replace("OUT", out) for f in flags]
    res = run_cli(["submit", "--nodes", "1", "--gpus", "0", "--output-dir", out, "--dry-run", *flags])
    assert res.returncode == 2, res.stdout + res.stderr
    problem, fix = problem.replace("OUT", out), fix.replace("OUT", out)
    assert problem in res.stderr and fix in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_many_small_files_are_said_to_lose_their_tails_and_the_fix_is_to_join_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each input file is a piece, and a piece's tokens short of a sequence are dropped: 40 small files lost 14% of
    their training text, and their validation tokens (1,867) made no sequence of 256, while the warning's fix, a
    larger --val-fraction, could not help. Prepare now joins their shards; data prepared before is told to."""
    from aura_hpc.config import load_config
    from aura_hpc.data import prepare as prepare_module
    from aura_hpc.data.prepare import PrepareSpec, prepare
    from aura_hpc.launch.data_plan import coverage

    files = []
    for i in range(40):
        f = tmp_path / f"doc{i:02d}.txt"
        f.write_text(
            "".join(f"Documento {i}, párrafo {j}: el molinero miró el camino largo y la maestra leyó una carta.\n\n" for j in range(25))
        )
        files.append(str(f))
    prepare(PrepareSpec(out_dir=tmp_path / "joined", inputs=files, vocab_size=300, val_fraction=0.05))
    cfg = load_config(None, [f"data.path={tmp_path / 'joined'}", "data.seq_len=256", "train.max_steps=10"])
    said = "\n".join(coverage(cfg, 1)[1])
    assert "prepared on its own" not in said and "no complete sequence" not in said, said  # a few validation sequences
    monkeypatch.setattr(prepare_module, "_join_small", lambda build, listed, *args: listed)  # as an earlier release prepared
    prepare(PrepareSpec(out_dir=tmp_path / "out", inputs=files, vocab_size=300, val_fraction=0.05))
    cfg = load_config(None, [f"data.path={tmp_path / 'out'}", "data.seq_len=256", "train.max_steps=10"])
    _, warnings = coverage(cfg, 1)
    said = "\n".join(warnings)
    assert "no complete sequence of 256 tokens" in said and "--val-fraction" not in said, said
    assert "fix: prepare it again with this release, which joins the small files' shards, or a smaller data.seq_len than 256" in said, said
    assert re.search(r"\d+% of the [\d,]+ training tokens are in no sequence of 256: each input file is prepared on its own", said)
    cfg = load_config(None, [f"data.path={tmp_path / 'out'}", "data.seq_len=16", "train.max_steps=10"])
    assert coverage(cfg, 1)[1] == []  # short sequences: little lost, validation enough


def test_dry_runs_say_how_many_epochs_the_data_covers_and_warn_of_a_tiny_validation_split(tmp_path: Path) -> None:
    from aura_hpc.data.prepare import PrepareSpec, prepare

    text = tmp_path / "poco.txt"
    text.write_text("".join(f"Párrafo {i}: el molinero miró el camino largo y la maestra leyó una carta.\n\n" for i in range(300)))
    prepare(PrepareSpec(out_dir=tmp_path / "poco", inputs=[str(text)], vocab_size=300, val_fraction=0.02))
    args = [
        "--set",
        f"data.path={tmp_path / 'poco'}",
        "--set",
        "data.seq_len=32",
        "--set",
        "train.max_steps=100",
        "--output-dir",
        str(tmp_path),
    ]
    local = run_cli(["local", "--dry-run", "--nproc-per-node", "2", *args], timeout=120)
    submit = run_cli(["submit", "--dry-run", "--nodes", "2", "--gpus", "0", *args], timeout=120)
    for r in (local, submit):
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(
            r"data: [\d,]+ training sequences of 32 tokens .*100 steps x 16 sequences = 1,600 sequences = [\d.]+ epochs", r.stdout
        )
        assert "validation: " in r.stdout and "the validation split is tiny" in r.stderr and "--val-fraction" in r.stderr
    # A manifest in a folder anyone could write is checked before its counts are used: a damaged
    # one is one line naming the file and the fix, not a traceback of the epochs sum.
    manifest = tmp_path / "poco" / "manifest.json"
    damaged = json.loads(manifest.read_text())
    damaged["shards"] = [{"tokens": 10}]
    manifest.write_text(json.dumps(damaged))
    r = run_cli(["local", "--dry-run", *args], timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert str(manifest) in r.stderr and "--force" in r.stderr
