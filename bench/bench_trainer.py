"""Trainer tokens/s vs a bare PyTorch loop (bench/bare_loop.py): same model, data, batch, threads.

Both are timed by wall clock from step --warmup-steps to the last step; the trainer's figure
comes from the `elapsed_s`/`tokens` columns of its metrics.jsonl, so its logging, metric
all_reduce and progress reporting are inside the measurement. Runs alternate to share noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // nproc))
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_bare(data: Path, nproc: int, steps: int, warmup: int, tmp: Path) -> float:
    out = tmp / f"bare-{nproc}.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(REPO / "bench" / "bare_loop.py"),
            "--data",
            str(data),
            "--steps",
            str(steps),
            "--warmup-steps",
            str(warmup),
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,  # a stuck gloo rendezvous must not stall the benchmark forever
        env=_env(nproc),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return float(json.loads(out.read_text())["tokens_per_s"])


def run_trainer(data: Path, nproc: int, steps: int, warmup: int, tmp: Path, i: int, extra: tuple[str, ...] = (), tag: str = "") -> float:
    name = f"t{nproc}-{i}{tag}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "aura_hpc",
            "local",
            "--nproc-per-node",
            str(nproc),
            "--output-dir",
            str(tmp),
            "--run-name",
            name,
            "--set",
            f"data.path={data}",
            "--set",
            f"train.max_steps={steps}",
            "--set",
            "train.warmup_steps=5",
            "--set",
            f"train.log_every={warmup}",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.checkpoint_every=0",
            *extra,
        ],
        check=True,
        timeout=600,  # a stuck gloo rendezvous must not stall the benchmark forever
        env=_env(nproc),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] == warmup)
    last = rows[-1]
    return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", default="1,2", help="process counts to measure, comma-separated")
    a = p.parse_args()
    from aura_hpc.data.prepare import PrepareSpec, prepare

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=4096, val_fraction=0.05))
        for nproc in (int(x) for x in a.nproc.split(",")):
            bare, ours = [], []
            for i in range(a.repeats):
                bare.append(run_bare(data, nproc, a.steps, a.warmup_steps, tmp))
                ours.append(run_trainer(data, nproc, a.steps, a.warmup_steps, tmp, i))
            b, t = statistics.median(bare), statistics.median(ours)
            print(
                f"{nproc} process(es), {_env(nproc)['OMP_NUM_THREADS']} thread(s) each: bare loop {b:,.0f} tok/s, "
                f"trainer {t:,.0f} tok/s, trainer/bare = {t / b:.3f} (overhead {100 * (1 - t / b):+.1f}%) "
                f"[bare {[round(x) for x in bare]}, trainer {[round(x) for x in ours]}]"
            )


if __name__ == "__main__":
    main()
