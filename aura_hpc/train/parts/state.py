"""What a run is made of, once built: the batch layout, and the position that checkpoints carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.packed import PackedTokens


@dataclass(frozen=True)
class Layout:
    """The batch arithmetic of a run: what one optimizer step consumes, and how many steps there are."""

    batch_size: int  # sequences per device per micro-step
    grad_accum: int
    world: int
    seq_len: int
    max_steps: int  # the schedule horizon
    end_step: int  # where this invocation stops: train.stop_at, or max_steps

    @property
    def per_step(self) -> int:
        """Sequences per optimizer step over all ranks (the effective batch)."""
        return self.batch_size * self.world * self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.per_step * self.seq_len


@dataclass
class Position:
    """Where training stands; saved in every checkpoint's meta.json.

    The data position is `samples_base + (step - step_base) * per_step`: a rollback skips the data
    that went bad by moving the base, so the same step number can read later samples.
    """

    step: int = 0
    samples_base: int = 0
    step_base: int = 0
    tokens_seen: int = 0
    rollbacks: int = 0
    saved_step: int = -1  # the step of the newest checkpoint this run wrote or resumed from
    last_eval: float | None = None  # the eval loss of the current step, if it was evaluated

    def samples_seen(self, per_step: int) -> int:
        return self.samples_base + (self.step - self.step_base) * per_step

    def rebase(self, samples_seen: int) -> None:
        self.samples_base, self.step_base = samples_seen, self.step


@dataclass
class Parts:
    """The objects training updates: data, model, optimizer, schedule and loss scaler."""

    data: PackedTokens  # or a StreamTokens (data.stream), which reads the same way
    order: GlobalOrder
    model: torch.nn.Module  # the transformers model: what checkpoints save and samples come from
    loss_model: torch.nn.Module  # forward(batch) = the training loss; what the strategies wrap
    n_params: int
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: Any  # torch.amp.GradScaler (enabled only for fp16)
