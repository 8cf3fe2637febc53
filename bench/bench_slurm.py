"""On the test cluster (tests/slurm/cluster.sh up): `submit` -> RUNNING, and USR2 -> first resumed step.

Run as root with SLURM_CONF pointing at the test cluster:
    SLURM_CONF=/tmp/aura-slurm/etc/slurm.conf python bench/bench_slurm.py
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["--nodes", "2", "--gpus", "0", "--time", "10", "--set", "model.n_layer=2", "--set", "model.n_embd=64"]
TINY += ["--set", "model.n_head=2", "--set", "data.seq_len=64", "--set", "train.warmup_steps=2", "--set", "train.eval_every=0"]


def squeue_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def submit(out: Path, name: str, steps: int) -> tuple[str, float]:
    """Returns (job id, seconds from starting `submit` to RUNNING in squeue)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "aura_hpc", "submit", *TINY, "--output-dir", str(out), "--run-name", name]
    subprocess.run([*cmd, "--set", f"train.max_steps={steps}"], check=True, capture_output=True)
    job = str(json.loads((out / name / "job.json").read_text())["job_id"])
    while squeue_state(job) not in ("RUNNING", "COMPLETING", "COMPLETED"):
        time.sleep(0.02)
    return job, time.perf_counter() - t0


def wait_gone(job: str) -> None:
    while squeue_state(job) in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING"):
        time.sleep(0.2)


def step_of(run: Path) -> int:
    try:
        return max((json.loads(x).get("step", 0) for x in (run / "metrics.jsonl").read_text().splitlines() if x), default=0)
    except FileNotFoundError:
        return 0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs"
        to_running = []
        for i in range(5):
            job, secs = submit(out, f"r{i}", 5)
            to_running.append(secs)
            wait_gone(job)
        print(f"submit -> RUNNING: median {statistics.median(to_running):.2f}s of 5 (min {min(to_running):.2f}, max {max(to_running):.2f})")

        job, _ = submit(out, "rq", 300)
        run = out / "rq"
        while step_of(run) < 20:
            time.sleep(0.1)
        t_signal = time.time()
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        wait_gone(job)
        log = (run / "slurm" / f"{job}_0_log.out").read_text()
        firsts = [float(t) for t in re.findall(r"first step of this attempt done: step \d+ at unix time ([\d.]+)", log)]
        print(f"USR2 -> first resumed step: {firsts[-1] - t_signal:.1f}s (Slurm restarts a requeued job after AuthInfo cred_expire=10 s)")


if __name__ == "__main__":
    main()
