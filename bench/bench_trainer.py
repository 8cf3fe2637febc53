"""Trainer tokens/s vs a bare PyTorch loop (bench/bare_loop.py): same model, data, batch, threads.

Both are timed by wall clock from step --warmup-steps to the last step; the trainer's figure
comes from the `elapsed_s`/`tokens` columns of its metrics.jsonl, so its logging, metric
all_reduce and progress reporting are inside the measurement. Runs alternate to share noise.

The trainer pins glibc's malloc thresholds on CPU (train.tune_malloc, aura_hpc/train/process/malloc_tuning.py),
which changes the speed of the same loop by several percent here. So each repeat runs four
programs and the report gives three ratios: the loop's own overhead with the allocator set the
same way on both sides (default glibc, and pinned through glibc's MALLOC_* variables, which do
what mallopt does), and the trainer as shipped against a bare loop as a user would write it.
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

from aura_hpc.train.process.malloc_tuning import MMAP_THRESHOLD, TRIM_THRESHOLD

REPO = Path(__file__).resolve().parent.parent


# The trainer's own thresholds (aura_hpc/train/process/malloc_tuning.py), through glibc's environment tunables.
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def _env(nproc: int, pinned_malloc: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_MALLOC}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // nproc))
    env["HF_HUB_OFFLINE"] = "1"
    if pinned_malloc:
        env.update(PINNED_MALLOC)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    r = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def run_bare(data: Path, nproc: int, steps: int, warmup: int, tmp: Path, pinned_malloc: bool) -> float:
    out = tmp / f"bare-{nproc}.json"
    env = _env(nproc, pinned_malloc)
    # A bare 2-process torchrun here has hung twice in gloo's rendezvous (one worker waiting, the
    # other gone), the failure PLATFORM.md describes for restarts; this is its documented fix.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    for attempt in range(3):
        try:
            return _run_bare_once(data, nproc, steps, warmup, out, env)
        except subprocess.TimeoutExpired:
            print(f"bare loop ({nproc} processes) stuck for 180 s; retrying ({attempt + 1}/3)", file=sys.stderr)
    raise RuntimeError("the bare loop hung three times")


def _run_bare_once(data: Path, nproc: int, steps: int, warmup: int, out: Path, env: dict[str, str]) -> float:
    _run(
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
        env,
        timeout=180,  # a run takes ~15 s; a stuck gloo rendezvous must not stall the benchmark
    )
    return float(json.loads(out.read_text())["tokens_per_s"])


def trainer_run_dir(tmp: Path, nproc: int, i: int, tag: str = "") -> Path:
    return tmp / f"t{nproc}-{i}{tag}"


def trainer_tokens_per_s(run_dir: Path, warmup: int) -> float:
    """Tokens/s from step `warmup` to the last logged step, from the run's metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] == warmup)
    last = rows[-1]
    return (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"])


def run_trainer(data: Path, nproc: int, steps: int, warmup: int, tmp: Path, i: int, extra: tuple[str, ...] = (), tag: str = "") -> float:
    run_dir = trainer_run_dir(tmp, nproc, i, tag)
    _run(
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
            run_dir.name,
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
        _env(nproc),
        timeout=600,  # a stuck gloo rendezvous must not stall the benchmark forever
    )
    return trainer_tokens_per_s(run_dir, warmup)


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
            runs: dict[str, list[float]] = {"bare": [], "bare_pinned": [], "trainer": [], "trainer_untuned": []}
            for i in range(a.repeats):
                runs["bare"].append(run_bare(data, nproc, a.steps, a.warmup_steps, tmp, pinned_malloc=False))
                runs["trainer"].append(run_trainer(data, nproc, a.steps, a.warmup_steps, tmp, i))
                runs["bare_pinned"].append(run_bare(data, nproc, a.steps, a.warmup_steps, tmp, pinned_malloc=True))
                runs["trainer_untuned"].append(
                    run_trainer(data, nproc, a.steps, a.warmup_steps, tmp, i, ("--set", "train.tune_malloc=false"), "-untuned")
                )
            med = {k: statistics.median(v) for k, v in runs.items()}
            print(f"{nproc} process(es), {_env(nproc)['OMP_NUM_THREADS']} thread(s) each, median of {a.repeats}:")
            for label, t_key, b_key in (
                ("default glibc malloc on both sides", "trainer_untuned", "bare"),
                ("pinned malloc thresholds on both sides", "trainer", "bare_pinned"),
                ("as shipped (trainer pinned) vs a plain bare loop", "trainer", "bare"),
            ):
                t, b = med[t_key], med[b_key]
                print(
                    f"  {label}: trainer {t:,.0f} tok/s, bare loop {b:,.0f} tok/s, trainer/bare = {t / b:.3f} "
                    f"(overhead {100 * (1 - t / b):+.1f}%)"
                )
            print("  all runs: " + json.dumps({k: [round(x) for x in v] for k, v in runs.items()}))


if __name__ == "__main__":
    main()
