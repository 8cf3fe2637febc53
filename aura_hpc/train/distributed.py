"""Process-group set-up and the few collectives the trainer needs."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aura_hpc.train.dist_env import DistEnv

log = logging.getLogger("aura_hpc")


def pick_device(env: DistEnv, backend: str) -> torch.device:
    if (backend == "nccl" or (backend == "auto" and torch.cuda.is_available())) and torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """A per-attempt view of the rendezvous store.

    Under the elastic agent, workers share the agent's TCPStore across restarts. Without a
    per-attempt prefix, restarted workers read the previous attempt's gloo addresses and fail
    ("connectFullMesh ... Connection refused") or hang (measured 3/3 runs on this platform).
    """
    is_master = env.rank == 0 and not env.uses_agent_store
    tcp = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=is_master,
        timeout=timeout,
        wait_for_workers=False,
        use_libuv=os.environ.get("TORCH_DISTRIBUTED_USE_LIBUV", "1") != "0",
    )
    return dist.PrefixStore(f"aura/attempt{env.restart_count}", tcp)


def init_process_group(env: DistEnv, backend: str, device: torch.device, init_timeout_s: int, timeout_s: int) -> str:
    """Initialise the default group; NCCL falls back to gloo (logged) when it cannot start."""
    wanted = backend
    if backend == "auto":
        wanted = "nccl" if device.type == "cuda" else "gloo"
    store = _store(env, timedelta(seconds=init_timeout_s))
    try:
        dist.init_process_group(
            wanted,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if wanted == "nccl" else None,
        )
        if wanted == "nccl":
            # NCCL initialises lazily; force a collective so a broken fabric shows up here.
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
        return wanted
    except Exception as exc:
        if wanted != "nccl":
            raise
        log.warning("NCCL init failed (%s); fallback=gloo", str(exc).splitlines()[0] if str(exc) else exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.PrefixStore("gloo-fallback", _store(env, timedelta(seconds=init_timeout_s)))
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
        return "gloo"


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_object(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown() -> None:
    if active():
        dist.destroy_process_group()
