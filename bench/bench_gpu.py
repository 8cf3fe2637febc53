"""The trainer against a hand-written compiled loop on the same GPU, shape, vocabulary and batch.

For each shape, in one run: the real trainer (`python -m aura_hpc local`, one process on one
GPU, its defaults for CUDA: bf16 autocast, torch.compile per block, chunked loss, fused AdamW,
prefetched batches) and bench/reference_gpu.py (a minimal GPT-2 loop written independently of the
trainer's model: SDPA, bf16 autocast, fused AdamW, torch.compile of model and loss, data already on
the GPU). Both exclude
their first --warmup-steps steps (compilation) from the timing. MFU = achieved model FLOP/s /
the GPU's dense bf16 peak, with 6·N + 12·L·d·T FLOPs per token (N parameters including the
embedding, L layers, width d, sequence length T; recomputation not counted).

Shapes: gpt2-small with a GPT-2-size vocabulary (50,304 embedding rows) at 16x1024 and 32x1024
tokens per step, and gpt2-1b at 4x2048. The trainer's vocabulary comes from the prepared data's
tokenizer, padded to 50,304 rows (model.padded_vocab_size).

The last line is `ratio trainer/reference X.XX, MFU Y.Y%`: the lowest ratio over the shapes
run, and the trainer's MFU at that shape. Without a GPU it exits with a message, unless
--allow-cpu: a smoke run of the script with a tiny shape (figures meaningless).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import run_trainer, trainer_run_dir

REPO = Path(__file__).resolve().parent.parent
SHARED_CORPUS = REPO.parent / "shared" / "data" / "quijote.txt"

from aura_hpc.ops.reference_loop import flops_per_token, peak_for  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    config: str
    batch: int
    seq_len: int
    vocab: int
    n_layer: int
    n_embd: int
    n_head: int


SHAPES = {
    "small-16": Shape("gpt2-small 16x1024", "gpt2-small", 16, 1024, 50304, 12, 768, 12),
    "small-32": Shape("gpt2-small 32x1024", "gpt2-small", 32, 1024, 50304, 12, 768, 12),
    "1b-4": Shape("gpt2-1b 4x2048", "gpt2-1b", 4, 2048, 50304, 36, 1536, 12),
}
CPU_SMOKE = Shape("tiny on CPU", "tiny", 4, 64, 1024, 2, 64, 2)


def prepare_data(tmp: Path, data: str, cpu: bool) -> Path:
    if data:
        return Path(data)
    from aura_hpc.data.prepare import PrepareSpec, prepare

    out = tmp / "data"
    if SHARED_CORPUS.exists() and not cpu:
        prepare(PrepareSpec(out_dir=out, inputs=[str(SHARED_CORPUS)], vocab_size=32768, val_fraction=0.01))
    else:
        prepare(PrepareSpec(out_dir=out, builtin=True, vocab_size=1024, val_fraction=0.05))
    return out


def run_reference(s: Shape, steps: int, warmup: int, cpu: bool) -> dict[str, float]:
    cmd = [sys.executable, str(REPO / "bench" / "reference_gpu.py"), "--n-layer", str(s.n_layer), "--n-embd", str(s.n_embd)]
    cmd += ["--n-head", str(s.n_head), "--seq-len", str(s.seq_len), "--vocab", str(s.vocab), "--batch-size", str(s.batch)]
    cmd += ["--steps", str(steps), "--warmup-steps", str(warmup)]
    if cpu:
        cmd += ["--device", "cpu", "--no-compile"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"the reference loop failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    result: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def run_shape(s: Shape, data: Path, tmp: Path, a: argparse.Namespace, peak: float, cpu: bool) -> tuple[float, float]:
    extra = ["--config", s.config]
    for kv in (
        "model.vocab_size=0",
        f"model.padded_vocab_size={s.vocab}",
        f"model.n_layer={s.n_layer}",
        f"model.n_embd={s.n_embd}",
        f"model.n_head={s.n_head}",
        f"model.n_positions={max(s.seq_len, 64)}",
        f"data.seq_len={s.seq_len}",
        f"train.batch_size={s.batch}",
        "train.grad_accum=1",
        "train.sample_every=0",
        "train.allow_oversubscription=true",
        "health.monitor_interval_s=0",
        *a.set,
    ):
        extra += ["--set", kv]
    tag = f"-{s.config}-{s.batch}"
    trainer = run_trainer(data, 1, a.steps, a.warmup_steps, tmp, 0, tuple(extra), tag=tag)
    run = trainer_run_dir(tmp, 1, 0, tag)
    n_params = json.loads((run / "summary.json").read_text())["n_params"]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["n_layer"] == s.n_layer and cfg["model"]["n_embd"] == s.n_embd
    ref = run_reference(s, a.steps, a.warmup_steps, cpu)
    fpt = flops_per_token(n_params, s.n_layer, s.n_embd, s.seq_len)
    mfu, ref_mfu = trainer * fpt / (peak * 1e12), ref["tokens_per_s"] * fpt / (peak * 1e12)
    ratio = trainer / ref["tokens_per_s"]
    print(
        f"{s.name}, vocab {s.vocab}, {n_params / 1e6:.1f}M parameters: trainer {trainer:,.0f} tokens/s (MFU {100 * mfu:.1f}%), "
        f"reference {ref['tokens_per_s']:,.0f} tokens/s (MFU {100 * ref_mfu:.1f}%, peak memory {ref['peak_mem_gib']} GiB, "
        f"first step {ref['first_step_s']}s), ratio {ratio:.2f}",
        flush=True,
    )
    return ratio, mfu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), help="shapes to run (repeatable; default: all)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=20, help="steps excluded from the timing (compilation, warm-up)")
    p.add_argument("--data", default="", help="a prepared directory (default: ../shared quijote.txt, else the built-in corpus)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak; default from the GPU's name")
    p.add_argument("--allow-cpu", action="store_true", help="smoke-run the script without a GPU (tiny shape)")
    p.add_argument("--set", action="append", default=[], help="extra --set overrides for the trainer")
    a = p.parse_args()

    import torch

    cpu = not torch.cuda.is_available()
    if cpu and not a.allow_cpu:
        sys.exit("no CUDA GPU here: this benchmark needs one (use --allow-cpu only to smoke-test the script)")
    name = "cpu" if cpu else torch.cuda.get_device_name(0)
    peak = a.peak_tflops or (1.0 if cpu else peak_for(name))
    if not peak:
        sys.exit(f"unknown peak bf16 FLOP/s for {name!r} (fix: --peak-tflops N, from the GPU's data sheet)")
    shapes = [CPU_SMOKE] if cpu else [SHAPES[k] for k in (a.shape or list(SHAPES))]
    steps, warmup = (min(a.steps, 12), min(a.warmup_steps, 4)) if cpu else (a.steps, a.warmup_steps)
    a.steps, a.warmup_steps = steps, warmup
    print(f"device {name}, torch {torch.__version__}, peak {peak:g} TFLOP/s, {steps} steps ({warmup} untimed)", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = prepare_data(tmp, a.data, cpu)
        results = [run_shape(s, data, tmp, a, peak, cpu) for s in shapes]
    ratio, mfu = min(results)
    print(f"ratio trainer/reference {ratio:.2f}, MFU {100 * mfu:.1f}%")


if __name__ == "__main__":
    main()
