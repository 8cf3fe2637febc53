"""Which training sequences each rank reads at each micro-step, as device tensors, one step ahead.

`prefetch()` assembles the next step's micro-batches right after the current step is queued,
so on a GPU the gathering, the pinned-memory staging and the (non-blocking) copy happen while
the GPU still computes. Batches are keyed by their first sample position: a rollback, which
moves the position, simply misses the prefetched ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from aura_hpc.data.order import batch_start
from aura_hpc.train.loop.data_feed import DataFeed
from aura_hpc.train.parts.state import Layout, Parts, Position


class Batches:
    def __init__(self, parts: Parts, layout: Layout, rank: int, device: torch.device, feed: DataFeed | None = None) -> None:
        self.data, self.order = parts.data, parts.order
        self.feed = feed
        self.layout, self.rank, self.device = layout, rank, device
        self.pin = device.type == "cuda"
        self._ready: dict[int, torch.Tensor] = {}
        folder = os.environ.get("AURA_PROBE_SAMPLES")
        self._record = self._prefetched = None
        if folder:  # what was trained on, and (a folder below) what was loaded ahead
            name = f"samples_rank{rank}_world{layout.world}.jsonl"
            (Path(folder) / "prefetched").mkdir(parents=True, exist_ok=True)
            self._record = open(Path(folder) / name, "a", encoding="utf-8")
            self._prefetched = open(Path(folder) / "prefetched" / name, "a", encoding="utf-8")

    def _start(self, pos: Position, micro: int) -> int:
        lay = self.layout
        return pos.samples_seen(lay.per_step) + batch_start(0, micro, self.rank, lay.world, lay.batch_size, lay.grad_accum)

    def _load(self, start: int) -> torch.Tensor:
        idx = self.order.indices(start, self.layout.batch_size)
        x = torch.from_numpy(self.data.sequences("train", idx))
        if self.pin:
            # Only a copy from pinned memory is truly asynchronous; from pageable memory
            # `non_blocking` still waits for the host-side staging.
            x = x.pin_memory()
        return x.to(self.device, non_blocking=True)

    def get(self, pos: Position, micro: int) -> torch.Tensor:
        """The (batch, seq_len+1) tokens this rank trains on at micro-step `micro` of the next step."""
        start = self._start(pos, micro)
        if self.feed is not None:
            self.feed.ensure(pos.samples_seen(self.layout.per_step), self.layout.per_step)
        if self._record is not None:  # AURA_PROBE_SAMPLES: which global positions and sequences were trained on
            idx = self.order.indices(start, self.layout.batch_size)
            self._record.write(json.dumps({"step": pos.step + 1, "micro": micro, "start": start, "ids": idx}) + "\n")
            self._record.flush()
        ready = self._ready.pop(start, None)
        return ready if ready is not None else self._load(start)

    def prefetch(self, pos: Position) -> None:
        """Start loading every micro-batch of the step after `pos`, if the run has one."""
        if pos.step >= self.layout.end_step:  # the end, or train.stop_at: data no step trains on (a stream encoded a window)
            return
        if self.feed is not None:
            self.feed.ensure(pos.samples_seen(self.layout.per_step), self.layout.per_step)
        self._ready = {s: self._load(s) for s in (self._start(pos, m) for m in range(self.layout.grad_accum))}
        if self._prefetched is not None:
            self._prefetched.write(json.dumps({"step": pos.step + 1, "starts": sorted(self._ready)}) + "\n")
            self._prefetched.flush()
