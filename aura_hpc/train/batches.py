"""Which training sequences each rank reads at each micro-step, as device tensors."""

from __future__ import annotations

import torch

from aura_hpc.data.packed import batch_start
from aura_hpc.train.state import Layout, Parts, Position


class Batches:
    def __init__(self, parts: Parts, layout: Layout, rank: int, device: torch.device) -> None:
        self.data, self.order = parts.data, parts.order
        self.layout, self.rank, self.device = layout, rank, device

    def get(self, pos: Position, micro: int) -> torch.Tensor:
        """The (batch, seq_len+1) tokens this rank trains on at micro-step `micro` of the next step."""
        lay = self.layout
        start = pos.samples_seen(lay.per_step)
        start += batch_start(0, micro, self.rank, lay.world, lay.batch_size, lay.grad_accum)
        idx = self.order.indices(start, lay.batch_size)
        x = torch.from_numpy(self.data.sequences("train", idx))
        return x.to(self.device, non_blocking=True)
