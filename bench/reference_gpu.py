"""The hand-written loop bench_gpu.py holds the trainer against: as fast as plain PyTorch gets.

transformers' GPT2LMHeadModel (SDPA attention), bf16 autocast, fused AdamW, gradient clipping,
`torch.compile` of the whole model and loss, and the token batches already on the GPU (a pool
of random batches, so no data loading at all). One process, one device. Timed with CUDA
synchronisation from step --warmup-steps to the last; the loss is read only at the end.

Prints one JSON line: tokens_per_s, peak_mem_gib, n_params, first_step_s.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
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
    a = p.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.seq_len,
        n_embd=a.n_embd,
        n_layer=a.n_layer,
        n_head=a.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95), fused=cuda
    )
    pool = torch.randint(0, a.vocab, (8, a.batch_size, a.seq_len + 1), device=device)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))

    step_fn = loss_of if a.no_compile else torch.compile(loss_of)
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
        with autocast:
            loss = step_fn(pool[step % len(pool)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            sync()
            first_step_s = time.perf_counter() - t_start
    sync()
    elapsed = time.perf_counter() - t0
    tokens = (a.steps - a.warmup_steps) * a.batch_size * a.seq_len
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / elapsed,
                "peak_mem_gib": round(peak, 2),
                "n_params": n_params,
                "first_step_s": round(first_step_s, 2),
                "final_loss": round(float(loss.detach()), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
