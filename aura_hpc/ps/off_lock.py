"""The parameter server's evaluations and checkpoints, off the update lock.

Under the lock every worker's thread takes, an evaluation of gpt2-small's 320 sequences on the server's CPU took
minutes (7 s a sequence on 2 cores): each worker's wait for its weights ran out (ps.worker_timeout_s), every rejoin
waited on the same lock, and every worker left. Now the lock is held only to copy what is evaluated and saved (the
weights, and for a checkpoint the optimizer's and schedule's state and the ledger's figures); one thread of its own
evaluates and saves that copy on a model of its own while the updates go on. The last version's evaluation and save
stay where they were (the workers are stopping then).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("aura_hpc")


@dataclass
class Snapshot:
    """What one version's evaluation and checkpoint read, copied under the lock."""

    version: int
    flat: torch.Tensor  # fp32 weights
    evaluate: bool
    save: bool
    state: dict[str, Any] = field(default_factory=dict)  # optimizer and scheduler state (a checkpoint's)
    ledger: dict[str, Any] = field(default_factory=dict)  # tokens, positions, staleness: the checkpoint's meta


def take(model_copy: Any, optimizer: Any, scheduler: Any, version: int, evaluate: bool, save: bool, ledger: dict[str, Any]) -> Snapshot:
    """The copy (under the lock): milliseconds to a second for gpt2-small's weights and Adam state, not an evaluation."""
    snap = Snapshot(version, model_copy.flat_weights(torch.float32), evaluate, save)  # a new tensor (torch.cat)
    if save:
        snap.state = copy.deepcopy({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})
        snap.ledger = copy.deepcopy(ledger)
    return snap


class OffLock:
    """One thread that evaluates and saves snapshots, newest first: a snapshot handed over while the last one is still
    being worked on replaces a waiting one (what either asked for is done on the newer weights)."""

    def __init__(self, work: Callable[[Snapshot], None]) -> None:
        self._work = work
        self._cv = threading.Condition()
        self._waiting: Snapshot | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="aura-ps-eval-save", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> None:
        with self._cv:
            waiting = self._waiting
            if waiting is not None and waiting.save and not snap.save:
                waiting.evaluate = waiting.evaluate or snap.evaluate  # the checkpoint's weights and state belong together
            else:
                if waiting is not None:
                    snap.evaluate = snap.evaluate or waiting.evaluate
                self._waiting = snap
            self._cv.notify_all()

    def drain(self, drop_waiting: bool = False) -> None:
        """Wait for the snapshot being worked on (and the waiting one, unless `drop_waiting`: a stop saves anew)."""
        with self._cv:
            if drop_waiting:
                self._waiting = None
            if self._busy or self._waiting is not None:
                log.info("waiting for the evaluation or checkpoint in progress")
            while self._busy or self._waiting is not None:
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._waiting is None and not self._closed:
                    self._cv.wait()
                if self._waiting is None:
                    return
                snap, self._waiting, self._busy = self._waiting, None, True
            try:
                self._work(snap)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


class Cancelled(Exception):
    """A stop cut an evaluation short."""


class _Cancellable(torch.nn.Module):
    """The shadow's loss, checking before each batch whether a stop asked to cut the evaluation short."""

    def __init__(self, loss: torch.nn.Module, cancel: threading.Event) -> None:
        super().__init__()
        self.loss, self.cancel = loss, cancel

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.cancel.is_set():
            raise Cancelled
        return self.loss(batch)  # type: ignore[no-any-return]


class Shadow:
    """A model of the evaluator's own (the server's is updated while it evaluates), made before any worker joins (its
    gradients none), loaded with each snapshot's weights. `cancel` cuts an evaluation short at its next batch."""

    def __init__(self, model_copy: Any) -> None:
        self.model_copy = model_copy
        self.cancel = threading.Event()
        self._loss = copy.deepcopy(model_copy.loss_model)
        for p in self._loss.parameters():
            p.grad = None

    def parts(self, flat: torch.Tensor) -> Any:
        from aura_hpc.train.parts.state import Parts

        mc = self.model_copy
        model = self._loss.lm
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat.to(mc.rt.device, mc.rt.param_dtype), list(model.parameters()))
        return Parts(mc.data, mc.order, model, _Cancellable(self._loss, self.cancel), mc.numel, None, None, None)
