"""`submit --dry-run`: the exact sbatch script per cluster profile (golden files), precedence, no side effects.

Needs no Slurm: a dry run only plans. Regenerate the golden files after an intended change with
AURA_UPDATE_GOLDEN=1 python -m pytest tests/test_submit_dryrun.py, and review the diff.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli

GOLDEN = REPO / "tests" / "golden"


def _normalised(text: str, out: Path) -> str:
    return text.replace(sys.executable, "PYTHON").replace(str(out), "/shared/aura/runs").replace(str(REPO), "REPO")


def _script(stdout: str) -> str:
    return stdout[stdout.index("#!/bin/bash") :]


@pytest.mark.parametrize("profile", ["generic", "h100-ib", "h200-ib"])
def test_dry_run_script_matches_golden(profile: str, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    gpus = "0" if profile == "generic" else "8"
    res = run_cli(
        ["submit", "--cluster", profile, "--nodes", "4", "--gpus", gpus, "--output-dir", str(out), "--run-name", "gpt2", "--dry-run"]
    )
    assert res.returncode == 0, res.stderr
    script = _normalised(_script(res.stdout), out)
    golden = GOLDEN / f"submit-{profile}.sh"
    if os.environ.get("AURA_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text(), f"the generated sbatch script for {profile} changed: review and regenerate {golden}"
    assert not out.exists(), "--dry-run must not write anything"


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
    assert "#SBATCH --cpus-per-task=4" in script  # config beats the profile's 16
    assert "#SBATCH --mem=0" in script and "#SBATCH --exclusive" in script  # from the profile
    assert "#SBATCH --gpus-per-node=4" in script and "#SBATCH --ntasks-per-node=4" in script
    assert "module load cuda/12.4" in script and "NCCL_IB_HCA=mlx5" in script
    table = res.stdout[: res.stdout.index("#!/bin/bash")]
    for key, source in (("slurm.partition", "cli"), ("slurm.time", "config"), ("slurm.mem", "profile"), ("slurm.max_requeues", "default")):
        line = next(ln for ln in table.splitlines() if f" {key} " in ln)
        assert line.rstrip(" │").endswith(source), line


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
