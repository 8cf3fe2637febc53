"""The interface every strategy offers the loop; as is, it is the single-process strategy.

A step goes: `module(batch)` per micro-step inside `accumulating()`, `backward()`, then
`grad_norm()` (clipping included), then `update()`. Flags ride on the gradients' all-reduce
where a strategy can carry them (`send_flags`); otherwise the step all-reduces them itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import torch


def step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor, step: Any, on_device: bool = True) -> Any:
    """`step()` (the optimizer's update) unless `bad`, a device flag every rank agrees on. A fused
    optimizer takes it as `found_inf` (GradScaler's input: the update and its step count become no-ops
    on the device, no host sync); flags a GradScaler driving this step has set are kept and combined.
    Otherwise `bad` is read on the host (waiting for the device; on CPU it costs nothing)."""
    if on_device and getattr(optimizer, "_step_supports_amp_scaling", False):
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        where = first.device if first is not None else bad.device
        scale, prior = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
        found = bad.to(where, torch.float32)
        if prior is not None:
            found = torch.maximum(found, prior.to(where, torch.float32))
        optimizer.grad_scale, optimizer.found_inf = scale, found  # type: ignore[attr-defined]
        try:
            return step()
        finally:
            optimizer.grad_scale, optimizer.found_inf = scale, prior  # type: ignore[attr-defined]
    return None if bool(bad) else step()


@runtime_checkable
class ShardedCheckpoints(Protocol):
    """A capability: every rank writes and reads its own part of a checkpoint (DCP, DeepSpeed) instead
    of rank 0 all of it. The loop and the Checkpointer ask `sharding(wrapped)`, never a strategy's name."""

    background_shards: bool  # save_sharded(background=True) copies to host memory and writes behind the loop
    reshards: bool  # its shards load at another world size (DCP does; DeepSpeed's ZeRO partitions do not)

    def save_sharded(self, folder: Path, optimizer: torch.optim.Optimizer, background: bool = False) -> Future[Any] | None:
        """Collective: every rank writes its shard under `folder` (in the background: a future of it)."""
        ...

    def load_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None: ...

    def own_shard_files(self, folder: Path, rank: int) -> list[Path]:
        """The files of `folder` this rank wrote (it hashes them for the commit marker)."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model's weights (fp32 masters where the strategy keeps them), on rank 0."""
        ...


@runtime_checkable
class WarmsUp(Protocol):
    """A capability: once per process, before its first step (fresh or resumed), what makes every
    process's steps alike; `loss()` gives a micro-step's loss on a batch of the run's shape (DDP with
    PowerSGD settles its buckets there: strategies/ddp.py)."""

    def warm_up(self, loss: Callable[[], torch.Tensor]) -> None: ...


@runtime_checkable
class PerRankState(Protocol):
    """A capability: state each rank holds of its own (DiLoCo's replicas, PowerSGD's error feedback),
    saved by the rank that `replica_writer` names in its own run directory (checkpoint/diloco_files.py)."""

    def replica_writer(self, rank: int) -> int | None:
        """The rank whose file holds `rank`'s own state (itself, or its DiLoCo replica's leader); None
        when this run keeps none. The same answer on every rank."""
        ...

    def replica_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None: ...

    def load_replica_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None: ...

    def restart_replica(self) -> None:
        """When some rank's saved state is missing: every rank starts that state afresh, alike."""
        ...


@runtime_checkable
class OuterLoop(Protocol):
    """A capability: an outer optimisation around the inner steps (DiLoCo). It meets its peers after an
    update, may have communication in flight between steps, and holds state every rank has alike."""

    last_step: int  # the schedule's last step (set by the builder): the replicas meet there whatever sync_every

    def after_update(self, step: int) -> None: ...

    def drain(self) -> None:
        """Wait for communication still in flight between steps (an overlapped meeting)."""
        ...

    def outer_state(self) -> dict[str, Any]: ...

    def load_outer_state(self, state: dict[str, Any]) -> None: ...

    def start_from_model(self) -> None:
        """The outer state of a checkpoint saved without one: from the weights just loaded."""
        ...


C = TypeVar("C")


def capability(wrapped: Wrapped, kind: type[C]) -> C | None:
    """`wrapped` as the capability `kind` (ShardedCheckpoints, WarmsUp, PerRankState, OuterLoop) when it
    declares it: what the loop, the builder and the Checkpointer ask, never a strategy's name."""
    return cast(C, wrapped) if isinstance(wrapped, kind) else None


def sharding(wrapped: Wrapped) -> ShardedCheckpoints | None:
    return capability(wrapped, ShardedCheckpoints)


class Wrapped:
    name = "single"
    # Whether grad_norm() is this rank's replica's alone (DiLoCo: each replica trains apart between
    # meetings) rather than the same on every rank: the step then shares whether it was finite.
    norm_is_local = False

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module) -> None:
        self.module = module  # what the loop calls forward on: forward(batch) = loss
        self.model = model  # the transformers model inside (saved, sampled)

    def local_weights(self) -> list[torch.Tensor]:
        """The weights this rank holds (its shards under sharded strategies), to check them where they are."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]

    def send_flags(self, flags: torch.Tensor) -> bool:
        """Hands flags to the next gradient all-reduce; False when the caller must reduce them itself."""
        return False

    def received_flags(self) -> torch.Tensor:
        """The flags summed over all ranks, after the backward pass that carried them."""
        raise RuntimeError("this strategy does not carry flags with its gradients")

    @contextlib.contextmanager
    def accumulating(self, sync: bool) -> Iterator[None]:
        """Around a micro-step: with sync=False, gradients are only accumulated locally."""
        yield

    def backward(self, loss: torch.Tensor, scaler: Any) -> None:
        scaler.scale(loss).backward()

    def grad_norm(self, optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float) -> torch.Tensor:
        """The total gradient norm (before clipping), after clipping to max_norm (0: no clipping)."""
        scaler.unscale_(optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return clip_to_total_norm(grads, max_norm)

    def update(self, optimizer: torch.optim.Optimizer, scaler: Any, bad: torch.Tensor) -> None:
        """Apply the step unless `bad` (a device bool agreed by every rank); clear the gradients."""
        if scaler.is_enabled():  # fp16: GradScaler skips a step with inf gradients; `bad` joins its verdict
            # A GradScaler laid out otherwise (no flags to join): `bad` is read on the host.
            if not _join_found_inf(scaler, optimizer, bad) and bool(bad):
                optimizer.zero_grad(set_to_none=True)
                scaler.update()
                return
            scaler.step(optimizer)
            scaler.update()
        else:
            step_unless(optimizer, bad, optimizer.step, on_device=self.device_skip)
        optimizer.zero_grad(set_to_none=True)

    device_skip = True  # whether found_inf may be handed to a fused optimizer over these parameters


def _join_found_inf(scaler: Any, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> bool:
    """`bad` added to the inf flags GradScaler found while unscaling this step's gradients (on their
    devices): its step then skips the update like an overflow, on the device for a fused optimizer,
    without a host read of `bad`. False when the scaler keeps no such flags for this optimizer."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    flags = state.get("found_inf_per_device") or {}
    if not flags:
        return False
    for t in flags.values():
        t.copy_(torch.maximum(t, bad.to(t.device, t.dtype)))
    return True


def clip_to_total_norm(
    grads: list[torch.Tensor], max_norm: float, sharded: bool = False, device: torch.device | None = None
) -> torch.Tensor:
    """clip_grad_norm_, with the squares summed in fp64 (and over the ranks' shards when `sharded`).

    In fp64 the total no longer depends on how the elements were split and summed, so DDP (whole
    gradients) and FSDP (shards) compute the same clipping factor and train to the same bits. One
    foreach norm over all gradients (a few kernel launches, not one per parameter). `device` is where
    the process group reduces (gradients offloaded to the host are reduced on the GPU's group there).
    """
    if not grads:
        return torch.zeros((), device=device)
    squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
    if sharded:
        from aura_hpc.comm import collectives

        squares = squares.to(collectives.world().device)
        collectives.all_reduce(squares)
    norm = squares.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))
    return norm
