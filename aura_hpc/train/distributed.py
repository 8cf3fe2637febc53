"""Process-group set-up and the few collectives the trainer needs."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aura_hpc.errors import LaunchError
from aura_hpc.train.dist_env import DistEnv

log = logging.getLogger("aura_hpc")


def pick_device(env: DistEnv, backend: str) -> torch.device:
    if (backend == "nccl" or (backend == "auto" and torch.cuda.is_available())) and torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _tcp_store(env: DistEnv, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store: the agent's under torchrun, else one that rank 0 hosts. Created once per process."""
    is_master = env.rank == 0 and not env.uses_agent_store
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=is_master,
        timeout=timeout,
        wait_for_workers=False,
        use_libuv=os.environ.get("TORCH_DISTRIBUTED_USE_LIBUV", "1") != "0",
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def init_process_group(env: DistEnv, backend: str, device: torch.device, init_timeout_s: int, timeout_s: int) -> str:
    """Initialise the default group; returns the backend in use.

    With dist.backend=auto on GPUs, NCCL that cannot start on some rank makes every rank fall
    back to gloo together (logged as fallback=gloo); with dist.backend=nccl it is an error, never
    a silent switch. The fallback reuses the same store: a second TCPStore on the master port
    would fail with EADDRINUSE (seen under Slurm).
    """
    wanted = backend
    if backend == "auto":
        wanted = "nccl" if device.type == "cuda" else "gloo"
    tcp = _tcp_store(env, timedelta(seconds=init_timeout_s))
    global _AGREE
    _AGREE = (tcp, f"aura/attempt{env.restart_count}/agree", env.rank, env.world_size)
    # Under the elastic agent, workers share the agent's TCPStore across restarts. Without a
    # per-attempt prefix, restarted workers read the previous attempt's gloo addresses and fail
    # ("connectFullMesh ... Connection refused") or hang (measured 3/3 runs on this platform).
    attempt = f"aura/attempt{env.restart_count}"
    timeout = timedelta(seconds=timeout_s)
    if wanted != "nccl":
        dist.init_process_group(wanted, store=dist.PrefixStore(attempt, tcp), rank=env.rank, world_size=env.world_size, timeout=timeout)
        return wanted
    error = ""
    try:
        dist.init_process_group(
            "nccl", store=dist.PrefixStore(attempt, tcp), rank=env.rank, world_size=env.world_size, timeout=timeout, device_id=device
        )
    except Exception as exc:
        error = _first_line(exc)
    # Every rank learns every rank's outcome, so that all fall back together or none does.
    tcp.set(f"{attempt}/nccl/{env.rank}", error or "ok")
    outcomes = [tcp.get(f"{attempt}/nccl/{r}").decode() for r in range(env.world_size)]
    failed = {r: o for r, o in enumerate(outcomes) if o != "ok"}
    if not failed:
        # NCCL connects lazily on some releases; one collective makes a broken fabric show up here.
        dist.all_reduce(torch.ones(1, device=device))
        return "nccl"
    first_rank, why = next(iter(failed.items()))
    if backend == "nccl":
        raise LaunchError(
            f"NCCL could not start on rank(s) {sorted(failed)} (rank {first_rank}: {why}) and dist.backend=nccl does not fall "
            "back to gloo (fix: `python -m aura_hpc check` on these nodes; NCCL_SOCKET_IFNAME / InfiniBand settings in the "
            "cluster profile; or --set dist.backend=auto to allow a gloo fallback)"
        )
    if env.is_main:
        log.warning("NCCL could not start on rank(s) %s (rank %d: %s); fallback=gloo", sorted(failed), first_rank, why)
    if dist.is_initialized():
        dist.destroy_process_group()
    fallback = dist.PrefixStore(f"{attempt}/gloo-fallback", tcp)
    dist.init_process_group("gloo", store=fallback, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return "gloo"


_AGREE: tuple[Any, str, int, int] | None = None  # the store, a per-attempt prefix, rank, world size


def agree(topic: str, problem: str, patience_s: float, waiting: str = "") -> list[str]:
    """Every rank's problem with `topic` ("" = none), once all ranks have said: the ranks decide
    together without a collective, so a rank that takes long (fetching data) never runs another
    into the collective timeout. Waits at most `patience_s` for the others (logging `waiting`)."""
    if _AGREE is None or not active():
        return [problem] if problem else []
    store, prefix, rank, world = _AGREE
    store.set(f"{prefix}/{topic}/{rank}", problem or "ok")
    keys = [f"{prefix}/{topic}/{r}" for r in range(world)]
    start = last_note = time.monotonic()
    while not store.check(keys):
        now = time.monotonic()
        if now - start > patience_s:
            return [f"ranks did not all report on {topic} within {patience_s:.0f} s"]
        if waiting and now - last_note > 30:
            log.info("%s (%.0f s so far)", waiting, now - start)
            last_note = now
        time.sleep(0.05)
    answers = [store.get(k).decode() for k in keys]
    return [f"rank {r}: {a}" for r, a in enumerate(answers) if a != "ok"]


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
        # gloo's worker thread frees finished work (and the Python tensors it holds) right after
        # completing it; destroying the group while it still must, with the GIL held here,
        # deadlocks torch < 2.8 (seen on 2.6: ~2 runs in 8). A short GIL-free pause lets it finish.
        time.sleep(0.1)
        dist.destroy_process_group()
