"""The one module that wraps the model for data parallelism.

The training loop talks only to `Wrapped`: forward through `.module`, `accumulating()` around
non-final micro-steps, `.raw` for saving and sampling. DeepSpeed ZeRO and FSDP strategies
plug in here beside DDP without touching the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from aura_hpc.errors import ConfigError


@dataclass
class Wrapped:
    module: torch.nn.Module  # what the loop calls forward on
    raw: torch.nn.Module  # the unwrapped model: state_dict, sampling
    strategy: str

    @contextlib.contextmanager
    def accumulating(self, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on micro-steps that are not the last of a step."""
        if not sync and isinstance(self.module, DistributedDataParallel):
            with self.module.no_sync():
                yield
        else:
            yield


def wrap(model: torch.nn.Module, strategy: str, device: torch.device, world_size: int) -> Wrapped:
    if strategy != "ddp":
        raise ConfigError(f"dist.strategy {strategy!r} is not available yet (fix: --set dist.strategy=ddp)")
    if world_size == 1:
        return Wrapped(model, model, "single")
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    return Wrapped(ddp, model, "ddp")
