"""The interface every strategy offers the loop; as is, it is the single-process strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Wrapped:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module  # what the loop calls forward on

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
