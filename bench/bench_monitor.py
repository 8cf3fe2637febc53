"""Cost of the trainer's resource monitor: training tokens/s with the sampler thread off vs on.

Two CPU processes (gloo), interleaved runs, median of --repeats; the sampler writes
RUN_DIR/resources/node0.jsonl and TensorBoard scalars at --interval seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import run_trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--interval", type=float, default=1.0)
    a = p.parse_args()
    from aura_hpc.data.prepare import PrepareSpec, prepare

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=4096, val_fraction=0.05))
        off, on = [], []
        on_args = ("--set", f"health.monitor_interval_s={a.interval}")
        for i in range(a.repeats):
            off.append(run_trainer(data, 2, a.steps, a.warmup_steps, tmp, i, tag="off"))
            on.append(run_trainer(data, 2, a.steps, a.warmup_steps, tmp, i, on_args, tag="on"))
        o, n = statistics.median(off), statistics.median(on)
        print(
            f"2 processes: monitor off {o:,.0f} tok/s, on (every {a.interval:g}s) {n:,.0f} tok/s, "
            f"on/off = {n / o:.3f} ({100 * (n / o - 1):+.1f}%) [off {[round(x) for x in off]}, on {[round(x) for x in on]}]"
        )


if __name__ == "__main__":
    main()
