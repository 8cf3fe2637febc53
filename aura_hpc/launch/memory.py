"""The memory plan: what one GPU will hold under each strategy, decided before any GPU is used.

Per GPU, in bytes: parameters + gradients + optimizer state (AdamW: two fp32 moments) for the
strategy over N data-parallel ranks, the bf16 weight copies autocast keeps for the backward pass,
activations of one micro-batch (with and without activation checkpointing), the loss's buffers
(the full logits, or the chunked loss's chunk and its gradient accumulators), DeepSpeed's bucket
buffers, an allowance for the CUDA context and the caching allocator, and (host RAM: in the total
on CPU only) the copy the checkpoints keep from save to save. Pure arithmetic on the
config (no torch): both dry runs print it; `local` and `submit` refuse only a plan that is beyond
any doubt too big (more than PLAN_MARGIN over the memory), warn when it is close, and `--force`
goes on anyway.

Activations are our GPT-2 block's (train/model/gpt.py), in bytes per token per layer per unit of width,
measured on CPU with glibc's allocator statistics (tests/test_memory_plan.py re-measures them):
fp32 66 (eager and compiled), bf16 autocast 44 eager and 42 compiled; dropout adds the masks
(and, on CPU, the attention probabilities of SDPA's math path). On a GPU, flash attention saves
no T x T matrix and inductor may recompute more; these are upper bounds there, and the GPU
measurement is still to be made (README, Speed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from aura_hpc.config import RunConfig, embedding_rows

GIB = 2**30
# (precision, compiled) -> bytes per token per layer per d (measured for our module; see above)
ACT_BYTES = {("fp32", False): 66, ("fp32", True): 66, ("bf16", False): 44, ("bf16", True): 42}
ACT_DROPOUT = {("fp32", False): 33, ("fp32", True): 21, ("bf16", False): 35, ("bf16", True): 13}
ACT_BYTES_PER_TOKEN_LAYER_FP32 = ACT_BYTES[("fp32", False)]  # the CPU measurement's coefficient
ACT_DROPOUT_PER_TOKEN_LAYER = ACT_DROPOUT[("fp32", False)]
ACT_CHECKPOINTED_PER_TOKEN_LAYER = 4  # x d: only each block's fp32 input is kept
CHUNK_BYTES = 256 * 2**20  # train/model/loss.py: one chunk's fp32 logits at most
CONTEXT_BYTES = 1 * GIB  # CUDA context, NCCL buffers, cuBLAS workspaces
CPU_PROCESS_BYTES = int(0.5 * GIB)  # a CPU worker before its model: Python, torch (RSS 0.33 GiB measured)
FRAGMENTATION = 0.05  # the caching allocator's slack on top of live tensors
PLAN_MARGIN = 0.15  # how far the plan may be off: refused only beyond it
DEEPSPEED_BUCKET = int(5e8)  # reduce_bucket_size and allgather_bucket_size defaults, elements
DEEPSPEED_PREFETCH = int(5e7)  # stage3_prefetch_bucket_size default, elements
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "zero3")  # what a plan that does not fit may suggest


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
    weight_copies: float = 0.0  # bf16 casts of the weights autocast keeps for the backward pass
    buffers: float = 0.0  # DeepSpeed's gradient/parameter buckets
    # Host memory the checkpoints keep between saves (train/checkpoint/host_mirror.py: buffers reused from save to
    # save): rank 0's, and each other rank's (sharded strategies). Host RAM, not GPU memory: in `total`
    # (rank 0's) only on CPU, where the two are the same.
    checkpoint_copy: float = 0.0
    checkpoint_copy_others: float = 0.0
    gpu: bool = True

    @property
    def total(self) -> float:
        return self.training_total + (0.0 if self.gpu else self.checkpoint_copy)

    @property
    def training_total(self) -> float:
        """Per rank, without the checkpoints' host copies."""
        live = self.params + self.grads + self.optimizer + self.weight_copies + self.activations + self.logits + self.buffers
        return live + self.overhead

    def checkpoint_copies_on_node(self, nproc: int) -> float:
        """The checkpoints' host copies of one node's `nproc` processes (node 0, which holds rank 0's)."""
        return self.checkpoint_copy + (nproc - 1) * self.checkpoint_copy_others

    def rows(self) -> list[tuple[str, str]]:
        def g(x: float) -> str:
            return f"{x / GIB:,.1f} GiB"

        rows = [
            ("parameters", g(self.params)),
            ("gradients", g(self.grads)),
            ("optimizer state", g(self.optimizer)),
            ("activations", f"{g(self.activations)} (with activation checkpointing {g(self.activations_checkpointed)})"),
            ("loss buffers", g(self.logits)),
        ]
        if self.weight_copies:
            rows.append(("bf16 weight copies (autocast)", g(self.weight_copies)))
        if self.buffers:
            rows.append(("DeepSpeed buckets", g(self.buffers)))
        rows.append(("context + allocator", g(self.overhead)))
        if self.checkpoint_copy:
            others = f", {g(self.checkpoint_copy_others)} each other rank" if self.checkpoint_copy_others else ""
            where = ", host RAM (pinned), not in the total" if self.gpu else ""
            rows.append(("checkpoint host copy", f"{g(self.checkpoint_copy)} rank 0{others}{where}"))
        return [*rows, ("total per GPU" if self.gpu else "total per process", g(self.total))]


def _compiled(cfg: RunConfig, gpu: bool) -> bool:
    t = cfg.train
    return t.compile == "true" or (t.compile == "auto" and gpu and not cfg.dist.strategy.startswith("zero"))


def plan(cfg: RunConfig, tokenizer_vocab: int, world: int, gpu: bool = True, strategy: str | None = None) -> MemoryPlan:
    """The per-GPU memory of `cfg` on `world` ranks under `strategy` (default: the config's)."""
    s = strategy or cfg.dist.strategy
    m, t = cfg.model, cfg.train
    p = parameter_count(cfg, tokenizer_vocab)
    bf16 = gpu and t.precision in ("auto", "bf16", "fp16")
    n = max(1, world)
    d, layers = m.n_embd, m.n_layer
    block = 12 * d * d + 13 * d
    buffers = 0.0
    if s == "ddp":
        params, grads, optim = 4 * p, 4 * p, 8 * p
    elif s == "diloco":
        # the inner AdamW, plus the anchor and the outer momentum (fp32) and the flat wire buffer
        # int8: the fp32 flat buffer, the transient fp32 copies of encoding and decoding, every replica's codes
        wire = {"bf16": 2, "fp32": 4, "int8": 20 + n}[cfg.dist.diloco_wire]
        if cfg.dist.diloco_overlap:  # a meeting in flight: the weights it was sent from, what was sent, what arrives
            wire += 4 + {"bf16": 4, "fp32": 8, "int8": 1 + n}[cfg.dist.diloco_wire]
        params, grads, optim = 4 * p, 4 * p, 8 * p + 8 * p + wire * p
    elif s == "fsdp":
        # fp32 shards, plus the gathered bf16 (or fp32) copy of the root and two blocks in flight.
        unsharded = (2 if bf16 else 4) * (p - layers * block + 2 * block)
        params, grads, optim = 4 * p / n + unsharded, 4 * p / n + 4 * block, 8 * p / n
    elif bf16:  # DeepSpeed bf16: bf16 weights and gradients, fp32 master + moments in the optimizer
        params = 2 * p / n if s == "zero3" else 2 * p
        # Accumulated in fp32 (config/deepspeed.py), but for ZeRO-2's partition: its stage keeps it in bf16.
        grads = {"zero2": 2 * p / n, "zero3": 4 * p / n}.get(s, 4 * p)
        optim = 12 * p / n
    else:
        params = 4 * p / n if s == "zero3" else 4 * p
        grads = 4 * p / n if s in ("zero2", "zero3") else 4 * p
        optim = 8 * p / n
    if s.startswith("zero") and gpu:
        # fp32 reduce bucket (communication_data_type fp32) and, below stage 3, the all-gather bucket;
        # stage 3 prefetches parameters instead. Capped by the model's size.
        buffers = 4 * min(DEEPSPEED_BUCKET, p) + (2 * min(DEEPSPEED_PREFETCH, p) if s == "zero3" else 2 * min(DEEPSPEED_BUCKET, p))
    if s.startswith("zero") and cfg.dist.zero_offload_optimizer:
        optim = 0.0
    if s == "fsdp" and cfg.dist.fsdp_cpu_offload:
        params, grads, optim = params - 4 * p / n, grads - 4 * p / n, 0.0
    # autocast keeps a bf16 copy of every matmul weight for the backward pass (FSDP's bf16 parameters need none).
    weight_copies = 2.0 * p if bf16 and s in ("ddp", "zero1", "zero2", "diloco") else 0.0
    tokens = t.batch_size * cfg.data.seq_len
    key = ("bf16" if bf16 else "fp32", _compiled(cfg, gpu))
    per_layer = (ACT_BYTES[key] + (ACT_DROPOUT[key] if m.dropout > 0 else 0)) * d
    full = tokens * layers * per_layer + tokens * d * 8  # + embeddings and the final norm
    checkpointed = tokens * layers * ACT_CHECKPOINTED_PER_TOKEN_LAYER * d + tokens * per_layer + tokens * d * 8
    activations = checkpointed if t.activation_checkpointing else full
    vocab = embedding_rows(m, tokenizer_vocab)
    chunked = t.loss == "chunked" or (t.loss == "auto" and gpu and t.precision != "fp16")
    if chunked:
        # a chunk's fp32 logits (computed in place), its bf16 gradient, the fp32 accumulator of the output
        # matrix's gradient, the gradient of the hidden states, and the compute-dtype copy of the matrix.
        logits = CHUNK_BYTES * 1.5 + 4 * vocab * d + tokens * d * 4 + (2 if bf16 else 0) * vocab * d
    else:
        logits = tokens * vocab * (10 if bf16 else 8)
    live = params + grads + optim + weight_copies + activations + logits + buffers
    rank0_copy, other_copy = checkpoint_host_copy(cfg, p, n, s, gpu, bf16)
    return MemoryPlan(
        s,
        n,
        params,
        grads,
        optim,
        activations,
        logits,
        CONTEXT_BYTES * gpu + FRAGMENTATION * live,
        checkpointed,
        weight_copies,
        buffers,
        rank0_copy,
        other_copy,
        gpu,
    )


def checkpoint_host_copy(cfg: RunConfig, p: int, n: int, s: str, gpu: bool, bf16: bool) -> tuple[float, float]:
    """(rank 0's, each other rank's) bytes of host memory the checkpoints keep from the first periodic
    save on (train/checkpoint/host_mirror.py: buffers reused from save to save). Replicated strategies copy rank 0's
    weights, fp32 AdamW moments and what the strategy adds (DiLoCo's anchor and outer momentum). Sharded
    ones keep buffers only on a GPU (pinned, for background writes: the fp32 master and moments, the
    rank's part of DeepSpeed's module file, rank 0's with the full weights below stage 3); on CPU their
    copy lives only while it is written (measured: not in the peak). When the only save is the last
    one, it comes after the last step's activations are freed: nothing is counted."""
    t = cfg.train
    if t.checkpoint_every <= 0 or (t.max_tokens <= 0 and t.checkpoint_every >= t.max_steps):
        return 0.0, 0.0
    if s == "ddp":
        return 12.0 * p, 0.0
    if s == "diloco":
        return 20.0 * p, 0.0
    if not gpu or not t.async_checkpoint:
        return 0.0, 0.0
    if s == "fsdp":
        return 12.0 * p / n, 12.0 * p / n
    weight = 2.0 if bf16 else 4.0
    shard = (12.0 + weight) * p / n  # fp32 master and moments, and the rank's part of the module file
    if s == "zero3":
        return shard, shard
    return shard + weight * p * (n - 1) / n, shard


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


def check_fits(cfg: RunConfig, tokenizer_vocab: int, world: int, limit_gib: float, force: bool = False) -> tuple[str | None, str | None]:
    """(refusal, warning): a refusal when the plan is beyond PLAN_MARGIN over `limit_gib` per GPU
    (unless `force`), a warning with the margin when it is over, or within PLAN_MARGIN of it."""
    mine = plan(cfg, tokenizer_vocab, world)
    total, limit = mine.total, limit_gib * GIB
    if total <= limit * (1 - PLAN_MARGIN):
        return None, None
    fix = fitting_alternative(cfg, tokenizer_vocab, world, limit_gib * (1 - PLAN_MARGIN))
    fix = fix or "a smaller train.batch_size or data.seq_len, more GPUs, or a smaller model"
    what = f"the memory plan needs ~{total / GIB:.0f} GiB per GPU with {mine.strategy} on {world} GPU(s)"
    if total > limit * (1 + PLAN_MARGIN) and not force:
        return (
            f"{what}, more than the {limit_gib:g} GiB of this cluster's GPUs even allowing for the plan's "
            f"{100 * PLAN_MARGIN:.0f}% error (fix: {fix}; or --force to try anyway)"
        ), None
    margin = 100 * (limit - total) / limit
    return None, (
        f"{what} of their {limit_gib:g} GiB ({margin:+.0f}% margin; the plan is good to ~{100 * PLAN_MARGIN:.0f}%): it may not fit "
        f"(if it runs out of memory: {fix})"
    )
