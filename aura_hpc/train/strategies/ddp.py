"""DistributedDataParallel, with the per-step agreement flags riding on its gradient all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from aura_hpc.comm import collectives
from aura_hpc.train.strategies.base import PerRankState, WarmsUp, Wrapped


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
        # What DDP's default hook does: average by dividing first, then sum.
        grads = bucket.buffer().div_(self.world_size)
        flags, self.outgoing = self.outgoing, None
        if flags is None or bucket.index() != 0:
            fut = collectives.all_reduce(grads, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        n = grads.numel()
        joined = torch.cat([grads, flags.to(grads.dtype)])
        fut = collectives.all_reduce(joined, async_op=True).get_future()

        def split(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = f.value()[0]
            self.incoming = out[n:].clone()
            return out[:n]

        return fut.then(split)


def _bf16_gloo_hook(world_size, bucket):  # type: ignore[no-untyped-def]
    """torch's bf16_compress_hook for gloo: the bucket divided by the world size, in bf16 on the wire."""
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16).div_(world_size)
    fut = collectives.all_reduce(wire, async_op=True).get_future()

    def back(f):  # type: ignore[no-untyped-def]
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(back)


class PowerSgdHook:
    """torch's PowerSGD hook, with a pass-through for the one backward that settles DDP's buckets."""

    def __init__(self, state: Any, serial: bool) -> None:
        self.state = state
        self.local = False  # while True, each bucket comes back as it went in: no communication
        # torch's hook issues a bucket's later collectives (the factors P, then Q) from its future's callbacks. NCCL
        # completes a future as it enqueues, so they run in the backward's thread, in order; gloo completes it on
        # its own thread, so with two buckets or more the ranks issued them in different orders and gloo stopped
        # the run at its first compressed step (sizes that differ). On gloo each bucket's exchange ends before the next.
        self.serial = serial
        self.q_before: dict[int, torch.Tensor] = {}  # each bucket's warm-start factors as this step found them

    def heal(self, bad: torch.Tensor) -> None:
        """A skipped step leaves nothing non-finite in PowerSGD's memory: one NaN gradient, all-reduced
        through the factors, became every rank's error feedback and warm-start Q, so every later step
        was NaN too (and a checkpoint at the skipped step saved them). On the device, no host read:
        the residual restarts at zero, the factors are the step's own starting ones (alike on every
        rank, as `bad` is)."""
        st = self.state
        for e in st.error_dict.values():
            e.masked_fill_(bad, 0.0)
        for index, q in st.q_memory_dict.items():
            before = self.q_before.get(index)
            if before is None:  # the bucket's first compressed step: a start drawn alike on every rank
                drawn = torch.Generator(device=q.device).manual_seed(index)
                before = torch.randn(q.shape, generator=drawn, device=q.device, dtype=q.dtype)
            q.copy_(torch.where(bad, before, q))


def _powersgd_hook(hook, bucket):  # type: ignore[no-untyped-def]
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from aura_hpc.train.process.runtime import keep_device_rng

    if hook.local:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    # torch's hook draws its random start after torch.manual_seed inside fork_rng(devices=[]): that puts
    # back the CPU stream only and leaves every GPU's generator reseeded alike on every rank (the same
    # dropout masks everywhere from then on). This rank's GPU stream is kept around it.
    before = hook.state.q_memory_dict.get(bucket.index())
    if before is not None:  # what `heal` puts back after a skipped step (the factors are small: rank x columns)
        hook.q_before[bucket.index()] = before.clone()
    with keep_device_rng(bucket.buffer().device):
        fut = powerSGD_hook.powerSGD_hook(hook.state, bucket)
    if hook.serial:
        fut.wait()
    return fut


def _ride_hook(ride, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against its own types, and string annotations
    # (from __future__ import annotations) fail that check.
    return ride.hook(bucket)


class DdpWrapped(Wrapped, WarmsUp, PerRankState):
    name = "ddp"

    def __init__(
        self, ddp: DistributedDataParallel, model: torch.nn.Module, ride: FlagRide | None, powersgd: PowerSgdHook | None = None
    ) -> None:
        super().__init__(ddp, model)
        self.ride, self.hook = ride, powersgd
        self.powersgd = powersgd.state if powersgd is not None else None

    def warm_up(self, loss: Callable[[], torch.Tensor]) -> None:
        """DDP puts every gradient in one bucket for a process's first backward and regroups them (in
        the order they became ready) before its second, and PowerSGD keeps its error feedback and
        warm-start factors per bucket: a resumed process's first step would be grouped, and compressed,
        otherwise than the same step of the run it continues. So every process, fresh or resumed, makes
        one backward first with the hook handing each bucket back untouched (nothing crosses the
        network; the gradients are thrown away and the dropout draws put back): from its first step on,
        every step of a run is grouped alike, and a resume continues the compressed trajectory exactly."""
        if self.hook is None:
            return
        device = _device_of(self.model)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.hook.local = True
            try:
                loss().backward()
            finally:
                self.hook.local = False
        for p in self.model.parameters():
            p.grad = None

    def update(self, optimizer: torch.optim.Optimizer, scaler: Any, bad: torch.Tensor) -> None:
        super().update(optimizer, scaler, bad)
        if self.hook is not None:
            self.hook.heal(bad)

    def send_flags(self, flags: torch.Tensor) -> bool:
        if self.ride is None:  # a compression hook carries the gradients: the step reduces the flags itself
            return False
        self.ride.outgoing, self.ride.incoming = flags, None
        return True

    def replica_writer(self, rank: int) -> int | None:
        return rank if self.powersgd is not None else None

    def replica_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """PowerSGD's error feedback is this rank's own compression residual, and its warm-start factors
        and random stream go with it: saved per rank, so a resume continues the compressed trajectory
        (keyed by DDP bucket, which `settle` makes the same in every process of a run)."""
        if self.powersgd is None:
            return None
        st = self.powersgd
        _, keys, pos, has_gauss, cached = st.rng.get_state()
        return {
            "iter": st.iter,
            "error_dict": dict(st.error_dict),
            "p_memory_dict": dict(st.p_memory_dict),
            "q_memory_dict": dict(st.q_memory_dict),
            "rng": {"keys": torch.from_numpy(keys.copy()), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        }

    def load_replica_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        st = self.powersgd
        st.iter = int(state["iter"])
        st.error_dict = {int(k): v.to(_device_of(self.model)) for k, v in state["error_dict"].items()}
        st.p_memory_dict = {int(k): v.to(_device_of(self.model)) for k, v in state["p_memory_dict"].items()}
        st.q_memory_dict = {int(k): v.to(_device_of(self.model)) for k, v in state["q_memory_dict"].items()}
        r = state["rng"]
        st.rng.set_state(("MT19937", r["keys"].numpy(), r["pos"], r["has_gauss"], r["cached"]))

    def restart_replica(self) -> None:
        """Without a rank's saved residual, every rank starts PowerSGD's error feedback afresh (alike)."""
        st = self.powersgd
        if st is not None:
            st.error_dict, st.p_memory_dict, st.q_memory_dict = {}, {}, {}

    def received_flags(self) -> torch.Tensor:
        if self.ride.incoming is None:
            raise RuntimeError("the flags did not travel with the gradient all-reduce (was backward run with sync?)")
        out, self.ride.incoming = self.ride.incoming, None
        return out

    @contextlib.contextmanager
    def accumulating(self, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on micro-steps that are not the last of a step."""
        if sync:
            yield
            return
        assert isinstance(self.module, DistributedDataParallel)
        with self.module.no_sync():
            yield


# PowerSGD all-reduces uncompressed for its first steps (the gradients change fast there, and its
# low-rank factors need a start); torch's default (1,000) is longer than many short runs.
POWERSGD_START_STEP = 10


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def wrap_ddp(
    loss_model: torch.nn.Module, model: torch.nn.Module, device: torch.device, world_size: int, compress: str = "none", rank: int = 4
) -> DdpWrapped:
    """DDP with the flags riding on its all-reduce, or with torch's own compression hooks
    (`dist.compress`): bf16 halves the bytes; PowerSGD sends rank-`rank` factors with error feedback."""
    ids = [device.index] if device.type == "cuda" else None
    # Gradients as views into DDP's buckets: no copy into the buckets before the all-reduce,
    # and no second copy of every gradient in memory.
    ddp = DistributedDataParallel(loss_model, device_ids=ids, gradient_as_bucket_view=True)
    if compress == "bf16":
        if collectives.backend() == "nccl":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            ddp.register_comm_hook(None, bf16_compress_hook)
        else:  # torch's hook asks for NCCL; gloo reduces bf16 too (LAN CPUs): the same arithmetic
            ddp.register_comm_hook(world_size, _bf16_gloo_hook)
        return DdpWrapped(ddp, model, None)
    if compress == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=POWERSGD_START_STEP, random_seed=0
        )
        hook = PowerSgdHook(state, serial=collectives.backend() != "nccl")
        ddp.register_comm_hook(hook, _powersgd_hook)
        return DdpWrapped(ddp, model, None, hook)
    ride = FlagRide(world_size)
    ddp.register_comm_hook(ride, _ride_hook)
    return DdpWrapped(ddp, model, ride)
