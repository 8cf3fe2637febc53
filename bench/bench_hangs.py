"""Hang and straggler figures for `local` (2 ranks, gloo, the small test model, default watchdog settings).

- hang: rank 1 stopped (SIGSTOP) after step STEP: seconds from the stop to the watchdog's verdict,
  whether it named rank 1, and whether the restarted run ended with the uninterrupted run's bits;
- stragglers: a clean run and a run with rank 1 idling FRACTION of each step: the logging interval at
  which rank 1 was named, and the warnings a clean run of the same length raised (should be none);
- the scoring's own cost: what the BusyClock adds to a step (two clock reads), against the step time.

    python bench/bench_hangs.py [--repeats 3] [--steps 200] [--fraction 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from aura_hpc.data.prepare import PrepareSpec, prepare
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.loop.stragglers import BusyClock

BASE = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.seq_len=64", "train.eval_every=0", "train.log_every=5"]
BASE += ["train.warmup_steps=3", "train.checkpoint_every=5", "model.dropout=0.1", "train.keep_last=5"]
STOPPED = re.compile(r"fault injection: SIGSTOP rank 1 after step \d+ at ([\d.]+)")


def run(out: Path, name: str, data: Path, steps: int, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "aura_hpc", "local", "--nproc-per-node", "2", "--output-dir", str(out), "--run-name", name]
    for s in [f"data.path={data}", *BASE, f"train.max_steps={steps}"]:
        cmd += ["--set", s]
    return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env), capture_output=True, text=True)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint.list_complete(run_dir / "checkpoints")[0].path / "model" / "model.safetensors"))


def named_at(run_dir: Path, rank: int) -> list[int]:
    lines = (run_dir / "logs" / "rank_0.log").read_text().splitlines()
    return [int(m.group(1)) for x in lines if (m := re.search(rf"straggler: rank {rank} on .* at step (\d+)", x))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fraction", type=float, default=0.5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=1024, val_fraction=0.05))
        assert run(tmp, "ref", data, 40).returncode == 0
        ref = weights(tmp / "ref")
        for i in range(a.repeats):
            r = run(tmp, f"hang{i}", data, 40, AURA_FAULT_STOP="1:20")
            record = json.loads((tmp / f"hang{i}" / "hangs" / "last.json").read_text())
            stopped = float(STOPPED.search(r.stdout).group(1))
            same = r.returncode == 0 and all(torch.equal(ref[k], v) for k, v in weights(tmp / f"hang{i}").items())
            took, who = record["declared_at"] - stopped, record["culprits"]
            print(f"hang {i}: declared {took:.1f}s after the stop; culprits {who}; exit {r.returncode}; same bits {same}")
        for i in range(a.repeats):
            clean = run(tmp, f"clean{i}", data, a.steps)
            slow = run(tmp, f"slow{i}", data, a.steps, AURA_FAULT_SLOW=f"1:{a.fraction}")
            rows = [json.loads(x) for x in (tmp / f"clean{i}" / "metrics.jsonl").read_text().splitlines()]
            lowest = min(r.get("slowest_score", 1.0) for r in rows)
            at = named_at(tmp / f"slow{i}", 1)
            print(
                f"stragglers {i}: slowed rank 1 named at step {at[0] if at else None} (interval {at[0] // 5 if at else None}); "
                f"clean run: {len(named_at(tmp / f'clean{i}', 0) + named_at(tmp / f'clean{i}', 1))} warnings, lowest score {lowest}; "
                f"exits {clean.returncode}/{slow.returncode}"
            )
            step_s = [r["step_time_s"] for r in rows if r.get("step_time_s")]
            if step_s:
                print(f"  clean run step time median {sorted(step_s)[len(step_s) // 2] * 1000:.1f} ms")
    clock = BusyClock(torch.device("cpu"))
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        clock.exchange_begins()
        clock.exchange_done()
    per = (time.perf_counter() - t0) / n
    print(f"BusyClock: {per * 1e6:.2f} us per step")


if __name__ == "__main__":
    main()
