"""Which way of training over this link: the expected time of a step, split into compute and
communication, for DDP, DDP with bf16 or PowerSGD compression, and DiLoCo, from the link's measured
bandwidth and latency and the configured model and batch. `check` prints it between nodes, and
`local` says it in one line when its nodes are on a LAN.

The arithmetic (an estimate; nothing overlaps in it, which is pessimistic for DDP on fast links):
a ring all-reduce of S bytes on n nodes takes 2(n-1)/n * S / bandwidth + 2(n-1) * latency; DDP
sends every fp32 gradient each step (4 bytes a parameter, 2 with bf16); PowerSGD of rank r sends
(rows + columns) * r numbers for each matrix worth compressing (torch's min_compression_rate 2) and
the rest whole, in three rounds; DiLoCo sends every parameter once per dist.sync_every steps (in
dist.diloco_wire) and a few bytes each step; with dist.diloco_overlap=K the meeting crosses while K
steps compute, and only what K steps of compute do not cover is waited for. The compute of a step comes from this machine: a
matmul of the model's width timed here, at 6 N + 12 L d T FLOPs per token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from aura_hpc.config import RunConfig, embedding_rows

UNCERTAIN_SPREAD = 1.5
LONG_ENOUGH_S = 0.2  # a probe that takes less is mostly start-up costs: it grows, up to MAX_PROBE_MB
MAX_PROBE_MB = 64.0


@dataclass(frozen=True)
class Link:
    nodes: int
    bandwidth: float  # bytes/s one all-reduce moves (bus bandwidth)
    latency: float  # seconds, one hop of a tiny all-reduce
    spread: float = 1.0  # the fastest of the repeated timings over the slowest (1 = all equal)
    probe_mb: float = 0.0  # the size the bandwidth was measured with

    @property
    def uncertain(self) -> bool:
        """The repeated timings disagree by more than half: a busy link or machine."""
        return self.spread > UNCERTAIN_SPREAD

    @property
    def mbit(self) -> float:
        return self.bandwidth * 8 / 1e6

    def all_reduce_s(self, size: float, rounds: int = 1) -> float:
        n = self.nodes
        if n < 2:
            return 0.0
        return 2 * (n - 1) / n * size / self.bandwidth + rounds * 2 * (n - 1) * self.latency


@dataclass
class Option:
    name: str
    setting: str  # what to --set
    comm_s: float  # per step
    compute_s: float
    nodes: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def speedup(self) -> float:
        """Tokens/s of all the nodes over one node's (which does no communication)."""
        return self.nodes * self.compute_s / self.step_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s


def shapes(cfg: RunConfig, tokenizer_vocab: int) -> tuple[int, list[tuple[int, int]], int]:
    """(parameters, the 2-D matrices as (rows, columns), the numbers in vectors)."""
    m = cfg.model
    d, vocab = m.n_embd, embedding_rows(m, tokenizer_vocab)
    mats = [(vocab, d), (m.n_positions, d)]
    for _ in range(m.n_layer):
        mats += [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
    vectors = m.n_layer * (4 * d + 3 * d + d + 4 * d + d) + 2 * d  # 2 layer norms (w, b), 4 biases per block; ln_f
    return sum(r * c for r, c in mats) + vectors, mats, vectors


def options(cfg: RunConfig, tokenizer_vocab: int, link: Link, compute_s: float) -> list[Option]:
    n_params, mats, _ = shapes(cfg, tokenizer_vocab)
    d = cfg.dist
    r = d.powersgd_rank
    compressed = [(a, b) for a, b in mats if a * b >= 2 * (a + b) * r]  # PowerSGD's min_compression_rate of 2
    whole = n_params - sum(a * b for a, b in compressed)
    psgd = 4 * (sum((a + b) * r for a, b in compressed) + whole)
    flags = link.all_reduce_s(64)
    h = d.sync_every
    if d.diloco_wire == "int8":  # an all_gather: each node sends its codes and scales once around the ring
        sent = (link.nodes - 1) * n_params * (1 + 4 / 4096)
        meeting = sent / link.bandwidth + (link.nodes - 1) * link.latency if link.nodes > 1 else 0.0
    else:
        meeting = link.all_reduce_s((2 if d.diloco_wire == "bf16" else 4) * n_params)
    k = d.diloco_overlap

    def diloco(overlap: int) -> Option:
        """Meetings over `overlap` steps wait only for what that many steps of compute do not cover."""
        name = f"diloco (every {h} steps" + (f", meetings over {overlap} steps)" if overlap else ")")
        setting = f"dist.strategy=diloco --set dist.sync_every={h}" + (f" --set dist.diloco_overlap={overlap}" if overlap else "")
        return Option(name, setting, max(0.0, meeting - overlap * compute_s) / h + flags, compute_s, link.nodes)

    opts = [
        Option("ddp", "dist.strategy=ddp", link.all_reduce_s(4 * n_params), compute_s, link.nodes),
        Option("ddp + bf16", "dist.compress=bf16", link.all_reduce_s(2 * n_params) + flags, compute_s, link.nodes),
        Option(f"ddp + powersgd (rank {r})", "dist.compress=powersgd", link.all_reduce_s(psgd, rounds=3) + flags, compute_s, link.nodes),
        diloco(k),
    ]
    if not k and h > 1 and meeting > 0:
        # Enough steps to hide the meeting, but no more than a tenth of the interval: the outer step
        # lands that much later, which costs loss (bench_lan, 10 Mbit/s, sync_every=80: overlaps of
        # 8, 12 and 20 steps all ended 0.007-0.010 above one node at equal time, the waited-for 0.0075).
        opts.append(diloco(min(max(1, h // 10), max(1, math.ceil(meeting / max(compute_s, 1e-9))))))
    return opts


def recommend(opts: list[Option]) -> Option:
    """The fastest, except that exact DDP (or bf16 DDP, nearly exact) wins when within 10% of it."""
    best = max(opts, key=lambda o: o.speedup)
    for o in opts[:2]:
        if o.speedup >= 0.9 * best.speedup:
            return o
    return best


def advice(opts: list[Option], link: Link) -> str:
    ddp, pick = opts[0], recommend(opts)
    where = f"link {link.mbit:,.0f} Mbit/s, {1000 * link.latency:.1f} ms"
    if link.uncertain:
        where += f" (uncertain: three timings differed {link.spread:.1f}x; a busy link or machine, `check` measures longer)"
    if pick is ddp:
        return (
            f"{where}: DDP would spend {ddp.comm_share:.0%} of each step sending gradients; keep dist.strategy=ddp "
            f"(expected {ddp.speedup:.1f}x one node)"
        )
    return (
        f"{where}: DDP would spend {ddp.comm_share:.0%} of each step sending gradients ({ddp.speedup:.2f}x one node); "
        f"use --set {pick.setting} (expected {pick.speedup:.1f}x one node)"
    )


def compute_seconds(cfg: RunConfig, tokenizer_vocab: int, device: Any) -> float:
    """One rank's compute for one optimizer step, from a matmul of the model's width timed on `device`."""
    import torch

    t, m = cfg.train, cfg.model
    n_params, _, _ = shapes(cfg, tokenizer_vocab)
    tokens = t.batch_size * t.grad_accum * cfg.data.seq_len
    flops = (6 * n_params + 12 * m.n_layer * m.n_embd * cfg.data.seq_len) * tokens
    rows = min(tokens, 4096)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Constant operands: drawing them from the global RNG would move the streams a resumed run has just
    # restored from its checkpoint (rank 0's dropout would then differ from an uninterrupted run).
    a = torch.full((rows, m.n_embd), 0.5, device=device, dtype=dtype)
    b = torch.full((m.n_embd, 4 * m.n_embd), 0.25, device=device, dtype=dtype)
    a @ b  # warm-up
    reps = 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = reps * 2 * rows * m.n_embd * 4 * m.n_embd / max(time.perf_counter() - t0, 1e-9)
    # A training step reaches about half of a plain matmul's rate (layer norms, attention, the optimizer).
    return flops / (0.5 * rate)


def measure_link(nodes: int, group: Any = None, probe_mb: float = 1.0) -> Link:
    """Bandwidth and latency of the process group's link (every rank calls it). The tensors live on the
    group's device (NCCL takes no host tensor) and each timing waits for the device (on a GPU a
    collective returns once queued)."""
    import torch

    from aura_hpc.comm import collectives

    g = group or collectives.world()
    tiny = torch.zeros(2, device=g.device)
    collectives.all_reduce(tiny, g)  # connections and buffers

    def tiny_ones() -> None:
        for _ in range(10):
            collectives.all_reduce(tiny, g)

    per = collectives.timed(tiny_ones, g) / 10
    latency = per / max(1, 2 * (nodes - 1))
    if probe_mb <= 0:  # the latency alone
        return Link(nodes, 0.0, latency)

    def slowest(seconds: float) -> float:
        # Every rank must take the same next step: the decision follows the slowest rank's timing.
        return collectives.reduce_values([seconds], g, op="max")[0]

    # A probe too small to be timed (a 0.25 MB probe gave 528 Mbit/s where 64 MB gave 9,776 on one
    # machine) grows until it takes LONG_ENOUGH_S; then three timings, and their spread is reported.
    def timing(t: Any) -> float:
        return slowest(collectives.timed(lambda: collectives.all_reduce(t, g), g))

    size = probe_mb
    while True:
        big = torch.zeros(int(size * 2**20 / 4), device=g.device)
        collectives.all_reduce(big, g)
        took = timing(big)
        if took >= LONG_ENOUGH_S or size * 4 > MAX_PROBE_MB:
            break
        size *= 4
    times = sorted([took, timing(big), timing(big)])
    secs = max(times[1] - 2 * (nodes - 1) * latency, 1e-9)
    bandwidth = 2 * (nodes - 1) / nodes * big.numel() * 4 / secs
    return Link(nodes, bandwidth, latency, spread=times[-1] / max(times[0], 1e-9), probe_mb=size)
