"""One optimizer step: micro-steps with accumulation, the ranks' agreement flags, clipping, update."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aura_hpc.config import TrainConfig
from aura_hpc.train import distributed, faults
from aura_hpc.train.batches import Batches
from aura_hpc.train.model import lm_loss
from aura_hpc.train.runtime import Runtime
from aura_hpc.train.state import Parts, Position
from aura_hpc.train.stop import StopRequest
from aura_hpc.train.strategies import Wrapped


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    stop: bool  # every rank agreed to stop (a signal reached at least one)
    bad_ranks: list[int]  # ranks whose loss (or everyone's gradients) were not finite: the update was skipped
    gpu_fault: bool  # a GPU circuit breaker opened on at least one node


class Stepper:
    def __init__(self, t: TrainConfig, rank: int, world: int, rt: Runtime, parts: Parts, wrapped: Wrapped, batches: Batches) -> None:
        self.t, self.rank, self.world, self.rt = t, rank, world, rt
        self.parts, self.wrapped, self.batches = parts, wrapped, batches

    def step(self, pos: Position, stop: StopRequest, gpu_fault_seen: Callable[[], bool]) -> StepResult:
        """Whether to stop and whether the step is usable is decided by all ranks together in one
        all-reduce (under DDP the gradients' own), so a NaN or a signal on one rank never leaves
        the others waiting.
        """
        t, rt, p, wrapped = self.t, self.rt, self.parts, self.wrapped
        total = torch.zeros((), device=rt.device, dtype=torch.float64)
        poison = faults.poison_loss(self.rank, pos.step + 1)
        riding = False
        flags = torch.zeros(2 + self.world, dtype=torch.float64, device=rt.device)
        for micro in range(t.grad_accum):
            batch = self.batches.get(pos, micro)
            last = micro == t.grad_accum - 1
            with wrapped.accumulating(sync=last), rt.autocast():
                loss = lm_loss(wrapped.module, batch) / t.grad_accum
                if poison:
                    loss = loss * float("nan")
            total += loss.detach().to(torch.float64)
            if last:
                # [stop requested, GPU breaker open, non-finite loss on rank 0..N-1], built on the
                # device without a sync and summed over ranks with the gradients (or below).
                flags[0] = 1.0 if stop.requested else 0.0
                flags[1] = 1.0 if gpu_fault_seen() else 0.0
                flags[2 + self.rank] = (~torch.isfinite(total)).to(torch.float64)
                riding = wrapped.send_flags(flags)
            p.scaler.scale(loss).backward()
        if riding:
            flags = wrapped.received_flags()
        elif distributed.active() and self.world > 1:
            torch.distributed.all_reduce(flags)
        p.scaler.unscale_(p.optimizer)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(p.model.parameters(), max_norm)
        loss_value, norm_value = float(total), float(grad_norm)
        flags_list = flags.tolist()
        # Only the rank whose loss went bad is named: a NaN loss on one rank poisons every rank's
        # gradients through DDP, so the gradients cannot say where it started.
        bad_ranks = [r for r in range(self.world) if flags_list[2 + r] > 0]
        if not bad_ranks and not math.isfinite(norm_value) and not p.scaler.is_enabled():
            # After the all-reduce every rank holds the same gradients, so every rank sees this
            # alike. fp16's GradScaler skips inf-gradient steps itself; only a bad loss counts there.
            bad_ranks = list(range(self.world))
        if bad_ranks:
            p.optimizer.zero_grad(set_to_none=True)
            if p.scaler.is_enabled():
                p.scaler.update()
        else:
            p.scaler.step(p.optimizer)
            p.scaler.update()
            p.optimizer.zero_grad(set_to_none=True)
        p.scheduler.step()
        return StepResult(loss_value, norm_value, flags_list[0] > 0, bad_ranks, flags_list[1] > 0)
