"""Every collective aura_hpc makes, in one place (tests/test_architecture.py forbids them elsewhere).

A group knows the device its tensors live on: NCCL takes device tensors only ("No backend type
associated with device type cpu"), gloo host ones. Each call checks its tensors against that
device before anything is sent, so a host tensor on a GPU run fails here, with its name, instead
of inside NCCL. Timings wait for the device (`timed`). Nothing received is unpickled: objects cross
as JSON in uint8 tensors, bounded in size, and only JSON values (str, numbers, bools, None, lists,
dicts) come out.

Probes (train/instruments/probes.py) watch every call through `observers`; `sent` counts the bytes handed to
each named group (what a DiLoCo meeting puts on the slow link, per node).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_JSON_BYTES = 64 << 20  # what one rank may send as an object (a checkpoint's names, hashes, settings)
MAX_BYTES = 16 << 30  # a byte payload (a checkpoint sent to ranks without shared storage)
CHUNK_BYTES = 64 << 20  # what of it crosses at once


@dataclass(frozen=True)
class Group:
    """A process group (None: the default one), the device its collectives take, and a name for counting.
    `host_only`: a gloo group that carries host tensors by design (background checkpoint coordination),
    kept apart from training's groups, which are NCCL on GPUs."""

    name: str
    device: torch.device
    pg: Any = None
    host_only: bool = False

    @property
    def size(self) -> int:
        return dist.get_world_size(self.pg) if active() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.pg) if active() else 0


Observer = Callable[[str, list[torch.Tensor], Group], None]
observers: list[Observer] = []
sent: Counter[str] = Counter()  # bytes handed to collectives, per group name
_world: Group | None = None
# The world's collective timeout (dist.timeout_s): torch gives a group made without one its backend's default
# (NCCL 10 min, gloo 30), not the world's, so a changed dist.timeout_s would not reach DiLoCo's groups.
_timeout: timedelta | None = None
GLOO_DEFAULT = timedelta(minutes=30)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def set_world(device: torch.device, timeout: timedelta | None = None) -> Group:
    """The default group, once the process group is up: its collectives take tensors on `device`; the
    groups made after it wait `timeout` (the world's) for a collective, as the world does."""
    global _world, _timeout
    _timeout = timeout
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" names the current one: compare by index
        device = torch.device("cuda", torch.cuda.current_device())
    _world = Group("world", device)
    return _world


def world() -> Group:
    return _world if _world is not None else Group("world", torch.device("cpu"))


def backend(group: Group | None = None) -> str:
    g = group or world()
    return str(dist.get_backend(g.pg)) if active() else "none"


def new_group(name: str, ranks: list[int] | None = None, host_only: bool = False) -> Group:
    """A group of `ranks` (every rank, if None) made collectively: every rank of the world calls this,
    in the same order. host_only: a gloo group for host tensors beside a device world."""
    if host_only and ranks is not None and active() and len(set(ranks)) < dist.get_world_size():
        # On an NCCL world the ranks outside a new group split the world's communicator whatever the group's
        # backend, and a gloo group's members never do: those outside would wait there for ever.
        raise ValueError(f"a host-only group is made over every rank, not {ranks}")
    # A host-only group waits 30 min at least (gloo's own): its gathers wait for other ranks' background disk writes.
    timeout = max(_timeout or GLOO_DEFAULT, GLOO_DEFAULT) if host_only else _timeout
    pg = dist.new_group(ranks, timeout=timeout, backend="gloo" if host_only else None)
    return Group(name, torch.device("cpu") if host_only else world().device, pg, host_only)


def split(name: str, partition: list[list[int]]) -> Group | None:
    """This rank's group among `partition` (lists of ranks covering the world, each made by every rank
    in order); None when this rank's part has one member (nothing to reduce)."""
    mine = None
    rank = dist.get_rank() if active() else 0
    for ranks in partition:
        if len(ranks) < 2 or not active():  # every rank skips the same parts: the calls stay in step
            continue
        g = new_group(name, ranks)  # on NCCL each is a split of the whole world's communicator
        if rank in ranks:
            mine = g
    return mine


def _check(op: str, tensors: list[torch.Tensor], group: Group) -> None:
    for t in tensors:
        if t.device != group.device:
            raise RuntimeError(
                f"{op} on group '{group.name}' got a tensor on {t.device}; its collectives take tensors on {group.device} "
                "(a bug in aura_hpc: the tensor must be made there)"
            )
    sent[group.name] += sum(t.numel() * t.element_size() for t in tensors)
    for observe in observers:
        observe(op, tensors, group)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, group: Group | None = None, op: str = "sum", async_op: bool = False) -> Any:
    g = group or world()
    _check("all_reduce", [t], g)
    if not active():
        return _Done() if async_op else None
    return dist.all_reduce(t, op=_OPS[op], group=g.pg, async_op=async_op)


def all_gather(outs: list[torch.Tensor], t: torch.Tensor, group: Group | None = None, async_op: bool = False) -> Any:
    g = group or world()
    _check("all_gather", [t], g)
    if not active():
        outs[0].copy_(t)
        return _Done() if async_op else None
    for o in outs:
        if o.device != g.device:
            raise RuntimeError(f"all_gather on group '{g.name}' got an output on {o.device}, not {g.device} (a bug in aura_hpc)")
    return dist.all_gather(outs, t, group=g.pg, async_op=async_op)


def broadcast(t: torch.Tensor, src: int = 0, group: Group | None = None) -> None:
    """From group rank `src` to the group."""
    g = group or world()
    _check("broadcast", [t], g)
    if active():
        dist.broadcast(t, src=dist.get_global_rank(g.pg, src) if g.pg is not None else src, group=g.pg)


def barrier(group: Group | None = None) -> None:
    """Every rank of the group got here: a tiny all-reduce on the group's device, read back, so the host
    waits too (on NCCL a collective only makes the device stream wait; a rank that went on to tear its
    communicator down would fail the others still in it)."""
    g = group or world()
    if active():
        t = torch.zeros(1, device=g.device)
        all_reduce(t, g)
        t.item()


def send(pg: Any, t: torch.Tensor, peer: int, tag: int) -> Any:
    """Point to point on a pair group of the parameter server (gloo, host tensors): the queued Work."""
    _check("send", [t], Group("pair", torch.device("cpu"), pg, host_only=True))
    return pg.send([t], peer, tag)


def recv(pg: Any, t: torch.Tensor, peer: int, tag: int) -> Any:
    _check("recv", [t], Group("pair", torch.device("cpu"), pg, host_only=True))
    return pg.recv([t], peer, tag)


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# ---- values and objects ------------------------------------------------------------------


def reduce_values(values: list[float], group: Group | None = None, op: str = "sum") -> list[float]:
    """Host numbers reduced over the group (made on its device; reading them back waits for it)."""
    g = group or world()
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=g.device)
    all_reduce(t, g, op)
    return [float(v) for v in t.tolist()]


def flags(mine: bool, group: Group | None = None) -> list[bool]:
    """Every rank's yes/no, in rank order."""
    return [bool(v) for v in gather_json(bool(mine), group)]


def _encode(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"an object of {len(data)} bytes is too large to send between ranks")
    return data


def _decode(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"))


def gather_json(obj: Any, group: Group | None = None) -> list[Any]:
    """Every rank's `obj` (JSON values only), in rank order."""
    g = group or world()
    if not active() or g.size == 1:
        return [_decode(_encode(obj))]
    mine = _encode(obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device=g.device) for _ in range(g.size)]
    all_gather(sizes, torch.full((1,), len(mine), dtype=torch.int64, device=g.device), g)
    lengths = [int(n) for n in torch.cat(sizes).tolist()]  # one read back, not one per rank
    if max(lengths) > MAX_JSON_BYTES or min(lengths) < 0:
        raise ValueError(f"a rank announced an object of {max(lengths)} bytes (at most {MAX_JSON_BYTES})")
    width = max(lengths)
    buf = torch.zeros(width, dtype=torch.uint8, device=g.device)
    _fill(buf, mine)
    outs = [torch.empty(width, dtype=torch.uint8, device=g.device) for _ in range(g.size)]
    all_gather(outs, buf, g)
    host = torch.stack(outs).cpu().numpy()
    return [_decode(host[r, :n].tobytes()) for r, n in enumerate(lengths)]


def _fill(buf: torch.Tensor, data: bytes) -> None:
    """Host bytes copied into a buffer on the group's device (the collective takes the buffer, made there)."""
    if data:
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def broadcast_bytes(data: bytes | None, src: int = 0, group: Group | None = None, limit: int = MAX_BYTES) -> bytes:
    """Rank `src`'s bytes on every rank of the group (the others pass None)."""
    g = group or world()
    if not active() or g.size == 1:
        return data or b""
    size = torch.full((1,), len(data) if g.rank == src and data is not None else 0, dtype=torch.int64, device=g.device)
    broadcast(size, src, g)
    n = int(size.item())
    if not 0 <= n <= limit:
        raise ValueError(f"rank {src} announced {n} bytes (at most {limit})")
    # In chunks through one buffer on the group's device: a checkpoint never sits whole on a GPU.
    buf = torch.empty(min(n, CHUNK_BYTES), dtype=torch.uint8, device=g.device)
    out = bytearray(n)
    view = memoryview(data or b"")
    for start in range(0, n, CHUNK_BYTES):
        end = min(n, start + CHUNK_BYTES)
        part = buf[: end - start]
        if g.rank == src:
            _fill(part, bytes(view[start:end]))
        broadcast(part, src, g)
        out[start:end] = part.cpu().numpy().tobytes()
    return bytes(out)


def broadcast_json(obj: Any, src: int = 0, group: Group | None = None) -> Any:
    """Rank `src`'s `obj` (JSON values only) on every rank of the group."""
    g = group or world()
    if not active() or g.size == 1:
        return _decode(_encode(obj))
    return _decode(broadcast_bytes(_encode(obj) if g.rank == src else None, src, g, MAX_JSON_BYTES))


# ---- time --------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work: Callable[[], Any], group: Group | None = None) -> float:
    """Seconds `work` (collectives on `group`) takes, the device drained before and after: on a GPU
    a collective returns once it is queued, not done."""
    g = group or world()
    synchronize(g.device)
    t0 = time.perf_counter()
    result = work()
    if result is not None and hasattr(result, "wait"):
        result.wait()
    synchronize(g.device)
    return time.perf_counter() - t0
