"""The skip of a non-finite step under ZeRO, which DeepSpeed does not do outside fp16.

DeepSpeed's ZeRO optimizers check for overflow only under fp16 (fp32 never; bf16 with its
`check_grad_overflow`, on by default from 0.17: config/deepspeed.py turns it off, so that the skip is
ours on every version, logged, counted for nan_rollback_after, with no host read). Otherwise a NaN loss on one rank reaches our
AdamW through the averaged gradients and every weight becomes NaN: DeepSpeed masks the norm to -1,
which clipping reads as "no clipping needed". The guard sits on the step of the torch optimizer
DeepSpeed drives: each rank checks the gradients of the partitions it is about to update on the
device (with whether its loss was finite: ZeroWrapped.backward), the verdict is all-reduced (one
tiny collective, no host read), and the update is made unless it says so by strategies/base.py's
`step_unless`, as every other strategy's (a fused AdamW takes it on the device; a non-fused one
reads it on the host).

DeepSpeed steps one parameter group (stage 3: sub-group) at a time, so the partitions in hand say
nothing of the groups before or after: a finite loss with an inf in one bias's gradient would skip
the no-decay group and update the others. Every ZeRO stage computes each group's norm first (masked
to -1 when not finite, then combined into a finite global norm), so `GroupNormWatch` reads those
per-group norms and the whole step is skipped when any of them is bad.
"""

from __future__ import annotations

import math
import numbers
import types
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.train.strategies.base import step_unless


class GroupNormWatch:
    """Whether any parameter group's norm was non-finite in this step (a device bool), from the
    methods every ZeRO stage computes a group's norm with; `reset()` before each step."""

    NORM_METHODS = ("get_grad_norm_direct", "complete_grad_norm_calculation_for_cpu_offload")

    def __init__(self, zero_optimizer: Any, device: torch.device) -> None:
        self.device = device
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.watched: list[str] = []
        for name in self.NORM_METHODS:
            method = getattr(zero_optimizer, name, None)
            if callable(method):
                setattr(zero_optimizer, name, self._watching(method))  # on the instance only
                self.watched.append(name)

    def _watching(self, method: Any) -> Any:
        def norm(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                value = out.detach().to(self.device, torch.float32, non_blocking=True)
                self.bad = self.bad | (value < 0).any() | ~torch.isfinite(value).all()
            elif isinstance(out, numbers.Real):  # DeepSpeed 0.16's offload path: a float, or the int -1 for a bad norm
                bad = out < 0 or not math.isfinite(out)  # (taken for a norm, -1 made one group step and the other skip)
                self.bad = self.bad | torch.full((), bad, dtype=torch.bool, device=self.device)
            return out

        return norm

    def reset(self) -> None:
        self.bad = torch.zeros((), dtype=torch.bool, device=self.device)


def guard_bf16_step(bf16_optimizer: Any, groups: GroupNormWatch) -> None:
    """DeepSpeed's BF16_Optimizer (what ZeRO 1 runs under bf16 with fp32 gradient accumulation) asserts
    that the global norm is > 0 before it steps: a NaN gradient ended the run there with an
    AssertionError (seen on an H100, and on CPU). When any of its fp32 gradients is not finite, they
    are made finite (ones) for that check, and the verdict goes to `groups`, which the guarded inner
    step reads: the step is skipped, on the device, as under every other strategy."""
    flats = list(getattr(bf16_optimizer, "fp32_groups_gradients_flat", []))
    if not flats:
        return
    step = bf16_optimizer.step

    def guarded(*args: Any, **kwargs: Any) -> Any:
        bad = ~torch.stack([torch.isfinite(f).all() for f in flats]).all()
        groups.bad = groups.bad | bad.to(groups.device)
        for f in flats:
            f.masked_fill_(bad, 1.0)  # all of them or none: the step is skipped whole
        return step(*args, **kwargs)

    bf16_optimizer.step = guarded  # on the instance only


class NonFiniteSkip:
    def __init__(
        self, inner: torch.optim.Optimizer, device: torch.device, zero_optimizer: Any = None, groups: GroupNormWatch | None = None
    ) -> None:
        self.inner, self.device, self.zero_optimizer, self.groups = inner, device, zero_optimizer, groups
        self._step = inner.step
        self.skipped = torch.zeros((), dtype=torch.bool, device=device)  # the last step's verdict, on the device
        guard = self

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return guard.step(*args, **kwargs)

        # A method of the optimizer (torch's LR scheduler re-binds `step.__func__` to it), not of this object.
        inner.step = types.MethodType(step, inner)  # type: ignore[method-assign]

    def _bad(self) -> torch.Tensor:
        grads = [p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        checks = [torch.isfinite(g).all() for g in grads]  # DeepSpeed hands over flat partitions: a few tensors
        # Stages 1 and 2 step one parameter group at a time, after computing the norm over all of
        # them (masked to -1 when not finite): with it, a step is skipped whole or not at all.
        norm = getattr(self.zero_optimizer, "_global_grad_norm", None)
        if isinstance(norm, torch.Tensor):
            checks.append((norm >= 0).to(self.device) & torch.isfinite(norm).to(self.device))
        if self.groups is not None:
            checks.append(~self.groups.bad)
        if checks:
            finite = torch.stack([c.to(self.device) for c in checks]).all()
            flag.copy_((~finite).to(torch.float32).view(1), non_blocking=True)
        if collectives.active() and collectives.world().size > 1:
            # A rank whose partition holds an inf must not update while the others skip.
            collectives.all_reduce(flag, op="max")
        return flag[0]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        bad = self._bad()
        self.skipped = self.skipped | (bad > 0)
        return step_unless(self.inner, bad, lambda: self._step(*args, **kwargs))

    def take_skipped(self) -> torch.Tensor:
        """Whether the step just taken was skipped (device bool); cleared for the next one."""
        out, self.skipped = self.skipped, torch.zeros((), dtype=torch.bool, device=self.device)
        return out
