"""DiLoCo (Douillard et al. 2023): replicas train apart and meet every `dist.sync_every` steps.

Each replica (by default one per node; the GPUs of a node train it together with DDP) runs its
own AdamW on its own slice of the global sample order. Every `sync_every` steps the replicas
average their parameter deltas since the last meeting (one all-reduce in `dist.diloco_wire`
bf16 or fp32, or an all_gather of int8 codes with a scale per block) and apply the average with an outer Nesterov SGD (`dist.outer_lr`,
`dist.outer_momentum`; the paper's 0.7 and 0.9): anchor <- anchor - lr * nesterov(mean(anchor - theta)),
and every replica starts the next interval from the new anchor. Between meetings only a few
bytes cross the network each step (the flags every rank agrees on: stop, GPU fault, bad loss),
so a slow link costs one all-reduce per interval instead of one per step.

With `dist.diloco_overlap=K` a meeting does not stop the replicas: its bytes go out in K portions,
one per inner step, while the replicas go on training (a portion a step keeps the link's queue short,
so the per-step flags are not stuck behind a bulk transfer), and K steps later the outer step lands
with each replica's progress since the meeting kept: theta <- new anchor + (theta - theta at the
meeting). This is the overlapped variant of Streaming DiLoCo (Douillard et al. 2025) for the whole
model at once.

Only a replica's leader (its first rank) meets the others: each node puts one copy of a meeting
on the slow link whatever its number of GPUs, and hands the result to its other ranks over the
fast one. A replica's delta counts by its number of ranks (a 2-GPU desktop beside a 1-GPU laptop
trains on twice the samples).

State beyond DDP's: the anchor (the global model at the last meeting) and the outer momentum,
the same on every rank (saved by rank 0), and each replica's inner weights and AdamW moments
(saved by its leader in its own run directory, train/checkpoint/diloco_files.py), so a resume between
meetings continues exactly, also on LAN machines without shared storage. A meeting in flight is
saved with them (what the leader sent, the portions already received, the weights it was sent from),
and a resume sends the missing portions again: the results depend only on what every replica sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import DistConfig
from aura_hpc.train.process import progress
from aura_hpc.train.strategies.base import OuterLoop, PerRankState, Wrapped

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


# A meeting crosses in slices of at most this size on gloo (TCP), so a slow link's queue never holds
# more than one: both replicas send at once, and each one's acknowledgements wait behind the other's
# data in a shaped (or bloated Wi-Fi) queue (measured at 10 and 1,000 Mbit/s: docs/lan.md). NCCL
# has no such queue to keep short, and thousands of tiny collectives would cost their launches: a
# portion goes as one collective there.
SLICE_BYTES = 32 * 1024
MAX_PORTIONS = 1024  # a waited-for meeting's portions, one after the other (beyond 32 MB they grow, in slices)


def blocking_portions(payload: torch.Tensor, sliced: bool = True) -> int:
    size = payload.numel() * payload.element_size()
    return max(1, min(MAX_PORTIONS, -(-size // SLICE_BYTES))) if sliced else 1


def _sliced(group: collectives.Group | None) -> bool:
    return collectives.backend(group) != "nccl"


class Meeting:
    """A meeting in flight: this replica's payload (int8 codes and scales, or wire-dtype deltas) crossing
    in `portions` portions, one per step, into `out` (every replica's payload for int8's all_gather; the
    sum for an all-reduce). Only a replica's leader takes part (`mine` is None on the other ranks of
    the replica, which count the portions with it and get the result from it when the meeting lands).
    On gloo a portion goes as collectives of at most SLICE_BYTES, issued together; their bounds depend
    only on the sizes, so every run (and every resume) adds the same numbers. Portions before `done`
    have arrived."""

    def __init__(
        self,
        since: int,
        portions: int,
        mine: torch.Tensor | None,
        sent_from: list[torch.Tensor],
        group: collectives.Group | None,
        replicas: int,
        int8: bool,
    ) -> None:
        self.since, self.portions, self.mine, self.sent_from = since, portions, mine, sent_from
        self.group, self.int8 = group, int8
        self.out: list[torch.Tensor] = []
        if mine is not None:
            self.out = [torch.empty_like(mine) for _ in range(replicas)] if int8 else [torch.empty_like(mine)]
        self.portion = -(-mine.numel() // portions) if mine is not None else 0
        self.slice = max(1, SLICE_BYTES // mine.element_size()) if mine is not None and _sliced(group) else None
        self.done = 0
        self.work: list[Any] | None = None  # the portion in flight's collectives (none for an empty last portion)

    def send_next(self) -> None:
        self.work = []
        if self.mine is None:
            return
        end = min(self.mine.numel(), (self.done + 1) * self.portion)
        begin = self.done * self.portion
        step = self.slice or max(1, end - begin)
        for start in range(begin, end, step):
            sl = slice(start, min(end, start + step))
            if self.int8:
                self.work.append(collectives.all_gather([o[sl] for o in self.out], self.mine[sl], self.group, async_op=True))
            else:
                self.out[0][sl].copy_(self.mine[sl])
                self.work.append(collectives.all_reduce(self.out[0][sl], self.group, async_op=True))

    def in_time(self) -> bool:
        """Whether the portion in flight is here already (asked without waiting)."""
        return self.work is None or all(w.is_completed() for w in self.work)

    def arrived(self) -> bool:
        """Wait for the portion in flight; True once every portion is here."""
        if self.work is not None:
            for w in self.work:
                w.wait()
            self.work = None
            self.done += 1
        return self.done >= self.portions

    def finish(self) -> None:
        """The remaining portions, one after the other."""
        while not self.arrived():
            self.send_next()

    def landed(self, last: bool, device: torch.device) -> bool:
        """The portion in flight waited for (at the last step: every portion left); True once the meeting
        is whole. A wait that is not over at once is the meeting's: in its section, which the watchdog
        allows longer than a step, and on the host, since on a GPU a collective's wait() only makes the
        stream wait, and the host would block later, in the step, for the same link."""
        late = last or not self.in_time()
        with progress.current().section("meeting") if late else contextlib.nullcontext():
            whole = self.arrived()
            if last:
                self.finish()
            if late:
                collectives.synchronize(device)
        return whole or last

    def state(self) -> dict[str, Any]:
        end = min(self.mine.numel(), self.done * self.portion) if self.mine is not None else 0
        return {
            "since": self.since,
            "portions": self.portions,
            "done": self.done,
            "mine": self.mine,
            "sent_from": list(self.sent_from),
            "arrived": [o[:end] for o in self.out],  # not the portion in flight: it is being written
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], group: collectives.Group | None, replicas: int, int8: bool, device: torch.device, leader: bool
    ) -> Meeting:
        sent_from = [t.to(device, copy=True) for t in state["sent_from"]]
        mine = state["mine"].to(device, copy=True) if leader and state.get("mine") is not None else None
        portions = state.get("portions", state.get("pieces"))  # "pieces" in checkpoints written before the rename
        m = cls(int(state["since"]), int(portions), mine, sent_from, group, replicas, int8)
        m.done = int(state["done"])
        for o, saved in zip(m.out, state["arrived"], strict=False):
            o[: saved.numel()].copy_(saved)
        return m


def replica_partition(env: Any, replicas: int) -> list[list[int]]:
    """The ranks of each replica, node by node (config/replicas.py, which the plans ask first)."""
    from aura_hpc.config.replicas import replica_partition as partition

    return partition(env.node_ranks, replicas)


class DilocoWrapped(Wrapped, OuterLoop, PerRankState):
    name = "diloco"
    norm_is_local = True  # the gradients are averaged within a replica only
    last_step = 0

    def __init__(
        self,
        module: torch.nn.Module,
        model: torch.nn.Module,
        cfg: DistConfig,
        parts: list[list[int]],
        rank: int,
        outer: collectives.Group | None,
        inner: collectives.Group | None,
    ) -> None:
        super().__init__(module, model)
        self.sync_every, self.outer_group, self.inner_group = cfg.sync_every, outer, inner
        mine = next(p for p in parts if rank in p)
        self.leader_rank, self.leader = mine[0], rank == mine[0]
        self.inner_size = len(mine)
        self.replicas = len(parts)
        world = sum(len(p) for p in parts)
        # A replica's delta counts by its ranks (the samples it trained on): equal replicas weigh 1.
        self.weight = self.inner_size * self.replicas / world
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

    def replica_writer(self, rank: int) -> int | None:
        """Every rank of a replica holds the same weights and AdamW moments: its leader writes them."""
        return self.leader_rank

    def replica_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        state = {"model": {k: v for k, v in self.model.state_dict().items()}, "optimizer": optimizer.state_dict()}
        if self.meeting is not None:
            state["meeting"] = self.meeting.state()
        return state

    def after_update(self, step: int) -> None:
        """At every sync_every-th step: average the deltas over the replicas, take the outer step, and
        restart every replica from the new anchor. At the last step the replicas meet whatever
        sync_every, and end on their mean: the final checkpoint holds every replica's work, not rank
        0's alone, and no outer momentum extrapolates past it once training is over (measured: docs/lan.md)."""
        last = step == self.last_step
        if self.meeting is not None:
            if self.meeting.landed(last, self._flat.device):
                self._land(self.meeting)
            else:
                self.meeting.send_next()
        if step % self.sync_every and not last:
            return
        with torch.no_grad():
            deltas = torch._foreach_sub(self.anchor, [p.to(torch.float32) for p in self.params])
            if self.weight != 1.0:
                torch._foreach_mul_(deltas, self.weight)
            offset = 0
            for d in deltas:  # one flat buffer: one all-reduce, in the wire dtype
                n = d.numel()
                self._flat[offset : offset + n].copy_(d.view(-1))
                offset += n
            if self.overlap and not last:
                mine = (quantize_int8(self._flat) if self.int8 else self._flat.clone()) if self.leader else None
                sent_from = [p.detach().to(torch.float32, copy=True) for p in self.params]
                self.meeting = Meeting(step, self.overlap, mine, sent_from, self.outer_group, self.replicas, self.int8)
                self.meeting.send_next()
                return
            if self.replicas > 1:
                with progress.current().section("meeting"):  # a slow link's meeting: the watchdog allows it
                    if self.leader:
                        mine = quantize_int8(self._flat) if self.int8 else self._flat
                        portions = blocking_portions(mine, _sliced(self.outer_group))
                        m = Meeting(step, portions, mine, [], self.outer_group, self.replicas, self.int8)
                        m.finish()
                        self._flat.copy_(self._decode_mean(m.out) if self.int8 else m.out[0])
                    self._share(self._flat)
                    collectives.synchronize(self._flat.device)  # on a GPU the waits above ordered the stream only
            self._outer_step(self._flat, last)
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)
        self.syncs += 1

    def _share(self, flat: torch.Tensor) -> None:
        """The leader's result to the other ranks of its replica (the fast link inside a node)."""
        if self.inner_group is not None:
            collectives.broadcast(flat, 0, self.inner_group)

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
            if self.leader:
                self._flat.copy_(self._decode_mean(meeting.out) if self.int8 else meeting.out[0])
            self._share(self._flat)
            self._outer_step(self._flat, False)
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
        leader sends its portion in flight again."""
        self.drain()
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if "meeting" in state:
            self.meeting = Meeting.from_state(state["meeting"], self.outer_group, self.replicas, self.int8, self._flat.device, self.leader)
            if self.meeting.done < self.meeting.portions:
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

    def start_from_model(self) -> None:
        """A checkpoint with no outer state (trained under DDP, say): the anchor is the weights just loaded and the
        momentum none. The anchor was the weights the model was built with, and the first meeting moved every
        replica by the whole training so far again (a third of it with the paper's outer lr and momentum)."""
        self.drain()
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(p)
        self.outer.state.clear()

    def load_outer_state(self, state: dict[str, Any]) -> None:
        self.drain()
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"], strict=True):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])


def wrap_diloco(loss_model: torch.nn.Module, model: torch.nn.Module, cfg: DistConfig, device: torch.device, env: Any) -> DilocoWrapped:
    """Groups are made by every rank in the same order (torch.distributed requires it): the ranks of
    each replica (DDP inside it), then the replicas' leaders (the one outer group: each node puts one
    copy of a meeting on the link, whatever its number of GPUs)."""
    parts = replica_partition(env, cfg.diloco_replicas)
    rank = env.rank
    inner = collectives.split("diloco-inner", parts)
    outer = collectives.split("diloco-outer", [[p[0] for p in parts]])
    module: torch.nn.Module = loss_model
    if inner is not None:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        module = DistributedDataParallel(loss_model, device_ids=ids, process_group=inner.pg, gradient_as_bucket_view=True)
    return DilocoWrapped(module, model, cfg, parts, rank, outer, inner)
