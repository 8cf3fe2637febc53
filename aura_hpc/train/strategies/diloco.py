"""DiLoCo (Douillard et al. 2023): replicas train apart and meet every `dist.sync_every` steps.

Each replica (by default one per node; the GPUs of a node train it together with DDP) runs its
own AdamW on its own slice of the global sample order. Every `sync_every` steps the replicas
average their parameter deltas since the last meeting (one all-reduce in `dist.diloco_wire`
bf16 or fp32, or an all_gather of int8 codes with a scale per block) and apply the average with an outer Nesterov SGD (`dist.outer_lr`,
`dist.outer_momentum`; the paper's 0.7 and 0.9): anchor <- anchor - lr * nesterov(mean(anchor - theta)),
and every replica starts the next interval from the new anchor. Between meetings only a few
bytes cross the network each step (the flags every rank agrees on: stop, GPU fault, bad loss),
so a slow link costs one all-reduce per interval instead of one per step.

With `dist.diloco_overlap=K` a meeting does not stop the replicas: its bytes go out in K pieces,
one per inner step, while the replicas go on training (a piece a step keeps the link's queue short,
so the per-step flags are not stuck behind a bulk transfer), and K steps later the outer step lands
with each replica's progress since the meeting kept: theta <- new anchor + (theta - theta at the
meeting). This is the overlapped variant of Streaming DiLoCo (Douillard et al. 2025) for the whole
model at once.

State beyond DDP's: the anchor (the global model at the last meeting) and the outer momentum,
the same on every rank (saved by rank 0), and each replica's inner weights and AdamW moments
(saved by each rank in its own run directory, train/checkpointing.py), so a resume between
meetings continues exactly, also on LAN machines without shared storage. A meeting in flight is
saved with them (what this rank sent, the pieces already received, the weights it was sent from),
and a resume sends the missing pieces again: the results depend only on what every rank sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from aura_hpc.config import DistConfig
from aura_hpc.errors import ConfigError
from aura_hpc.train.strategies.base import Wrapped

WIRE = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.float32}  # int8: quantized from fp32
INT8_BLOCK = 4096  # values sharing one fp32 scale in the int8 wire format (0.1% overhead)


def quantize_int8(flat: torch.Tensor) -> torch.Tensor:
    """fp32 values -> one uint8 buffer: int8 codes (round to nearest, a symmetric scale per block of
    INT8_BLOCK values) followed by the blocks' fp32 scales. Deterministic: every replica decodes it
    to the same numbers."""
    n = flat.numel()
    pad = (-n) % INT8_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    codes = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes.view(-1).view(torch.uint8), scale.view(torch.uint8)])


def dequantize_int8(buf: torch.Tensor, n: int) -> torch.Tensor:
    blocks = (n + INT8_BLOCK - 1) // INT8_BLOCK
    codes = buf[: blocks * INT8_BLOCK].view(torch.int8).view(blocks, INT8_BLOCK).to(torch.float32)
    scale = buf[blocks * INT8_BLOCK :].view(torch.float32)
    return (codes * scale[:, None]).view(-1)[:n]


# A meeting crosses in slices of at most this size, so a slow link's queue never holds more than one.
# Both replicas send at once, so each one's acknowledgements wait behind the other's data in a shaped
# (or bloated Wi-Fi) queue: at 10 Mbit/s (bench_lan's tbf link) 3.5 MB took 3.05 s in 32 KiB slices,
# 3.9 s in 64 KiB, 4.3-4.5 s in 256 KiB or in one piece (the line rate's 2.8 s); at 1 Gbit/s 32 KiB
# slices cost 0.15 s against 0.07 s, a price paid once per meeting.
SLICE_BYTES = 32 * 1024
MAX_PIECES = 1024  # a waited-for meeting's pieces, one after the other (beyond 32 MB they grow, in slices)


def blocking_pieces(payload: torch.Tensor) -> int:
    size = payload.numel() * payload.element_size()
    return max(1, min(MAX_PIECES, -(-size // SLICE_BYTES)))


class Meeting:
    """A meeting in flight: this rank's payload (int8 codes and scales, or wire-dtype deltas) crossing
    in `pieces` pieces, one per step, into `out` (every replica's payload for int8's all_gather; the
    sum for an all-reduce). A piece goes as collectives of at most SLICE_BYTES, issued together; their
    bounds depend only on the sizes, so every run (and every resume) adds the same numbers. Pieces
    before `done` have arrived."""

    def __init__(
        self, since: int, pieces: int, mine: torch.Tensor, sent_from: list[torch.Tensor], group: Any, replicas: int, int8: bool
    ) -> None:
        self.since, self.pieces, self.mine, self.sent_from = since, pieces, mine, sent_from
        self.group, self.int8 = group, int8
        self.out = [torch.empty_like(mine) for _ in range(replicas)] if int8 else [torch.empty_like(mine)]
        self.piece = -(-mine.numel() // pieces)
        self.done = 0
        self.work: list[Any] | None = None  # the piece in flight's collectives (none for an empty last piece)

    def send_next(self) -> None:
        self.work = []
        end = min(self.mine.numel(), (self.done + 1) * self.piece)
        step = max(1, SLICE_BYTES // self.mine.element_size())
        for start in range(self.done * self.piece, end, step):
            sl = slice(start, min(end, start + step))
            if self.int8:
                self.work.append(dist.all_gather([o[sl] for o in self.out], self.mine[sl], group=self.group, async_op=True))
            else:
                self.out[0][sl].copy_(self.mine[sl])
                self.work.append(dist.all_reduce(self.out[0][sl], group=self.group, async_op=True))

    def arrived(self) -> bool:
        """Wait for the piece in flight; True once every piece is here."""
        if self.work is not None:
            for w in self.work:
                w.wait()
            self.work = None
            self.done += 1
        return self.done >= self.pieces

    def finish(self) -> None:
        """The remaining pieces, one after the other."""
        while not self.arrived():
            self.send_next()

    def state(self) -> dict[str, Any]:
        end = min(self.mine.numel(), self.done * self.piece)
        return {
            "since": self.since,
            "pieces": self.pieces,
            "done": self.done,
            "mine": self.mine,
            "sent_from": list(self.sent_from),
            "arrived": [o[:end] for o in self.out],  # not the piece in flight: it is being written
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], group: Any, replicas: int, int8: bool, device: torch.device) -> Meeting:
        sent_from = [t.to(device, copy=True) for t in state["sent_from"]]
        m = cls(int(state["since"]), int(state["pieces"]), state["mine"].to(device, copy=True), sent_from, group, replicas, int8)
        m.done = int(state["done"])
        for o, saved in zip(m.out, state["arrived"], strict=True):
            o[: saved.numel()].copy_(saved)
        return m


def replica_groups(world: int, local_world: int, replicas: int) -> tuple[list[list[int]], list[list[int]]]:
    """(inner groups, outer groups): ranks that train one replica together, and the ranks (one per
    replica, same position) whose deltas are averaged. Ranks are numbered node by node."""
    per = world // replicas if replicas else local_world
    inner = [list(range(start, start + per)) for start in range(0, world, per)]
    outer = [list(range(i, world, per)) for i in range(per)]
    return inner, outer


class DilocoWrapped(Wrapped):
    name = "diloco"

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, cfg: DistConfig, outer_group: Any, inner_size: int) -> None:
        super().__init__(module, model)
        self.sync_every, self.outer_group, self.inner_size = cfg.sync_every, outer_group, inner_size
        self.replicas = dist.get_world_size(outer_group) if outer_group is not None else 1
        self.wire = WIRE[cfg.diloco_wire]
        self.int8 = cfg.diloco_wire == "int8"
        self.params = [p for p in model.parameters()]
        self.anchor = [p.detach().to(torch.float32, copy=True) for p in self.params]
        for a in self.anchor:
            a.grad = torch.zeros_like(a)
        self.outer = torch.optim.SGD(self.anchor, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)
        self._flat = torch.empty(sum(p.numel() for p in self.params), dtype=self.wire, device=self.params[0].device)
        self.syncs = 0
        self.overlap = cfg.diloco_overlap if self.replicas > 1 else 0
        self.meeting: Meeting | None = None

    @contextlib.contextmanager
    def accumulating(self, sync: bool) -> Iterator[None]:
        """Within a replica of several GPUs, no gradient all-reduce on micro-steps that are not the last."""
        no_sync = getattr(self.module, "no_sync", None)
        if sync or no_sync is None:
            yield
            return
        with no_sync():
            yield

    def replica_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        state = {"model": {k: v for k, v in self.model.state_dict().items()}, "optimizer": optimizer.state_dict()}
        if self.meeting is not None:
            state["meeting"] = self.meeting.state()
        return state

    def after_update(self, step: int) -> None:
        """At every sync_every-th step: average the deltas over the replicas, take the outer step, and
        restart every replica from the new anchor. At the last step the replicas meet whatever
        sync_every, and end on their mean: the final checkpoint holds every replica's work, not rank
        0's alone, and no outer momentum extrapolates past it once training is over (bench_lan's model,
        sync_every=60, int8, 200 steps: eval loss 1.569 on the mean, 1.664 after a Nesterov step, 1.576 on rank 0's replica)."""
        last = step == self.last_step
        if self.meeting is not None and (self.meeting.arrived() or last):
            self.meeting.finish()  # the last step: the rest of the pieces now
            self._land(self.meeting)
        elif self.meeting is not None:
            self.meeting.send_next()
        if step % self.sync_every and not last:
            return
        with torch.no_grad():
            deltas = torch._foreach_sub(self.anchor, [p.to(torch.float32) for p in self.params])
            offset = 0
            for d in deltas:  # one flat buffer: one all-reduce, in the wire dtype
                n = d.numel()
                self._flat[offset : offset + n].copy_(d.view(-1))
                offset += n
            if self.overlap and not last:
                mine = quantize_int8(self._flat) if self.int8 else self._flat.clone()
                sent_from = [p.detach().to(torch.float32, copy=True) for p in self.params]
                self.meeting = Meeting(step, self.overlap, mine, sent_from, self.outer_group, self.replicas, self.int8)
                self.meeting.send_next()
                return
            if self.replicas > 1:
                mine = quantize_int8(self._flat) if self.int8 else self._flat
                m = Meeting(step, blocking_pieces(mine), mine, [], self.outer_group, self.replicas, self.int8)
                m.finish()
                self._flat.copy_(self._decode_mean(m.out) if self.int8 else m.out[0])
            self._outer_step(self._flat, last)
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)
        self.syncs += 1

    def _outer_step(self, flat: torch.Tensor, last: bool) -> None:
        """anchor.grad <- the replicas' mean delta (in `flat`: the mean for int8, the sum otherwise);
        then the outer Nesterov step, or at the last step the plain mean."""
        offset = 0
        for a in self.anchor:
            n = a.numel()
            a.grad.copy_(flat[offset : offset + n].view_as(a))
            offset += n
        if self.replicas > 1 and not self.int8:
            torch._foreach_div_([a.grad for a in self.anchor], float(self.replicas))
        if last:
            torch._foreach_sub_(self.anchor, [a.grad for a in self.anchor])
        else:
            self.outer.step()

    def _land(self, meeting: Meeting) -> None:
        """A meeting's outer step, `overlap` steps after it began: the new anchor, plus what this
        replica learned since it sent its delta."""
        self.meeting = None
        with torch.no_grad():
            mean = self._decode_mean(meeting.out) if self.int8 else meeting.out[0]
            self._outer_step(mean, False)
            since = torch._foreach_sub(self.anchor, meeting.sent_from)
            torch._foreach_add_(self.params, [d.to(p.dtype) for d, p in zip(since, self.params, strict=True)])
        self.syncs += 1

    def _decode_mean(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The replicas' int8 deltas, decoded and averaged in replica order, so every rank computes the same mean."""
        n = self._flat.numel()
        total = dequantize_int8(parts[0], n)
        for part in parts[1:]:
            total += dequantize_int8(part, n)
        return total.div_(float(self.replicas))

    def drain(self) -> None:
        """Wait for a meeting in flight and forget it (before a rollback loads a checkpoint, at the end)."""
        if self.meeting is not None:
            self.meeting.arrived()
            self.meeting = None

    def load_replica_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Collective when a meeting was in flight: every rank saved one at the same step, and each
        sends its piece in flight again."""
        self.drain()
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if "meeting" in state:
            self.meeting = Meeting.from_state(state["meeting"], self.outer_group, self.replicas, self.int8, self._flat.device)
            if self.meeting.done < self.meeting.pieces:
                self.meeting.send_next()

    def restart_replica(self) -> None:
        """Every replica from the last meeting's weights (with rank 0's optimizer state, loaded before);
        a meeting in flight is given up."""
        self.drain()
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)

    def outer_state(self) -> dict[str, Any]:
        """What every rank holds alike: the anchor and the outer optimizer's momentum (host copies by the caller)."""
        return {"anchor": list(self.anchor), "outer": self.outer.state_dict()}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        self.drain()
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"], strict=True):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])


def wrap_diloco(loss_model: torch.nn.Module, model: torch.nn.Module, cfg: DistConfig, device: torch.device, env: Any) -> DilocoWrapped:
    """Groups are made by every rank in the same order (torch.distributed requires it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cfg.diloco_replicas and world % cfg.diloco_replicas:
        raise ConfigError(
            f"dist.diloco_replicas={cfg.diloco_replicas} does not divide the {world} ranks into equal replicas "
            f"(fix: a divisor of {world}, or 0 for one replica per node)"
        )
    inner_groups, outer_groups = replica_groups(world, env.local_world_size, cfg.diloco_replicas)
    rank = dist.get_rank() if dist.is_initialized() else 0
    inner, outer = None, None
    for ranks in inner_groups:
        g = dist.new_group(ranks) if world > 1 and len(ranks) > 1 else None
        if rank in ranks:
            inner, inner_size = g, len(ranks)
    for ranks in outer_groups:
        g = dist.new_group(ranks) if world > 1 else None
        if rank in ranks:
            outer = g
    module: torch.nn.Module = loss_model
    if inner is not None:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        module = DistributedDataParallel(loss_model, device_ids=ids, process_group=inner, gradient_as_bucket_view=True)
    return DilocoWrapped(module, model, cfg, outer, inner_size)
