"""The GPU benchmark's CPU smoke run still works and prints its ratio line (figures come from a GPU)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env


@pytest.mark.slow
def test_bench_gpu_smoke_run_prints_the_ratio_line() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_gpu.py"), "--allow-cpu", "--steps", "6", "--warmup-steps", "2"],
        env=cli_env(OMP_NUM_THREADS="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"ratio trainer/reference \d+\.\d\d, MFU \d+\.\d%", last), last
