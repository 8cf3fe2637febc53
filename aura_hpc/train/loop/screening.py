"""health.screen: the pre-flight screen (ops/screen.py) between the process group and the model, and what follows.

Every rank measures, every rank learns every figure (gather_json), rank 0 writes them to
RUN_DIR/screen/attempt-<N>.json and says them. A node named by the screen:
- on Slurm, where the partition can spare it (slurm/exclude.py answers through `why_not_leave_out`),
  is kept in RUN_DIR/excluded_nodes.json and every rank returns EXIT_SCREEN: the job's first task
  requeues the job without it, before any model is built;
- otherwise training goes on with it, with the line saying which node and why (under `local` no
  launcher can leave a machine out by itself).
health.screen=only stops after the screen: status 0, or EXIT_SCREEN when a node was named.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import RunConfig
from aura_hpc.errors import EXIT_SCREEN
from aura_hpc.ops import excluded_nodes, screen
from aura_hpc.train.process.dist_env import DistEnv

log = logging.getLogger("aura_hpc")

LeaveOut = Callable[[list[str]], str]  # why these nodes cannot be left out of a requeue ("" when they can)


def screen_nodes(cfg: RunConfig, env: DistEnv, device: torch.device, why_not_leave_out: LeaveOut | None, slow: float = 0.0) -> int | None:
    """An exit status when the run stops here, None when training goes on (`slow`: fault injection's idle share)."""
    h = cfg.health
    if h.screen == "skip":
        return None
    rows = _measured(device, env, slow)
    hosts = collectives.gather_json(env.hostname) if env.world_size > 1 else [env.hostname]
    expected = screen.Expected(
        h.screen_gemm_tflops, h.screen_allreduce_gbps, h.screen_inter_gbps, h.screen_min_fraction, h.screen_peer_fraction
    )
    findings, fabric, fabric_warning = screen.judge(rows, hosts, expected, cfg.slurm.cluster)
    if findings:
        # A second opinion before a node is named (every rank judged the same rows, so all measure again):
        # each figure the better of two, so that a moment of interference (another process on a shared
        # node, a clock ramping up) costs no node its place. A slow device is slow in both.
        rows = [screen.better(a, b) for a, b in zip(rows, _measured(device, env, slow), strict=True)]
        findings, fabric, fabric_warning = screen.judge(rows, hosts, expected, cfg.slurm.cluster)
    named = sorted({f.node for f in findings}, key=hosts.index)
    if env.is_main:
        _keep(cfg, env, rows, hosts, findings, fabric, fabric_warning)
        gemm = [float(r["gemm_tflops"]) for r in rows]
        nodes = len(set(hosts))
        log.info(
            "screen: %d device(s) on %d node(s): matmul %.3g to %.3g TFLOP/s%s (RUN_DIR/screen/)",
            len(rows),
            nodes,
            min(gemm),
            max(gemm),
            f"; {fabric}" if fabric else "",
        )
        if fabric_warning:
            log.warning("screen: %s", fabric_warning)
        for f in findings:
            log.warning("screen: %s", f.line)
    if not named:
        return 0 if h.screen == "only" else None
    if h.screen == "only":
        return EXIT_SCREEN
    why_not = "a local launch cannot leave a machine out by itself (fix: stop, then start again without it)"
    if env.is_main and why_not_leave_out is not None:
        why_not = why_not_leave_out(named)
    if env.world_size > 1:
        why_not = str(collectives.broadcast_json(why_not))
    if not why_not:
        if env.is_main:
            for node in named:
                why = "; ".join(f.line for f in findings if f.node == node)
                excluded_nodes.record(cfg.run_dir, node, f"failed screening: {why}")
            log.warning("screen: leaving out %s: the job is requeued without it before any model is built", ", ".join(named))
        return EXIT_SCREEN
    if env.is_main:
        log.warning("screen: training goes on with %s: %s", ", ".join(named), why_not)
    return None


def _measured(device: torch.device, env: DistEnv, slow: float) -> list[dict[str, Any]]:
    """Every rank's figures, on every rank."""
    row = screen.measure(device, env.node_ranks, env.rank, slow)
    return collectives.gather_json(row) if env.world_size > 1 else [row]


def _keep(
    cfg: RunConfig, env: DistEnv, rows: list[dict], hosts: list[str], findings: list[screen.Finding], fabric: str, warning: str
) -> None:
    folder = cfg.run_dir / "screen"
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "attempt": env.restart_count,
        "devices": [{**r, "host": hosts[i]} for i, r in enumerate(rows)],
        "findings": [{"node": f.node, "line": f.line} for f in findings],
        "fabric": fabric,
        "fabric_warning": warning,
        "expected": {
            "gemm_tflops": cfg.health.screen_gemm_tflops,
            "allreduce_gbps": cfg.health.screen_allreduce_gbps,
            "inter_gbps": cfg.health.screen_inter_gbps,
            "min_fraction": cfg.health.screen_min_fraction,
            "relative": cfg.health.screen_peer_fraction,
        },
    }
    path = folder / f"attempt-{env.restart_count}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    os.replace(tmp, path)
