"""GPT-2 124M (configs/gpt2-small.yaml) on this machine's NVIDIA GPUs: tokens/s and MFU.

Runs the real trainer (`python -m aura_hpc local --config gpt2-small`, one process per GPU,
bf16 autocast, DDP over NCCL) for --steps steps and measures from step --warmup-steps to the
last step using metrics.jsonl. MFU = achieved model FLOP/s / peak dense bf16 FLOP/s of the
GPUs, with the PaLM/nanoGPT count of 6·N + 12·L·d·T FLOPs per trained token (N parameters,
L layers, width d, sequence length T; no activation recomputation). The resource monitor
samples the GPUs every 2 s, so the report also gives the highest GPU memory use (NVML).

Data: `--data DIR` (a prepared directory), else ../shared/data/quijote.txt when present, else
the package's built-in corpus; either is repeated to fill batches (speed does not depend on
the text). Without a GPU it exits with a message, unless --allow-cpu (a smoke run of the
script itself, with --peak-tflops and a small --config).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import run_trainer, trainer_run_dir

REPO = Path(__file__).resolve().parent.parent
SHARED_CORPUS = REPO.parent / "shared" / "data" / "quijote.txt"

# Dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA data sheets; sparsity not counted).
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,  # SXM / HBM3
    "A100": 312.0,
    "L40S": 362.05,
    "L4": 121.0,
}


def peak_for(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():  # the more specific names come first
        if key in device_name:
            return tflops
    return None


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    return 6.0 * n_params + 12.0 * n_layer * n_embd * seq_len


def prepare_data(tmp: Path, data: str) -> Path:
    if data:
        return Path(data)
    from aura_hpc.data.prepare import PrepareSpec, prepare

    out = tmp / "data"
    if SHARED_CORPUS.exists():
        prepare(PrepareSpec(out_dir=out, inputs=[str(SHARED_CORPUS)], vocab_size=32768, val_fraction=0.01))
    else:
        prepare(PrepareSpec(out_dir=out, builtin=True, vocab_size=4096, val_fraction=0.05))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt2-small")
    p.add_argument("--nproc", type=int, default=0, help="processes (GPUs); 0 = every visible GPU")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per GPU per micro-step")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup-steps", type=int, default=20, help="steps excluded from the timing")
    p.add_argument("--data", default="", help="a prepared directory (default: see above)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak; default from the GPU's name")
    p.add_argument("--allow-cpu", action="store_true", help="smoke-run the script without a GPU")
    p.add_argument("--set", action="append", default=[], help="extra --set overrides for the trainer")
    a = p.parse_args()

    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0 and not a.allow_cpu:
        sys.exit("no CUDA GPU here: this benchmark needs one (use --allow-cpu only to smoke-test the script)")
    name = torch.cuda.get_device_name(0) if gpus else "cpu"
    peak = a.peak_tflops or peak_for(name)
    if not peak:
        sys.exit(f"unknown peak bf16 FLOP/s for {name!r} (fix: --peak-tflops N, from the GPU's data sheet)")
    nproc = a.nproc or max(gpus, 1)

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = prepare_data(tmp, a.data)
        extra = ["--config", a.config]
        for kv in (
            "model.vocab_size=0",
            f"train.batch_size={a.batch_size}",
            "train.grad_accum=1",
            "train.sample_every=0",
            "train.allow_oversubscription=true",
            "health.monitor_interval_s=2",
            *a.set,
        ):
            extra += ["--set", kv]
        tok_s = run_trainer(data, nproc, a.steps, a.warmup_steps, tmp, 0, tuple(extra), tag="-gpu")
        run = trainer_run_dir(tmp, nproc, 0, "-gpu")
        last_step = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        n_params = json.loads((run / "summary.json").read_text())["n_params"]
        m = cfg["model"]
        fpt = flops_per_token(n_params, m["n_layer"], m["n_embd"], cfg["data"]["seq_len"])
        mfu = tok_s * fpt / (peak * 1e12 * nproc)
        mem: list[float] = []
        res = run / "resources" / "node0.jsonl"
        if res.exists():
            for line in res.read_text().splitlines():
                mem += [g["mem_used_mb"] for g in json.loads(line).get("gpus", []) if "mem_used_mb" in g]
        print(
            f"{a.config} ({n_params / 1e6:.1f}M parameters), {nproc} x {name}, batch {a.batch_size} x "
            f"{cfg['data']['seq_len']} tokens per GPU, steps {a.warmup_steps}-{last_step}: "
            f"{tok_s:,.0f} tokens/s ({tok_s / nproc:,.0f} per GPU), "
            f"{tok_s * fpt / 1e12 / nproc:.1f} TFLOP/s per GPU, MFU {100 * mfu:.1f}% of {peak:g} TFLOP/s"
            + (f", GPU memory up to {max(mem) / 1024:.1f} GiB" if mem else "")
        )


if __name__ == "__main__":
    main()
