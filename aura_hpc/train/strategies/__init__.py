"""How the model is spread over the ranks: the one seam the training loop talks through.

The loop calls forward on `Wrapped.module`, wraps non-final micro-steps in `accumulating()`,
and hands its per-step agreement flags to `send_flags()`/`received_flags()`. DDP lives in
ddp.py; FSDP2 and DeepSpeed ZeRO go beside it, chosen by `dist.strategy`, without touching
the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from aura_hpc.config import RunConfig
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.strategies.base import Wrapped

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def wrap(
    loss_model: torch.nn.Module,
    model: torch.nn.Module,
    cfg: RunConfig,
    rt: Runtime,
    world_size: int,
    make_optimizer: MakeOptimizer,
    env: Any = None,
    materialize: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[Wrapped, torch.optim.Optimizer]:
    """`loss_model` (forward(batch) = loss, holding `model`) spread over the ranks by dist.strategy,
    and the optimizer over what the strategy made of the parameters (FSDP replaces them by shards;
    DeepSpeed takes the optimizer in and partitions it). `materialize`: a model built on the meta
    device is given its weights once sharded (fsdp only)."""
    strategy = cfg.dist.strategy
    if strategy.startswith("zero"):
        from aura_hpc.train.strategies.zero import wrap_zero

        optimizer = make_optimizer(model)
        return wrap_zero(loss_model, model, cfg, rt, world_size, optimizer), optimizer
    if strategy == "diloco":
        from aura_hpc.train.strategies.diloco import wrap_diloco

        return wrap_diloco(loss_model, model, cfg.dist, rt.device, env), make_optimizer(model)
    if strategy == "fsdp":
        from aura_hpc.train.strategies.fsdp import wrap_fsdp

        wrapped: Wrapped = wrap_fsdp(loss_model, model, cfg.dist, rt, world_size, materialize)
    elif world_size == 1:
        wrapped = Wrapped(loss_model, model)
    else:
        from aura_hpc.train.strategies.ddp import wrap_ddp

        wrapped = wrap_ddp(loss_model, model, rt.device, world_size, cfg.dist.compress, cfg.dist.powersgd_rank)
    return wrapped, make_optimizer(model)


__all__ = ["MakeOptimizer", "Wrapped", "wrap"]
