"""The loop the trainer is held against: a minimal GPT-2 training loop, as fast as plain PyTorch gets.

Written independently of the trainer's model (aura_hpc/train/model/gpt.py) on purpose: its own small
GPT-2 (nn.Linear layers, fused QKV, SDPA causal attention, tanh GELU, tied embedding), bf16
autocast, `torch.compile` of model and loss together, fused AdamW, gradient clipping, and the token
batches already on the GPU (a pool of random batches: no data loading). One process, one device.
Timed with CUDA synchronisation from step --warmup-steps to the last; the loss is read at the end.

    python -m aura_hpc.ops.reference_loop --n-layer 12 --n-embd 768 --seq-len 1024 --batch-size 16

Prints one JSON line: tokens_per_s, peak_mem_gib, n_params, first_step_s, final_loss.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from typing import Any

# Dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA data sheets; sparsity not counted).
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.5,  # the 94 GB card: 1,671 with sparsity
    "H100": 989.4,  # SXM / HBM3
    "A100": 312.0,
    "L40S": 362.05,
    "L40": 181.05,
    "L4": 121.0,
}


def peak_for(device_name: str) -> float | None:
    """The peak of the first model name (the more specific come first) found whole in the device's name:
    "L4" is not the L40's (a substring match gave the L40 an L4's peak, and its MFU 1.5 times too high). None for a MIG
    slice ("NVIDIA A100-SXM4-40GB MIG 1g.5gb"): a fraction of the part's peak, its MFU was shown 7 times too low."""
    if re.search(r"(?<![\w])MIG(?![\w])", device_name):
        return None
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", device_name):
            return tflops
    return None


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """6·N + 12·L·d·T: the model FLOPs of one trained token (recomputation not counted)."""
    return 6.0 * n_params + 12.0 * n_layer * n_embd * seq_len


def build(n_layer: int, n_embd: int, n_head: int, seq_len: int, vocab: int) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
            self.up, self.down = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, n_head, d // n_head).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(seq_len, n_embd)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln = nn.LayerNorm(n_embd)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.tok.weight.t()
            return F.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1))

    return Model()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=15)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)

    import torch

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = build(a.n_layer, a.n_embd, a.n_head, a.seq_len, a.vocab).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95), fused=cuda
    )
    pool = torch.randint(0, a.vocab, (8, a.batch_size, a.seq_len + 1), device=device)
    step_fn = model if a.no_compile else torch.compile(model)
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t_start = time.perf_counter()
    t0 = t_start
    first_step_s = 0.0
    loss = torch.zeros((), device=device)
    for step in range(a.steps):
        if step == a.warmup_steps:
            sync()
            t0 = time.perf_counter()
        batch = pool[step % len(pool)]
        with autocast:
            loss = step_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            sync()
            first_step_s = time.perf_counter() - t_start
    sync()
    elapsed = time.perf_counter() - t0
    tokens = (a.steps - a.warmup_steps) * a.batch_size * a.seq_len
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    result = {
        "tokens_per_s": tokens / elapsed,
        "peak_mem_gib": round(peak, 2),
        "n_params": n_params,
        "first_step_s": round(first_step_s, 2),
        "final_loss": round(float(loss.detach()), 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
