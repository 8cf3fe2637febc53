"""One optimizer step: micro-steps with accumulation, the ranks' agreement flags, clipping, update.

A step never waits for the GPU. Whether the update is usable (finite loss on every rank,
finite gradients) is decided on the device, and a fused optimizer skips a bad update there
(the `found_inf` input GradScaler also uses), so a NaN step is never applied and every rank
skips it alike. What the loop needs to know (loss, gradient norm, stop and GPU-fault flags,
which ranks went bad) is copied to pinned host memory without blocking and read later, when
the loop has a reason to wait: the next step is already queued by then.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import TrainConfig
from aura_hpc.train.loop.batches import Batches
from aura_hpc.train.loop.stragglers import BusyClock
from aura_hpc.train.parts.state import Parts, Position
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.process.stop import StopRequest
from aura_hpc.train.strategies import Wrapped
from aura_hpc.train.strategies.base import OuterLoop, WarmsUp, capability


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    stop: bool  # every rank agreed to stop (a signal reached at least one)
    bad_ranks: list[int]  # ranks whose loss (or gradients) were not finite: the update was skipped on every rank
    gpu_fault: bool  # a GPU circuit breaker opened on at least one node


class StepOutcome:
    """A step's report, on its way to host memory; `read()` waits for it (usually already there)."""

    def __init__(self, step: int, report: torch.Tensor, world: int, scaler_enabled: bool, host: torch.Tensor | None = None) -> None:
        self.step, self.world, self.scaler_enabled = step, world, scaler_enabled
        self.event = None
        if report.device.type == "cuda":
            assert host is not None  # a pinned buffer of the stepper's ring: no host allocation in a step
            host.copy_(report, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            report = host
        self.report = report

    def read(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        v = self.report.tolist()
        loss, norm = v[0], v[1]
        # Only the rank whose loss went bad is named: a NaN loss on one rank poisons every rank's
        # gradients through DDP, so the gradients cannot say where it started. Where each replica
        # has a norm of its own (DiLoCo), the ranks that found theirs not finite said so in the flags.
        bad = [r for r in range(self.world) if v[4 + r] > 0] or [r for r in range(self.world) if v[4 + self.world + r] > 0]
        if not bad and not math.isfinite(norm) and not self.scaler_enabled:
            # After the all-reduce every rank holds the same gradients, so every rank sees this
            # alike. fp16's GradScaler skips inf-gradient steps itself; only a bad loss counts there.
            bad = list(range(self.world))
        return StepResult(self.step, loss, norm, v[2] > 0, bad, v[3] > 0)


def micro_step_loss(module: torch.nn.Module, batch: torch.Tensor, rt: Runtime, grad_accum: int) -> torch.Tensor:
    """One micro-step's share of the step's loss, under the run's autocast: what `local`'s steps and
    the parameter server's workers both call, so the two cannot drift apart."""
    with rt.autocast():
        return module(batch) / grad_accum


class Stepper:
    def __init__(self, t: TrainConfig, rank: int, world: int, rt: Runtime, parts: Parts, wrapped: Wrapped, batches: Batches) -> None:
        self.t, self.rank, self.world, self.rt = t, rank, world, rt
        self.parts, self.wrapped, self.batches = parts, wrapped, batches
        self.outer = capability(wrapped, OuterLoop)
        self.clock = BusyClock(rt.device)  # this rank's time before each gradient exchange (loop/stragglers.py)
        # Pinned host buffers for the steps' reports, reused in turn (a report is read one step late,
        # so three never overlap): allocating pinned memory inside a step would synchronise.
        self._ring: list[torch.Tensor] = []
        self._turn = 0

    def warm_up(self) -> None:
        """The strategy's once-per-process work before the first step, on a batch of the run's shape."""
        if (warms := capability(self.wrapped, WarmsUp)) is None:
            return
        lay = self.batches.layout
        batch = torch.zeros((lay.batch_size, lay.seq_len + 1), dtype=torch.long, device=self.rt.device)
        warms.warm_up(lambda: micro_step_loss(self.wrapped.module, batch, self.rt, 1))

    def step(self, pos: Position, stop: StopRequest, gpu_fault_seen: Callable[[], bool]) -> StepOutcome:
        """Queue step pos.step + 1. Whether to stop and whether the step is usable is decided by all
        ranks together in one all-reduce (under DDP the gradients' own), so a NaN or a signal on
        one rank never leaves the others waiting.
        """
        t, rt, p, wrapped = self.t, self.rt, self.parts, self.wrapped
        total = torch.zeros((), device=rt.device, dtype=torch.float64)
        riding = False
        # [stop requested, GPU breaker open, non-finite loss on rank 0..N-1, non-finite gradient norm
        # on rank 0..N-1 (where the norm is a replica's own)], built on the device and summed over
        # ranks with the gradients (or below).
        flags = torch.zeros(2 + 2 * self.world, dtype=torch.float64, device=rt.device)
        for micro in range(t.grad_accum):
            batch = self.batches.get(pos, micro)
            last = micro == t.grad_accum - 1
            with wrapped.accumulating(sync=last):
                loss = micro_step_loss(wrapped.module, batch, rt, t.grad_accum)
            total += loss.detach().to(torch.float64)
            if last:
                # fill_ with a Python number is a kernel argument; `flags[0] = 1.0` would copy a host tensor.
                flags[0:1].fill_(1.0 if stop.requested else 0.0)
                flags[1:2].fill_(1.0 if gpu_fault_seen() else 0.0)
                flags[2 + self.rank : 3 + self.rank].copy_((~torch.isfinite(total)).to(torch.float64).view(1))
                riding = wrapped.send_flags(flags)
                self.clock.exchange_begins()
            wrapped.backward(loss, p.scaler)
        grad_norm = None
        if not riding and wrapped.norm_is_local and not p.scaler.is_enabled():
            # A replica's own norm: a non-finite one travels with the flags, so every rank skips the
            # update and reads the same report (the loop's next collectives depend on it).
            grad_norm = wrapped.grad_norm(p.optimizer, p.scaler, t.grad_clip)
            own = 2 + self.world + self.rank
            flags[own : own + 1].copy_((~torch.isfinite(grad_norm)).to(torch.float64).view(1))
        if riding:
            flags = wrapped.received_flags()
        elif self.world > 1:
            collectives.all_reduce(flags)
        if grad_norm is None:
            grad_norm = wrapped.grad_norm(p.optimizer, p.scaler, t.grad_clip)
        bad = flags[2:].sum() > 0
        if not p.scaler.is_enabled():
            bad = bad | ~torch.isfinite(grad_norm)
        wrapped.update(p.optimizer, p.scaler, bad)
        p.scheduler.step()
        if self.outer is not None:
            self.outer.after_update(pos.step + 1)
        self.clock.exchange_done()
        report = torch.cat([total.view(1), grad_norm.detach().to(torch.float64).view(1), flags])
        host = None
        if report.device.type == "cuda":
            if not self._ring:
                self._ring = [torch.empty(report.shape, dtype=report.dtype, pin_memory=True) for _ in range(3)]
            host, self._turn = self._ring[self._turn % 3], self._turn + 1
        return StepOutcome(pos.step + 1, report, self.world, p.scaler.is_enabled(), host)
