"""DeepSpeed ZeRO stages 1-3 (the real engine): optimizer state (1), gradients (2) and parameters (3)
partitioned over the ranks, with our torch AdamW inside DeepSpeed's partitioned optimizer.

The engine owns accumulation (its micro-step counter) and clipping (`gradient_clipping`); the skip
of a step whose gradients are not finite is ours (zero_skip.py: DeepSpeed skips only under fp16),
on the step of the torch AdamW it drives. Checkpoints are DeepSpeed's
own, written by every rank into the checkpoint's folder (with train.async_checkpoint, from a
host copy by a background thread: train/checkpoint/background_shards.py); they resume at the world size they
were written at (DeepSpeed's universal checkpoints are the way to change it).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import RunConfig
from aura_hpc.config.deepspeed import deepspeed_config
from aura_hpc.errors import CheckpointError
from aura_hpc.train.checkpoint.background_shards import FailureKept, ShardWriter
from aura_hpc.train.model.meta_init import build_on_meta
from aura_hpc.train.process.deepspeed_import import quiet_deepspeed
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.strategies.base import ShardedCheckpoints, Wrapped
from aura_hpc.train.strategies.zero_skip import GroupNormWatch, NonFiniteSkip, guard_bf16_step

TAG = "ds"  # the one tag of each checkpoint folder


class ZeroWrapped(Wrapped, ShardedCheckpoints):
    background_shards = True
    reshards = False

    def __init__(self, engine: Any, model: torch.nn.Module, stage: int, device: torch.device) -> None:
        super().__init__(engine, model)
        self.engine, self.stage, self.device = engine, stage, device
        self.name = f"zero{stage}"
        self._shards = ShardWriter(device)
        zero_optimizer = engine.optimizer
        inner = [getattr(zero_optimizer, "optimizer", None), getattr(zero_optimizer, "backup_optimizer", None)]
        self._groups = GroupNormWatch(zero_optimizer, device)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=device)  # this step's micro-steps so far
        self._skips = [NonFiniteSkip(o, device, zero_optimizer, self._groups) for o in inner if isinstance(o, torch.optim.Optimizer)]
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        if isinstance(zero_optimizer, BF16_Optimizer):
            guard_bf16_step(zero_optimizer, self._groups)

    def backward(self, loss: torch.Tensor, scaler: Any) -> None:
        # The loss is already divided by train.grad_accum; the engine steps at its boundary, inside
        # this call, before the loop's flags are agreed: a non-finite loss of any micro-step joins the
        # verdict NonFiniteSkip agrees on (an inf loss can come with finite gradients: a target's
        # log-probability underflowing to zero), so the update is skipped as the log says.
        boundary = self.engine.is_gradient_accumulation_boundary()
        self._loss_bad = self._loss_bad | ~torch.isfinite(loss.detach()).to(self.device)
        self._groups.reset()  # the groups' norms are computed in the boundary's engine.step()
        self._groups.bad = self._groups.bad | self._loss_bad
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()
        if boundary:
            self._loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)

    def local_weights(self) -> list[torch.Tensor]:
        """ZeRO-3 leaves each parameter an empty placeholder: this rank's partition is `ds_tensor`, its real
        elements only. DeepSpeed pads a partition to numel / world rounded up, allocated with torch.empty and
        never written: read whole, a NaN pattern in the padding refused every checkpoint of the run."""
        if self.stage != 3:
            return super().local_weights()
        import torch.distributed as dist

        out = []
        for p in self.model.parameters():
            part = getattr(p, "ds_tensor", None)
            if part is None:
                out.append(p)
                continue
            n = int(part.ds_numel)
            real = int(p.ds_numel) - n * dist.get_rank(group=p.ds_process_group)
            out.append(part.narrow(0, 0, max(0, min(n, real))))
        return out

    def grad_norm(self, optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float) -> torch.Tensor:
        """DeepSpeed's norm, on this rank's device. After a skipped (non-finite) step DeepSpeed holds it
        as a Python float: it is made on the device with a fill, never as a host tensor (the step report
        concatenates it with the other device tensors)."""
        norm = self.engine.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            out = norm.detach().to(self.device, torch.float32)
        else:
            out = torch.full((), float("nan") if norm is None else float(norm), dtype=torch.float32, device=self.device)
        # A skipped step reports a NaN norm (DeepSpeed masks a non-finite one to -1), so that every
        # rank logs it as such.
        skipped = out < 0
        for guard in self._skips:
            skipped = skipped | guard.take_skipped()
        return torch.where(skipped, torch.full_like(out, float("nan")), out)

    def update(self, optimizer: torch.optim.Optimizer, scaler: Any, bad: torch.Tensor) -> None:
        """Done by the engine at its accumulation boundary (a non-finite step skipped there by NonFiniteSkip)."""

    def save_sharded(self, folder: Path, optimizer: torch.optim.Optimizer, background: bool = False) -> Future[dict[str, str]] | None:
        """DeepSpeed's save (collective). In the background its files are copied to host memory here
        and written by a thread; the future gives every rank's file hashes once all are written."""
        if not background:
            kept = FailureKept(self.engine.checkpoint_engine, folder.parent.parent.parent)
            self.engine.checkpoint_engine = kept
            try:
                self.engine.save_checkpoint(str(folder), tag=TAG, client_state={}, save_latest=False)
            finally:
                self.engine.checkpoint_engine = kept.inner
            if kept.failure is not None:
                raise kept.failure
            return None
        captured = self._shards.capture(self.engine.checkpoint_engine, folder.parent.parent.parent)
        self.engine.checkpoint_engine = captured
        try:
            self.engine.save_checkpoint(str(folder), tag=TAG, client_state={}, save_latest=False)
        finally:
            self.engine.checkpoint_engine = captured.inner
        return self._shards.write(captured, folder.parent)

    def load_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        from aura_hpc.train.checkpoint.data_only import check_deepspeed_files, deepspeed_loads_as_data

        world = collectives.world()
        try:  # the message that names the file; DeepSpeed's loads then read data only
            check_deepspeed_files(folder, (world.rank, world.size))
            mine = None
        except CheckpointError as exc:
            mine = str(exc)
        except OSError as exc:  # listing the folder (EIO, ESTALE): said on every rank, none left waiting in the gather
            mine = f"{folder}: the storage could not list it ({exc.strerror or type(exc).__name__}) (fix: check the mount, then run again)"
        if problems := [p for p in collectives.gather_json(mine) if p]:
            raise CheckpointError(problems[0])  # on every rank: none goes on into DeepSpeed's collective load alone
        with deepspeed_loads_as_data(folder):
            path, _ = self.engine.load_checkpoint(
                str(folder), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False, load_module_strict=True
            )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {folder}")
        # The overflow flag comes back with the optimizer's state: a checkpoint written where DeepSpeed skipped its
        # step itself (bf16 before its check was turned off: config/deepspeed.py) says True, and with the check
        # off nothing would clear it: every later step returned early, skipped unsaid.
        if hasattr(self.engine.optimizer, "overflow"):
            self.engine.optimizer.overflow = False
        # The clipping threshold comes back too: a train.grad_clip changed for the resume (the rollback's advice) was ignored.
        if hasattr(self.engine.optimizer, "clip_grad"):
            self.engine.optimizer.clip_grad = self.engine.gradient_clipping()

    def own_shard_files(self, folder: Path, rank: int) -> list[Path]:
        return sorted(folder.rglob(f"*zero_pp_rank_{rank}_*")) if rank else []

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 master weights on rank 0's host memory ({} elsewhere); collective.

        The masters, not the module's values: under bf16 DeepSpeed trains a bf16 copy of the module
        and keeps the fp32 weights in its optimizer (what its checkpoints, and checkpoint/consolidate.py, hold).
        One parameter at a time, every rank in the same order: no rank ever holds more than one
        whole parameter beyond its partition."""
        import torch.distributed as dist
        from deepspeed.utils import safe_get_full_fp32_param

        main = not dist.is_initialized() or dist.get_rank() == 0
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, param in self.model.named_parameters():  # a tied matrix appears once
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = safe_get_full_fp32_param(param)  # None for a frozen parameter: no master, the module's value is it
            if full is None:
                full = self._working_value(param)
            if main:
                out[name] = full.detach().to("cpu", dtype=torch.float32, copy=True).contiguous()
            del full
        if main:  # persistent buffers (what a state dict holds), each in its own kind of dtype
            for prefix, module in self.model.named_modules():
                for name, buf in module.named_buffers(recurse=False):
                    if buf is not None and name not in module._non_persistent_buffers_set:
                        dtype = torch.float32 if buf.is_floating_point() else buf.dtype
                        key = f"{prefix}.{name}" if prefix else name
                        out.setdefault(key, buf.detach().to("cpu", dtype=dtype, copy=True).contiguous())
        return out

    def _working_value(self, param: torch.Tensor) -> torch.Tensor:
        if self.stage != 3:
            return param.detach()
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().clone()


def build_partitioned(factory: Callable[[], torch.nn.Module], cfg: RunConfig, rt: Runtime, world_size: int) -> torch.nn.Module | None:
    """ZeRO-3: the model made under DeepSpeed's `zero.Init`, each module's parameters partitioned over
    the ranks as soon as the module exists, so no rank ever holds the whole model. The constructor's
    own initialisation then touches empty tensors; the weights come from replaying what the same
    constructor did on the meta device (train/model/meta_init.py), each rank writing its own partition of one
    parameter at a time: the same bits as a model built whole. None when the constructor cannot be replayed (build it whole)."""
    built = build_on_meta(factory)
    if built is None:
        return None
    record = built[1]
    quiet_deepspeed(needed=True)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # As deepspeed.initialize does: DeepSpeed's comm on our process group, before the config is read
    # (it takes the world size from there, 1 otherwise, and then refuses the batch arithmetic).
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False)
    config = _config(cfg, rt, world_size)
    # zero.Init would otherwise replace torch.nn.functional.linear for the rest of the process with
    # its own autograd function (other gradient bits than zero1/2 and ddp, every later F.linear
    # caught); the user's JSON may still ask for it.
    config["zero_optimization"] = {"memory_efficient_linear": False, **config["zero_optimization"]}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = factory()
    record.materialize(model, rt.param_dtype, _place_partition)
    return model


def _config(cfg: RunConfig, rt: Runtime, world_size: int) -> dict:
    """The one DeepSpeed config of this run, for zero.Init and for initialize alike."""
    return deepspeed_config(cfg, world_size, bf16=rt.autocast_dtype == torch.bfloat16, on_cpu=rt.device.type == "cpu")


def _place_partition(param: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's elements of `value` written into its partition, without communication: DeepSpeed's
    layout gives rank r elements [r*n, (r+1)*n) of the flattened parameter (n = the partition's size,
    the last one padded). Where that layout does not hold alone (hpZ's secondary copies, NVMe,
    a parameter held whole) the parameter is gathered and written from rank 0 instead."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    part = getattr(param, "ds_tensor", None)
    plain = (
        part is not None
        and param.ds_status == ZeroParamStatus.NOT_AVAILABLE
        and getattr(param, "ds_secondary_tensor", None) is None
        and getattr(part, "final_location", None) is None
    )
    if not plain:
        _place_gathered(param, value)
        return
    n = int(part.ds_numel)
    start = n * dist.get_rank(group=param.ds_process_group)
    mine = value.reshape(-1)[start : start + n]
    with torch.no_grad():
        part.narrow(0, 0, mine.numel()).copy_(mine)


def _place_gathered(param: torch.Tensor, value: torch.Tensor) -> None:
    """Every rank replays the same values; rank 0's copy is the one DeepSpeed re-partitions."""
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            param.copy_(value)


def wrap_zero(
    loss_model: torch.nn.Module, model: torch.nn.Module, cfg: RunConfig, rt: Runtime, world_size: int, optimizer: torch.optim.Optimizer
) -> ZeroWrapped:
    quiet_deepspeed(needed=True)
    import deepspeed

    config = _config(cfg, rt, world_size)
    engine, *_ = deepspeed.initialize(model=loss_model, optimizer=optimizer, config=config, dist_init_required=False)
    return ZeroWrapped(engine, model, int(cfg.dist.strategy[-1]), rt.device)
