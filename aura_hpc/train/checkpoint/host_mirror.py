"""Host buffers a checkpoint's tensors are copied into, reused from one save to the next.

Copied tensor by tensor into freshly allocated pageable memory, every copy from a GPU is a
synchronous transfer (and gpt2-1b's state ~12.7 GB of allocations per save). Here the buffers are
pinned once, filled by non-blocking copies, and the save waits once for all of them. The background
writer reads them while training goes on; the next save waits for that writer before refilling.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class HostMirror:
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._pending_cuda = False

    def copy(self, obj: Any, path: str = "") -> Any:
        """`obj` with every tensor replaced by its host buffer (filled without blocking)."""
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self.buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.device.type == "cuda")
                self.buffers[path] = buf
            cuda = src.device.type == "cuda"
            buf.copy_(src, non_blocking=cuda)
            self._pending_cuda |= cuda
            return buf
        if isinstance(obj, dict):
            return {k: self.copy(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, f"{path}/{i}") for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def ready(self) -> None:
        """Wait once for every copy queued since the last call (one synchronisation per save)."""
        if self._pending_cuda:
            torch.cuda.synchronize()
            self._pending_cuda = False
