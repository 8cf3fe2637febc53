"""Fault-injection figures: how many injections of each kind, finished runs, bit-identical
final weights, and time from the fault to the first resumed training step.

Each run trains the small test model (2 ranks, gloo, 20 steps, a checkpoint every 5) under
`python -m aura_hpc local` and is compared with an uninterrupted reference run.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from aura_hpc.data.prepare import PrepareSpec, prepare
from aura_hpc.train.checkpoint import files as checkpoint

BASE = [
    "--set",
    "model.n_layer=2",
    "--set",
    "model.n_embd=64",
    "--set",
    "model.n_head=2",
    "--set",
    "data.seq_len=64",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.log_every=5",
    "--set",
    "train.warmup_steps=3",
    "--set",
    "train.checkpoint_every=5",
    "--set",
    "model.dropout=0.1",
    "--set",
    "train.keep_last=5",
]
FIRST = re.compile(r"first step of this attempt done: step (\d+) at unix time ([\d.]+)")
KILLED = re.compile(r"fault injection: SIGKILL .* at ([\d.]+)")


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    e.update(extra)
    return e


def args(out: Path, name: str, data: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "aura_hpc",
        "local",
        "--nproc-per-node",
        "2",
        "--output-dir",
        str(out),
        "--run-name",
        name,
        "--set",
        f"data.path={data}",
        *BASE,
        "--set",
        f"train.max_steps={steps}",
    ]


def weights(run: Path) -> dict[str, torch.Tensor]:
    newest = checkpoint.list_complete(run / "checkpoints")[0]
    return load_file(str(newest.path / "model" / "model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--signals", type=int, default=2, help="per signal kind")
    p.add_argument("--ckpt-crashes", type=int, default=4)
    a = p.parse_args()
    rng = random.Random(2026)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=1024, val_fraction=0.05))
        refs = {}
        for steps in (20, 300):
            subprocess.run(args(tmp, f"ref{steps}", data, steps), env=env(), check=True, capture_output=True)
            refs[steps] = weights(tmp / f"ref{steps}")
        results: dict[str, list[tuple[bool, bool, float | None]]] = {"SIGKILL rank": [], "checkpoint writer killed": []}

        for i in range(a.kills):
            rank, step = rng.randrange(2), rng.randrange(1, 20)
            r = subprocess.run(
                [*args(tmp, f"k{i}", data, 20), "--max-restarts", "1"],
                env=env(AURA_FAULT_KILL=f"{rank}:{step}"),
                capture_output=True,
                text=True,
            )
            killed = float(KILLED.search(r.stdout).group(1)) if KILLED.search(r.stdout) else None
            firsts = FIRST.findall(r.stdout)
            delay = float(firsts[-1][1]) - killed if killed and len(firsts) >= 2 else None
            results["SIGKILL rank"].append((r.returncode == 0, r.returncode == 0 and same(weights(tmp / f"k{i}"), refs[20]), delay))

        stages = ["model", "trainer_state", "meta", "config", "tokenizer", "files", "marker"]
        for i in range(a.ckpt_crashes):
            stage = stages[i % len(stages)]
            r = subprocess.run(
                [*args(tmp, f"c{i}", data, 20), "--max-restarts", "1"],
                env=env(AURA_FAULT_CKPT=f"kill:{stage}"),
                capture_output=True,
                text=True,
            )
            killed = float(KILLED.search(r.stdout).group(1)) if KILLED.search(r.stdout) else None
            firsts = FIRST.findall(r.stdout)
            delay = float(firsts[-1][1]) - killed if killed and len(firsts) >= 2 else None
            ok = r.returncode == 0
            results["checkpoint writer killed"].append((ok, ok and same(weights(tmp / f"c{i}"), refs[20]), delay))

        for sig in ("SIGTERM", "SIGUSR2"):
            key = f"{sig} (checkpoint, exit 75, re-run)"
            results[key] = []
            for i in range(a.signals):
                name = f"{sig}-{i}"
                proc = subprocess.Popen(args(tmp, name, data, 300), env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                metrics = tmp / name / "metrics.jsonl"
                while not (metrics.exists() and metrics.read_text().count("\n") >= 3 + i):
                    time.sleep(0.05)
                sent = time.time()
                os.kill(proc.pid, getattr(signal, sig))
                out = proc.communicate()[0]
                stopped = time.time()
                r = subprocess.run(args(tmp, name, data, 300), env=env(), capture_output=True, text=True)
                firsts = FIRST.findall(r.stdout)
                ok = proc.returncode == 75 and r.returncode == 0 and "stop requested" in out
                results[key].append((ok, ok and same(weights(tmp / name), refs[300]), float(firsts[0][1]) - sent if firsts else None))
                print(f"  {sig}: signal to exit {stopped - sent:.2f}s", flush=True)

        for kind, rows in results.items():
            delays = sorted(x[2] for x in rows if x[2] is not None)
            timing = ""
            if delays:
                timing = (
                    f", fault -> first resumed step: min {delays[0]:.1f}s / median {delays[len(delays) // 2]:.1f}s / max {delays[-1]:.1f}s"
                )
            print(f"{kind}: {len(rows)} injections, {sum(x[0] for x in rows)} finished, {sum(x[1] for x in rows)} bit-identical{timing}")


if __name__ == "__main__":
    main()
