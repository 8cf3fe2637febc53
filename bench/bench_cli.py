"""`python -m aura_hpc --help` and `submit --dry-run` wall time vs bare `python -c pass` (target: < 0.3 s above it)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time


def wall(cmd: list[str], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    n = 15
    base = wall([sys.executable, "-c", "pass"], n)
    helped = wall([sys.executable, "-m", "aura_hpc", "--help"], n)
    local_help = wall([sys.executable, "-m", "aura_hpc", "local", "--help"], n)
    with tempfile.TemporaryDirectory() as out:
        dry = [sys.executable, "-m", "aura_hpc", "submit", "--cluster", "h100-ib", "--nodes", "4", "--gpus", "8"]
        dry_run = wall([*dry, "--output-dir", out, "--dry-run"], n)
    print(
        f"median of {n}: python -c pass {base * 1000:.0f} ms; aura_hpc --help {helped * 1000:.0f} ms "
        f"(+{(helped - base) * 1000:.0f} ms); aura_hpc local --help {local_help * 1000:.0f} ms "
        f"(+{(local_help - base) * 1000:.0f} ms); submit --dry-run {dry_run * 1000:.0f} ms "
        f"(+{(dry_run - base) * 1000:.0f} ms); target: < +300 ms"
    )


if __name__ == "__main__":
    main()
