"""The one module that wraps the model for data parallelism.

The training loop talks only to `Wrapped`: forward through `.module`, `accumulating()` around
non-final micro-steps, `.raw` for saving and sampling, and `send_flags()`/`received_flags()`
for the per-step agreement (stop, GPU fault, non-finite loss) that every rank must reach.
DeepSpeed ZeRO and FSDP strategies plug in here beside DDP without touching the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from aura_hpc.errors import ConfigError


class FlagRide:
    """Carries a small flags tensor inside DDP's gradient all-reduce, summed across ranks.

    The loop must agree on a few flags every step. A separate all_reduce for them costs one
    more network round trip per step (2.2 ms with gloo on the CPU test machine, ~3% of a tiny
    model's step); appended to the first gradient bucket they cost nothing extra.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.outgoing: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None

    def hook(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        import torch.distributed as dist

        # What DDP's default hook does: average by dividing first, then sum.
        grads = bucket.buffer().div_(self.world_size)
        flags, self.outgoing = self.outgoing, None
        if flags is None or bucket.index() != 0:
            fut = dist.all_reduce(grads, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        n = grads.numel()
        joined = torch.cat([grads, flags.to(grads.dtype)])
        fut = dist.all_reduce(joined, async_op=True).get_future()

        def split(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = f.value()[0]
            self.incoming = out[n:].clone()
            return out[:n]

        return fut.then(split)


def _ride_hook(ride, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against its own types, and string annotations
    # (from __future__ import annotations) fail that check.
    return ride.hook(bucket)


@dataclass
class Wrapped:
    module: torch.nn.Module  # what the loop calls forward on
    raw: torch.nn.Module  # the unwrapped model: state_dict, sampling
    strategy: str
    ride: FlagRide | None = None

    def send_flags(self, flags: torch.Tensor) -> bool:
        """Hands flags to the next gradient all-reduce; False when the caller must reduce them itself."""
        if self.ride is None:
            return False
        self.ride.outgoing, self.ride.incoming = flags, None
        return True

    def received_flags(self) -> torch.Tensor:
        """The flags summed over all ranks, after the backward pass that carried them."""
        if self.ride is None or self.ride.incoming is None:
            raise RuntimeError("the flags did not travel with the gradient all-reduce (was backward run with sync?)")
        out, self.ride.incoming = self.ride.incoming, None
        return out

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
    ride = FlagRide(world_size)
    ddp.register_comm_hook(ride, _ride_hook)
    return Wrapped(ddp, model, "ddp", ride)
