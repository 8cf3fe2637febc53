"""Pre-flight screening: every GPU's matmul throughput and the all-reduce bus bandwidth, before training.

A slow or broken GPU is otherwise found, if ever, by a run's speed. Each rank times square matmuls on
its device (bf16 on a GPU: an H100 SXM reaches ~790 of its 989 dense TFLOP/s), each node times an
all-reduce among its own ranks (NVLink), and the whole job one among all ranks (the fabric), as bus
bandwidth (NCCL-tests' definition: bytes/time x 2(n-1)/n). A figure is judged twice:
- against what the cluster profile expects (`#AURA screen_gemm_tflops=790`, `screen_allreduce_gbps=440`,
  `screen_inter_gbps=370`, copied into health.screen_* by `submit`): below health.screen_min_fraction
  of it is a finding;
- against its peers: a GPU or a node under health.screen_peer_fraction (0.75) of the others' median is a
  finding (this is all the `generic` profile and CPU runs have: their absolute figures mean nothing).
A finding names its node; the fabric figure names none (a slow all-reduce across nodes cannot say
whose link is slow), so it is only said.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from aura_hpc.comm import collectives

RELATIVE = 0.75  # below this share of the peers' median, a GPU or a node is named (as for stragglers)


@dataclass
class Expected:
    gemm_tflops: float = 0.0  # per GPU; 0: unknown (relative judgement only)
    allreduce_gbps: float = 0.0  # bus bandwidth within a node
    inter_gbps: float = 0.0  # bus bandwidth across the job's nodes
    fraction: float = 0.8  # a figure under this share of the expected one is a finding
    peer_fraction: float = RELATIVE  # a figure under this share of its peers' median is a finding


def gemm_tflops(device: torch.device, min_s: float, slow_fraction: float = 0.0) -> float:
    """Dense matmul throughput of this device (bf16 on a GPU, fp32 on CPU), in TFLOP/s: the best of several
    windows, so that a moment of interference (another process, a clock ramping up) does not name a node."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 256
    dtype = torch.bfloat16 if cuda else torch.float32
    # Random operands (constant ones draw less power, and would hide a power-capped GPU), from a generator of
    # its own: nothing is drawn from the ones a resumed run relies on.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), device=device, generator=gen).to(dtype)
    b = torch.randn((n, n), device=device, generator=gen).to(dtype)
    torch.mm(a, b)  # warm-up: kernel choice, first allocation
    collectives.synchronize(device)
    best, windows = 0.0, 5 if cuda else 24  # a CPU shares its cores: many short windows, some of them uninterrupted
    for _ in range(windows):
        done, t0 = 0, time.perf_counter()
        while True:
            began = time.perf_counter()
            for _ in range(10 if cuda else 1):
                torch.mm(a, b)
                done += 1
            collectives.synchronize(device)
            if slow_fraction > 0:  # fault injection: a device that idles this share of its time
                time.sleep((time.perf_counter() - began) * slow_fraction / (1 - slow_fraction))
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s / windows:
                break
        best = max(best, 2 * n**3 * done / elapsed / 1e12)
    return best


def allreduce_gbps(group: collectives.Group, nbytes: int, rounds: int) -> float:
    """Bus bandwidth of an all-reduce of `nbytes` on `group`, in GB/s (the best of `rounds`)."""
    n = group.size
    t = torch.ones(max(1, nbytes // 4), device=group.device, dtype=torch.float32)
    collectives.all_reduce(t, group)  # warm-up: connections, buffers
    best = min(collectives.timed(lambda: collectives.all_reduce(t, group), group) for _ in range(rounds))
    return t.numel() * 4 / best * 2 * (n - 1) / n / 1e9


_node_groups: dict[tuple[tuple[int, ...], ...], collectives.Group | None] = {}


def measure(device: torch.device, node_ranks: list[list[int]], rank: int, slow_fraction: float = 0.0) -> dict[str, Any]:
    """This rank's figures; every rank calls it (the all-reduces are collective)."""
    cuda = device.type == "cuda"
    if cuda or all(len(ranks) == 1 for ranks in node_ranks):
        tflops = gemm_tflops(device, 0.5 if cuda else 0.6, slow_fraction)
    else:
        # A CPU node's ranks share its cores: timed together they measure the scheduler's split of those
        # cores (0.70 x between two clean ranks of one busy 2-core machine), not a device. Each rank of a
        # node takes its turn while the others wait in the barrier; the nodes still measure side by side.
        mine = next(ranks.index(rank) for ranks in node_ranks if rank in ranks)
        tflops = 0.0
        for turn in range(max(len(ranks) for ranks in node_ranks)):
            if turn == mine:
                tflops = gemm_tflops(device, 0.6, slow_fraction)
            collectives.barrier()
    row: dict[str, Any] = {"rank": rank, "gemm_tflops": round(tflops, 4)}
    nbytes, rounds = (256 << 20, 5) if cuda else (4 << 20, 3)
    if any(len(ranks) > 1 for ranks in node_ranks):
        # Every rank takes part in making every node's group (once: each NCCL group holds device memory until the
        # world ends, and a screen with findings measures twice); each times its own node's.
        key = tuple(tuple(ranks) for ranks in node_ranks)
        if key not in _node_groups:
            _node_groups[key] = collectives.split("screen-node", node_ranks)
        node_group = _node_groups[key]
        if node_group is not None:
            row["node_gbps"] = round(allreduce_gbps(node_group, nbytes, rounds), 3)
    if len(node_ranks) > 1:
        row["job_gbps"] = round(allreduce_gbps(collectives.world(), nbytes, rounds), 3)
    return row


def better(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One device's two measurements as one row: each figure the better of the two."""
    return {k: max(v, second.get(k, v)) if k.endswith(("_tflops", "_gbps")) else v for k, v in first.items()}


@dataclass
class Finding:
    node: str
    line: str


def judge(rows: list[dict[str, Any]], hosts: list[str], expected: Expected, profile: str) -> tuple[list[Finding], str, str]:
    """(the nodes to leave out with why, the fabric's figure, a warning about the fabric or "")."""
    findings: list[Finding] = []
    gemm = [float(r["gemm_tflops"]) for r in rows]
    for r, mine in enumerate(gemm):
        why = _below(mine, [g for i, g in enumerate(gemm) if i != r], expected.gemm_tflops, expected, profile, "devices'")
        if why:
            findings.append(Finding(hosts[r], f"rank {r} on {hosts[r]}: matmul {mine:.3g} TFLOP/s, {why}"))
    nodes = sorted(set(hosts), key=hosts.index)
    per_node: dict[str, float] = {}
    for i, r in enumerate(rows):  # each rank of a node timed the same all-reduce: the best view, least skewed by the others
        if "node_gbps" in r:
            per_node[hosts[i]] = max(per_node.get(hosts[i], 0.0), float(r["node_gbps"]))
    for h, mine in per_node.items():
        others = [v for k, v in per_node.items() if k != h]
        why = _below(mine, others, expected.allreduce_gbps, expected, profile, "nodes'")
        if why:
            findings.append(Finding(h, f"{h}: all-reduce within the node {mine:.3g} GB/s bus bandwidth, {why}"))
    job = [float(r["job_gbps"]) for r in rows if "job_gbps" in r]
    if not job:
        return findings, "", ""
    figure = max(job)  # each rank timed the same all-reduce from its own arrival: the best view, least skewed
    line = f"all-reduce across the {len(nodes)} nodes {figure:.3g} GB/s bus bandwidth"
    warning = ""
    if expected.inter_gbps and figure < expected.fraction * expected.inter_gbps:
        warning = (
            f"the fabric is slow: {figure:.3g} GB/s is under {expected.fraction:g} x the {expected.inter_gbps:g} that profile "
            f"{profile} expects, and no one node can be named from it (fix: `check` between pairs of nodes, and the "
            "profile's NCCL variables)"
        )
    return findings, line, warning


def _below(mine: float, others: list[float], figure: float, expected: Expected, profile: str, whose: str) -> str:
    why = []
    if figure and mine < expected.fraction * figure:
        why.append(f"under {expected.fraction:g} x the {figure:g} that profile {profile} expects")
    if others and mine < expected.peer_fraction * statistics.median(others):
        why.append(f"under {expected.peer_fraction:g} x the other {whose} median {statistics.median(others):.3g}")
    return " and ".join(why)
