"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded.

Each transformer block is its own shard group (gathered just before it runs, freed after), the
rest (embeddings, final norm, tied output matrix) is the root group. Under bf16 the blocks
compute in bf16 and reduce gradients in fp32. Checkpoints are torch DCP, written by every rank
(its own shard; in the background with train.async_checkpoint) and loadable at another world
size; the full weights are gathered to rank 0 for a run's last checkpoint and for text samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from aura_hpc.config import DistConfig
from aura_hpc.config.device import fsdp_on_cpu
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.strategies.base import ShardedCheckpoints, Wrapped, clip_to_total_norm


class FsdpWrapped(Wrapped, ShardedCheckpoints):
    name = "fsdp"
    background_shards = True
    reshards = True

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__(module, model)
        self.device = device  # where the process group reduces (gradients may be offloaded to the host)
        self._writer: Any = None  # DCP's writer for background saves, with its staging buffers
        self._layout: list[tuple[str, tuple[str, ...]]] = []  # what those buffers were shaped for
        self._group: Any = None

    @contextlib.contextmanager
    def accumulating(self, sync: bool) -> Iterator[None]:
        """No reduce-scatter on micro-steps that are not the last of a step."""
        self.module.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield

    def grad_norm(self, optimizer: torch.optim.Optimizer, scaler: Any, max_norm: float) -> torch.Tensor:
        """The norm over every rank's gradient shards, then clipping of this rank's shards."""
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        return clip_to_total_norm(grads, max_norm, sharded=True, device=self.device)

    def save_sharded(self, folder: Path, optimizer: torch.optim.Optimizer, background: bool = False) -> Future[Any] | None:
        """Model and optimizer shards, one file per rank (collective).

        In the background: this rank's shards are copied to host memory here (into pinned buffers
        kept from save to save on a GPU), then DCP's thread writes them, coordinating the ranks over
        a gloo group of its own so that it never interleaves with training's collectives. The
        future resolves on every rank once all shards and DCP's metadata are written.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, optimizer)
        state = {"model": msd, "optim": osd}
        if not background:
            dcp.save(state, checkpoint_id=str(folder))
            return None
        if self._group is None:
            from aura_hpc.comm import collectives

            self._group = collectives.new_group("dcp", host_only=True).pg
        # The optimizer's state appears at its first step: buffers shaped before then cannot take it.
        layout = sorted((str(k), tuple(sorted(v))) for k, v in osd.get("state", {}).items())
        if self._writer is None or layout != self._layout:
            self._writer = staging_writer(folder, self.device.type == "cuda", next(iter(self.model.parameters())))
            self._layout = layout
        return dcp.async_save(state, checkpoint_id=str(folder), storage_writer=self._writer, process_group=self._group)

    def load_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """The reverse of save_sharded, at any world size (DCP reshards); collective."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from aura_hpc.train.checkpoint.data_only import load_dcp

        msd, osd = get_state_dict(self.model, optimizer)
        state = {"model": msd, "optim": osd}
        load_dcp(state, folder)
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


def staging_writer(folder: Path, gpu: bool, sample: Any) -> Any:
    """DCP's writer of background saves. On a GPU it stages into pinned host buffers kept from save to save, where that
    cache copies DTensors: torch 2.6's kept the live ones (`# TODO: support DTensor`), so its thread wrote shards the
    next steps were changing, a checkpoint of no one step (its checksums over what was written). No copy ahead: the
    staged state is on the host, and DCP's overlapping loader synchronised the writer thread's current device, cuda:0
    on every rank (a CUDA context of each rank on GPU 0)."""
    import torch.distributed.checkpoint as dcp

    cache = gpu and _cache_copies_dtensors(folder, sample)
    return dcp.FileSystemWriter(str(folder), cache_staged_state_dict=cache, per_thread_copy_ahead=0)


def _cache_copies_dtensors(folder: Path, sample: Any) -> bool:
    """Whether staging's cache holds a copy of a DTensor like `sample` (a parameter), not the DTensor itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Replicate

    mesh = sample.device_mesh
    probe = DTensor.from_local(torch.zeros(1, dtype=sample.dtype, device=sample.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
    staged = dcp.FileSystemWriter(str(folder), cache_staged_state_dict=True).stage({"probe": probe})["probe"]
    return staged is not probe and staged.device.type == "cpu"


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def wrap_fsdp(
    loss_model: torch.nn.Module, model: Any, cfg: DistConfig, rt: Runtime, world_size: int, materialize: Any = None
) -> FsdpWrapped:
    """`model` inside `loss_model`, each block its own shard group. A model on the meta device gets
    its storage here, each rank only its shards, and its weights from `materialize`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if rt.device.type == "cpu":
        fsdp_on_cpu(torch.__version__)  # a Slurm job's image may hold another torch than the login node
    mesh = init_device_mesh(rt.device.type, (world_size,))
    kw: dict[str, Any] = {"mesh": mesh}
    if rt.autocast_dtype == torch.bfloat16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw["offload_policy"] = CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, **kw)
    fully_shard(loss_model, **kw)
    if materialize is not None:
        # Offloaded shards live in host memory (where CPUOffloadPolicy expects them), the others on the device.
        loss_model.to_empty(device="cpu" if cfg.fsdp_cpu_offload else rt.device)
        materialize(model)
    return FsdpWrapped(loss_model, model, rt.device)
