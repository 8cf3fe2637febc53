"""Tokens/s and peak memory per dist.strategy: ddp, fsdp, zero1, zero2, zero3, on the same model and data.

One run per strategy and repeat through the real trainer (`python -m aura_hpc local`), 2 ranks on
CPU (gloo) or one per GPU. Tokens/s from metrics.jsonl, from step --warmup-steps to the last; peak
memory of rank 0 from summary.json (the GPU allocator's peak; on CPU the growth of the resident
set after start-up), next to the memory plan's estimate for the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import run_trainer, trainer_run_dir

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=0, help="processes (default: GPUs, or 2 on CPU)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategy", action="append", choices=STRATEGIES, help="default: all")
    p.add_argument("--set", action="append", default=[], help="extra --set overrides (model shape, batch)")
    a = p.parse_args()

    import torch

    from aura_hpc.config import load_config
    from aura_hpc.data.prepare import PrepareSpec, prepare
    from aura_hpc.launch.memory import GIB, plan

    gpus = torch.cuda.device_count()
    nproc = a.nproc or gpus or 2
    shape = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "model.n_positions=256", "data.seq_len=256", "train.batch_size=8"]
    overrides = [*shape, "train.precision=fp32" if not gpus else "train.precision=auto", *a.set]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        prepare(PrepareSpec(out_dir=data, builtin=True, vocab_size=1024, val_fraction=0.05))
        vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
        results: dict[str, list[tuple[float, float]]] = {}
        for i in range(a.repeats):
            for s in a.strategy or STRATEGIES:
                extra: list[str] = []
                for kv in [*overrides, f"dist.strategy={s}", "train.sample_every=0"]:
                    extra += ["--set", kv]
                tok_s = run_trainer(data, nproc, a.steps, a.warmup_steps, tmp, i, tuple(extra), tag=f"-{s}")
                summary = json.loads((trainer_run_dir(tmp, nproc, i, f"-{s}") / "summary.json").read_text())
                results.setdefault(s, []).append((tok_s, summary["peak_memory_gib"]))
    where = f"{nproc} x {torch.cuda.get_device_name(0)}" if gpus else f"{nproc} CPU processes (gloo)"
    print(f"{where}, torch {torch.__version__}, {a.steps} steps ({a.warmup_steps} untimed), median of {a.repeats}")
    print(f"  model and batch: {' '.join(overrides)}")
    for s, runs in results.items():
        cfg = load_config(None, [*overrides, f"dist.strategy={s}", "train.warmup_steps=5"])
        est = plan(cfg, vocab, nproc, gpu=bool(gpus)).total / GIB
        tok = statistics.median(r[0] for r in runs)
        mem = statistics.median(r[1] for r in runs)
        print(f"  {s:6s} {tok:10,.0f} tokens/s   peak memory rank 0 {mem:6.2f} GiB   memory plan {est:6.2f} GiB")


if __name__ == "__main__":
    main()
