"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded.

Each transformer block is its own shard group (gathered just before it runs, freed after), the
rest (embeddings, final norm, tied output matrix) is the root group. Under bf16 the blocks
compute in bf16 and reduce gradients in fp32. Checkpoints are torch DCP, written by every rank
(its own shard) and loadable at another world size; the full weights are gathered to rank 0
for the checkpoint's model/ folder and for text samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aura_hpc.config import DistConfig
from aura_hpc.train.runtime import Runtime
from aura_hpc.train.strategies.base import Wrapped, clip_to_total_norm


class FsdpWrapped(Wrapped):
    name = "fsdp"
    sharded = True

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__(module, model)
        self.device = device  # where the process group reduces (gradients may be offloaded to the host)

    @contextlib.contextmanager
    def accumulating(self, sync: bool) -> Iterator[None]:
        """No reduce-scatter on micro-steps that are not the last of a step."""
        self.module.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield

    def grad_norm(self, optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float) -> torch.Tensor:
        """The norm over every rank's gradient shards, then clipping of this rank's shards."""
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        return clip_to_total_norm(grads, max_norm, sharded=True, device=self.device)

    def save_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """Model and optimizer shards, one file per rank (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))

    def load_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """The reverse of save_sharded, at any world size (DCP reshards); collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def own_shard_files(self, folder: Path, rank: int) -> list[Path]:
        return sorted(folder.glob(f"__{rank}_*.distcp"))

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0's host memory ({} elsewhere); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if getattr(getattr(self.model, "config", None), "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # stored once, as transformers does
        return {k: v.detach().contiguous() for k, v in sd.items()}


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def wrap_fsdp(loss_model: torch.nn.Module, model: Any, cfg: DistConfig, rt: Runtime, world_size: int) -> FsdpWrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(rt.device.type, (world_size,))
    kw: dict[str, Any] = {"mesh": mesh}
    if rt.autocast_dtype == torch.bfloat16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw["offload_policy"] = CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, **kw)
    fully_shard(loss_model, **kw)
    return FsdpWrapped(loss_model, model, rt.device)
