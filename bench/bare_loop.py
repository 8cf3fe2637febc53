"""The baseline for bench_trainer.py: a bare PyTorch DDP loop, same model, data, batch and threads.

Started with `python -m torch.distributed.run --standalone --nproc-per-node N bench/bare_loop.py ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps excluded from the timing")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    manifest = json.load(open(os.path.join(a.data, "manifest.json")))
    files = [s["file"] for s in manifest["shards"] if s["split"] == "train"] if "shards" in manifest else ["train.bin"]
    tokens = np.concatenate([np.memmap(os.path.join(a.data, f), dtype=manifest["dtype"], mode="r") for f in files])
    vocab, eos = manifest["tokenizer"]["vocab_size"], manifest["tokenizer"]["eos_id"]
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=256,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95), foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / a.steps)))
    n_seq = (len(tokens) - 1) // a.seq
    rng = np.random.default_rng(rank)
    t_start = 0.0
    for step in range(a.steps):
        if step == a.warmup_steps:
            t_start = time.perf_counter()
        idx = rng.integers(0, n_seq, a.batch)
        batch = torch.from_numpy(np.stack([np.asarray(tokens[i * a.seq : i * a.seq + a.seq + 1], dtype=np.int64) for i in idx]))
        logits = ddp(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t_start
    tok_s = (a.steps - a.warmup_steps) * a.batch * a.seq * world / elapsed
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"tokens_per_s": tok_s, "elapsed_s": elapsed}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
