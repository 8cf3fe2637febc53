"""The memory plan: what one GPU will hold under each strategy, decided before any GPU is used.

Per GPU, in bytes: parameters + gradients + optimizer state (AdamW: two fp32 moments) for the
strategy over N data-parallel ranks, activations of one micro-batch (with and without activation
checkpointing), the logits of the loss, and an allowance for the CUDA context and the caching
allocator. Pure arithmetic on the config (no torch): `submit --dry-run` prints it and `submit`
and `local` refuse a plan that cannot fit, naming a strategy that does.

Activations of a transformers GPT-2 block kept for the backward pass, eager: about 92·d bytes per
token per layer under bf16 autocast (the residual stream and layer-norm inputs in fp32, matmul
inputs and the GELU's intermediates in bf16), and 122·d in fp32. The bf16 figure reproduces the
one GPU peak we have (gpt2-1b, 4×2048 tokens, DDP, eager: 56.7 GiB on an H100, from the issue
that asked for this plan); the fp32 one was measured on CPU with glibc's allocator statistics
(tests/test_memory_plan.py). torch.compile fuses the GELU and keeps less, so compiled runs land
below the estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from aura_hpc.config import RunConfig, embedding_rows

GIB = 2**30
ACT_BYTES_PER_TOKEN_LAYER_BF16 = 92  # x d, see above
ACT_BYTES_PER_TOKEN_LAYER_FP32 = 122  # x d
ACT_DROPOUT_PER_TOKEN_LAYER = 25  # x d: the dropout masks kept when model.dropout > 0 (measured on CPU)
ACT_CHECKPOINTED_PER_TOKEN_LAYER = 4  # x d: only each block's fp32 input is kept
CONTEXT_BYTES = 1 * GIB  # CUDA context, NCCL buffers, cuBLAS workspaces
CPU_PROCESS_BYTES = int(0.5 * GIB)  # a CPU worker before its model: Python, torch, transformers (RSS 0.33 GiB measured)
FRAGMENTATION = 0.05  # the caching allocator's slack on top of live tensors
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "zero3")


def tokenizer_vocab(cfg: RunConfig) -> int:
    """The prepared data's vocabulary; for data not prepared yet (the built-in corpus) data.vocab_size, an upper bound."""
    import json
    from pathlib import Path

    if cfg.data.path:
        try:
            return int(json.loads((Path(cfg.data.path) / "manifest.json").read_text())["tokenizer"]["vocab_size"])
        except (OSError, ValueError, KeyError):
            pass
    return cfg.model.vocab_size or cfg.data.vocab_size


def parameter_count(cfg: RunConfig, tokenizer_vocab: int) -> int:
    m = cfg.model
    d, vocab = m.n_embd, embedding_rows(m, tokenizer_vocab)
    per_block = 12 * d * d + 13 * d  # attention qkv + projection, MLP in + out, two layer norms
    return vocab * d + m.n_positions * d + m.n_layer * per_block + 2 * d  # the output matrix is tied to the embedding


@dataclass
class MemoryPlan:
    strategy: str
    world: int
    params: float  # bytes per GPU
    grads: float
    optimizer: float
    activations: float
    logits: float
    overhead: float
    activations_checkpointed: float  # what `activations` would be with train.activation_checkpointing

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.overhead

    def rows(self) -> list[tuple[str, str]]:
        def g(x: float) -> str:
            return f"{x / GIB:,.1f} GiB"

        return [
            ("parameters", g(self.params)),
            ("gradients", g(self.grads)),
            ("optimizer state", g(self.optimizer)),
            ("activations", f"{g(self.activations)} (with activation checkpointing {g(self.activations_checkpointed)})"),
            ("loss logits", g(self.logits)),
            ("context + allocator", g(self.overhead)),
            ("total per GPU", g(self.total)),
        ]


def plan(cfg: RunConfig, tokenizer_vocab: int, world: int, gpu: bool = True, strategy: str | None = None) -> MemoryPlan:
    """The per-GPU memory of `cfg` on `world` ranks under `strategy` (default: the config's)."""
    s = strategy or cfg.dist.strategy
    m, t = cfg.model, cfg.train
    p = parameter_count(cfg, tokenizer_vocab)
    bf16 = gpu and t.precision in ("auto", "bf16", "fp16")
    n = max(1, world)
    d, layers = m.n_embd, m.n_layer
    block = 12 * d * d + 13 * d
    if s == "ddp":
        params, grads, optim = 4 * p, 4 * p, 8 * p
    elif s == "fsdp":
        # fp32 shards, plus the gathered bf16 (or fp32) copy of the root and two blocks in flight.
        unsharded = (2 if bf16 else 4) * (p - layers * block + 2 * block)
        params, grads, optim = 4 * p / n + unsharded, 4 * p / n + 4 * block, 8 * p / n
    elif bf16:  # DeepSpeed bf16: bf16 weights and gradients, fp32 master + moments in the optimizer
        params = 2 * p / n if s == "zero3" else 2 * p
        grads = 2 * p / n if s in ("zero2", "zero3") else 2 * p
        optim = 12 * p / n
    else:
        params = 4 * p / n if s == "zero3" else 4 * p
        grads = 4 * p / n if s in ("zero2", "zero3") else 4 * p
        optim = 8 * p / n
    if s.startswith("zero") and cfg.dist.zero_offload_optimizer:
        optim = 0.0
    if s == "fsdp" and cfg.dist.fsdp_cpu_offload:
        params, grads, optim = params - 4 * p / n, grads - 4 * p / n, 0.0
    tokens = t.batch_size * cfg.data.seq_len
    per_layer = (ACT_BYTES_PER_TOKEN_LAYER_BF16 if bf16 else ACT_BYTES_PER_TOKEN_LAYER_FP32) * d
    if m.dropout > 0:
        per_layer += ACT_DROPOUT_PER_TOKEN_LAYER * d
    full = tokens * layers * per_layer + tokens * d * 8  # + embeddings and the final norm
    checkpointed = tokens * layers * ACT_CHECKPOINTED_PER_TOKEN_LAYER * d + tokens * per_layer + tokens * d * 8
    activations = checkpointed if t.activation_checkpointing else full
    vocab = embedding_rows(m, tokenizer_vocab)
    chunked = t.loss == "chunked" or (t.loss == "auto" and gpu and t.precision != "fp16")
    logits = 2 * 256 * 2**20 if chunked else tokens * vocab * (10 if bf16 else 8)
    live = params + grads + optim + activations + logits
    return MemoryPlan(s, n, params, grads, optim, activations, logits, CONTEXT_BYTES * gpu + FRAGMENTATION * live, checkpointed)


def fitting_alternative(cfg: RunConfig, tokenizer_vocab: int, world: int, limit_gib: float) -> str | None:
    """The first change (strategy, then activation checkpointing) whose plan fits `limit_gib`."""
    limit = limit_gib * GIB
    for s in STRATEGIES:
        if s != cfg.dist.strategy and plan(cfg, tokenizer_vocab, world, strategy=s).total <= limit:
            return f"--set dist.strategy={s} (~{plan(cfg, tokenizer_vocab, world, strategy=s).total / GIB:.0f} GiB per GPU)"
    if not cfg.train.activation_checkpointing:
        recompute = copy.deepcopy(cfg)
        recompute.train.activation_checkpointing = True
        for s in (cfg.dist.strategy, *STRATEGIES):
            total = plan(recompute, tokenizer_vocab, world, strategy=s).total
            if total <= limit:
                extra = "" if s == cfg.dist.strategy else f" --set dist.strategy={s}"
                return f"--set train.activation_checkpointing=true{extra} (~{total / GIB:.0f} GiB per GPU)"
    return None


def check_fits(cfg: RunConfig, tokenizer_vocab: int, world: int, limit_gib: float) -> str | None:
    """None when the plan fits `limit_gib` per GPU; else the one-line refusal, naming the fix."""
    mine = plan(cfg, tokenizer_vocab, world)
    if mine.total <= limit_gib * GIB:
        return None
    fix = fitting_alternative(cfg, tokenizer_vocab, world, limit_gib)
    fix = fix or "a smaller train.batch_size or data.seq_len, more GPUs, or a smaller model"
    return (
        f"the memory plan needs ~{mine.total / GIB:.0f} GiB per GPU with {mine.strategy} on {world} GPU(s), more than the "
        f"{limit_gib:g} GiB of this cluster's GPUs (fix: {fix})"
    )
