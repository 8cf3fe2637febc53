"""How the model is spread over the ranks: the one seam the training loop talks through.

The loop calls forward on `Wrapped.module`, wraps non-final micro-steps in `accumulating()`,
and hands its per-step agreement flags to `send_flags()`/`received_flags()`. DDP lives in
ddp.py; FSDP2 and DeepSpeed ZeRO go beside it, chosen by `dist.strategy`, without touching
the loop.
"""

from __future__ import annotations

import torch

from aura_hpc.errors import ConfigError
from aura_hpc.train.strategies.base import Wrapped


def wrap(model: torch.nn.Module, strategy: str, device: torch.device, world_size: int) -> Wrapped:
    if strategy != "ddp":
        raise ConfigError(f"dist.strategy {strategy!r} is not available yet (fix: --set dist.strategy=ddp)")
    if world_size == 1:
        return Wrapped(model)
    from aura_hpc.train.strategies.ddp import wrap_ddp

    return wrap_ddp(model, device, world_size)


__all__ = ["Wrapped", "wrap"]
