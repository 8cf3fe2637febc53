"""The optimizer and its learning-rate schedule (linear warmup, then cosine, linear or constant)."""

from __future__ import annotations

import math
from typing import Any

import torch

from aura_hpc.config import TrainConfig


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of train.lr for the update that follows `step` completed updates. A warmup longer
    than the run ends with it (clamped here, against the horizon the worker agreed: a resume at another
    world size under train.max_tokens keeps the one recorded when the run started)."""
    warmup = min(warmup, total)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, t: TrainConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW (or SGD) with weight decay on matrices only, not on biases and norms.

    fused (CUDA): one kernel for the whole update, and a bad step skipped on the device.
    """
    # A ZeRO-3 parameter built partitioned is an empty 1-D tensor here; DeepSpeed keeps its shape.
    decay = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, fused=fused)  # unfused, a skipped step would read a flag from the GPU
    if fused:
        return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), foreach=True)


def make_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig, horizon: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, t.warmup_steps, horizon, t.schedule, t.min_lr_ratio))


def scale_learning_rate(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    t: TrainConfig,
    step: int,
    horizon: int,
    times: int = 1,
) -> None:
    """Multiply the base learning rates by train.nan_lr_scale `times` (rollbacks) and apply it now."""
    scheduler.base_lrs = [lr * t.nan_lr_scale**times for lr in scheduler.base_lrs]
    factor = lr_factor(step, t.warmup_steps, horizon, t.schedule, t.min_lr_ratio)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * factor


def apply_settings(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, t: TrainConfig, saved_lr: Any, rollbacks: int = 0
) -> None:
    """After a resume, the config's learning rate, weight decay and betas over the checkpoint's: its optimizer
    and scheduler states held the old ones, so a re-run with a lower train.lr (what a divergence's fix says)
    trained on at the old one, and a new max_steps' first update at the old horizon's rate. What the
    rollbacks scaled stays scaled; with nothing changed every value is the one the checkpoint held."""
    if not (isinstance(saved_lr, int | float) and saved_lr > 0) and scheduler.base_lrs:
        # A checkpoint from before meta.json kept train_lr: its base learning rate, the rollbacks' scaling taken out.
        saved_lr = scheduler.base_lrs[0] / t.nan_lr_scale**rollbacks
        saved_lr = t.lr if math.isclose(saved_lr, t.lr, rel_tol=1e-9) else saved_lr
    if isinstance(saved_lr, int | float) and saved_lr > 0 and saved_lr != t.lr:
        scheduler.base_lrs = [base * (t.lr / saved_lr) for base in scheduler.base_lrs]
    for i, (group, base, factor) in enumerate(zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True)):
        group["lr"] = base * factor(scheduler.last_epoch)  # what LambdaLR computes, at this run's horizon
        if i == 0 and len(optimizer.param_groups) == 2:  # make_optimizer's matrices (the others decay none)
            group["weight_decay"] = t.weight_decay
        if "betas" in group:
            group["betas"] = (t.beta1, t.beta2)
