"""One copy of the model as the parameter server and its workers hold it: the same GPT-2, data and
loss as `local`, with its parameters (and their gradients) as one flat tensor for the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aura_hpc.config import RunConfig
from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.packed import PackedTokens
from aura_hpc.errors import ConfigError, DataError
from aura_hpc.train.parts.build import model_and_loss, open_data
from aura_hpc.train.parts.state import Parts
from aura_hpc.train.process.runtime import Runtime, precision_dtypes
from aura_hpc.train.strategies.base import clip_to_total_norm


@dataclass
class ModelCopy:
    data: PackedTokens
    order: GlobalOrder
    model: Any  # the transformers model (what checkpoints save)
    loss_model: torch.nn.Module
    rt: Runtime

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def flat_weights(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.params).detach().to("cpu", dtype)

    def load_flat_weights(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat.to(self.rt.device, self.rt.param_dtype), self.params)

    def flat_grads(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in self.params]).to(
            "cpu", dtype
        )

    def set_grads(self, flat: torch.Tensor, scale: float) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype) * scale
            offset += n

    def parts(self, optimizer: Any, scheduler: Any) -> Parts:
        """The view of this copy that evaluation and samples take (train/parts/state.py)."""
        return Parts(self.data, self.order, self.model, self.loss_model, self.numel, optimizer, scheduler, None)

    def apply(self, flat: torch.Tensor, scale: float, optimizer: Any, scheduler: Any, clip: float) -> float:
        """One optimizer step with `flat` as the gradient, at `scale` of the learning rate: the parameter server's
        update. The learning rate it was taken at (before the schedule's step), for the metrics row."""
        self.set_grads(flat.float(), 1.0)
        grads = [p.grad for p in self.params if p.grad is not None]
        if clip > 0:  # the clipping `local` does (fp64 norm over every gradient), before the staleness weight:
            clip_to_total_norm(grads, clip)  # after it, a late gradient over the limit was clipped back to full size
        # The staleness weight scales this step's learning rate, not the gradient: AdamW divides by the gradients' running
        # size, so a gradient scaled by 1/(1+s) moved the weights as far as a fresh one (50 steps at 0.5: within 3e-8).
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups if scale != 1.0 else ():
            group["lr"] = group["lr"] * scale
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(rates[0])

    def shard_batch(self, shard: int, shards: int, position: int, count: int) -> torch.Tensor:
        """`count` sequences of worker shard `shard` (0-based) of `shards`, from its `position`-th one:
        the global sample order dealt round-robin, so the shards never overlap."""
        idx = [self.order.indices((position + i) * shards + shard, 1)[0] for i in range(count)]
        return torch.from_numpy(self.data.sequences("train", idx)).to(self.rt.device)


def build_model_copy(cfg: RunConfig, device: torch.device) -> ModelCopy:
    """Data and model built by `local`'s builder from this config (the same seed gives the same start)."""
    if cfg.data.stream:
        raise ConfigError(
            "the parameter server deals out the sequences of a prepared directory; data.stream=true has none "
            "(fix: `python -m aura_hpc prepare` the text and --set data.stream=false data.path=DIR)"
        )
    torch.manual_seed(cfg.train.seed)
    data = open_data(cfg)
    param_dtype, autocast_dtype = precision_dtypes(cfg.train.precision, device)
    rt = Runtime(device, "none", param_dtype, autocast_dtype)
    model, loss_model, _ = model_and_loss(cfg, rt, data, "ps", 1)
    return ModelCopy(data, GlobalOrder(data.counts("train"), cfg.train.seed, cfg.data.shuffle_window), model, loss_model, rt)


def check_shard_size(data: PackedTokens, shards: int, per_gradient: int) -> None:
    n = data.num_sequences("train")
    if n // shards < per_gradient:
        raise DataError(
            f"the prepared data has {n} training sequences: split over {shards} workers, a shard holds {n // shards}, "
            f"fewer than one gradient's batch of {per_gradient} (fix: more data, fewer --workers, or a smaller "
            "train.batch_size/data.seq_len)"
        )
