"""DeepSpeed ZeRO stages 1-3 (the real engine): optimizer state (1), gradients (2) and parameters (3)
partitioned over the ranks, with our torch AdamW inside DeepSpeed's partitioned optimizer.

The engine owns accumulation (its micro-step counter), clipping (`gradient_clipping`) and the
skip of a step whose gradients are not finite (its overflow check). Checkpoints are DeepSpeed's
own, written by every rank into the checkpoint's folder; they resume at the world size they were
written at (DeepSpeed's universal checkpoints are the way to change it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from aura_hpc.config import RunConfig
from aura_hpc.config.deepspeed import deepspeed_config
from aura_hpc.train.runtime import Runtime
from aura_hpc.train.strategies.base import Wrapped

TAG = "ds"  # the one tag of each checkpoint folder


class ZeroWrapped(Wrapped):
    sharded = True
    device_skip = False

    def __init__(self, engine: Any, model: torch.nn.Module, stage: int, device: torch.device) -> None:
        super().__init__(engine, model)
        self.engine, self.stage, self.device = engine, stage, device
        self.name = f"zero{stage}"

    def backward(self, loss: torch.Tensor, scaler: Any) -> None:
        # The loss is already divided by train.grad_accum; the engine steps at its boundary.
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()

    def grad_norm(self, optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float) -> torch.Tensor:
        """DeepSpeed's norm, on this rank's device. After a skipped (non-finite) step DeepSpeed holds it
        as a Python float: it is made on the device with a fill, never as a host tensor (torch.tensor(x)
        here was a CPU tensor that the step report then concatenated with CUDA tensors)."""
        norm = self.engine.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            return norm.detach().to(self.device, torch.float32)
        return torch.full((), float("nan") if norm is None else float(norm), dtype=torch.float32, device=self.device)

    def update(self, optimizer: torch.optim.Optimizer, scaler: Any, bad: torch.Tensor) -> None:
        """Done by the engine at its accumulation boundary (a non-finite step skipped there)."""

    def save_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        self.engine.save_checkpoint(str(folder), tag=TAG, client_state={}, save_latest=False)

    def load_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        path, _ = self.engine.load_checkpoint(
            str(folder), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False, load_module_strict=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {folder}")

    def own_shard_files(self, folder: Path, rank: int) -> list[Path]:
        return sorted(folder.rglob(f"*zero_pp_rank_{rank}_*")) if rank else []

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0's host memory ({} elsewhere); collective under ZeRO-3."""
        import deepspeed
        import torch.distributed as dist

        params = list(self.model.parameters())
        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.stage == 3 else _Nothing()
        with gathered:
            if dist.get_rank() != 0:
                return {}
            out: dict[str, torch.Tensor] = {}
            seen: set[int] = set()
            for name, t in self.model.state_dict().items():
                if t.data_ptr() in seen:  # the tied output matrix: stored once
                    continue
                seen.add(t.data_ptr())
                out[name] = t.detach().to("cpu", dtype=torch.float32, copy=True).contiguous()
            return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _say_first_build(rt: Runtime) -> None:
    """DeepSpeed compiles its shared-memory op on a CPU run's first use (~1-2 min here, no output until
    "built successfully"): said before it starts, so a silent minute is not taken for a hang."""
    if rt.device.type != "cpu":
        return
    import logging
    import os

    from torch.utils.cpp_extension import _get_build_directory  # private, stable since torch 1.x

    try:
        built = any(f.endswith(".so") for f in os.listdir(_get_build_directory("deepspeed_shm_comm", verbose=False)))
    except OSError:
        built = False
    except Exception:  # a torch without this helper: say nothing rather than guess
        built = True
    if not built and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("aura_hpc").info(
            "compiling DeepSpeed's shm_comm op (first use only, ~1-2 min; cached in TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)"
        )


def wrap_zero(
    loss_model: torch.nn.Module, model: torch.nn.Module, cfg: RunConfig, rt: Runtime, world_size: int, optimizer: torch.optim.Optimizer
) -> ZeroWrapped:
    _say_first_build(rt)
    import deepspeed

    config = deepspeed_config(cfg, world_size, bf16=rt.autocast_dtype == torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=loss_model, optimizer=optimizer, config=config, dist_init_required=False)
    return ZeroWrapped(engine, model, int(cfg.dist.strategy[-1]), rt.device)
