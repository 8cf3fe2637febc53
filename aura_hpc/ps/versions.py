"""What the parameter server does at a version's cadence: its metrics row, evaluations and checkpoints (most of them
off the update lock: ps/off_lock.py). A part of `ParameterServer` (ps/server.py), kept apart to keep each small."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from aura_hpc.config import RunConfig, TrainConfig
from aura_hpc.errors import AuraError, TrainingFailed
from aura_hpc.ps import ledger, wire
from aura_hpc.ps.model_copy import ModelCopy
from aura_hpc.ps.off_lock import Cancelled, OffLock, Shadow, Snapshot, take
from aura_hpc.ps.stats import ProcessStats, write_server_stats
from aura_hpc.train.instruments import faults
from aura_hpc.train.loop.evaluation import evaluate
from aura_hpc.train.loop.metrics import MetricsWriter
from aura_hpc.train.parts.state import Parts
from aura_hpc.train.process.worker_log import to_file_only

log = logging.getLogger("aura_hpc")


class VersionWork:
    """The server's state these methods read and write (set by ParameterServer.__init__ and serve)."""

    cfg: RunConfig
    t: TrainConfig
    p: Any
    lock: threading.Lock
    model_copy: ModelCopy
    optimizer: Any
    scheduler: Any
    version: int
    tokens: int
    positions: dict[int, int]
    best_eval: float | None
    hist: Counter[str]
    seats: dict[int, Any]
    left: list[dict[str, Any]]
    closed: wire.Traffic
    stats: ProcessStats
    metrics: MetricsWriter
    interval: ledger.Interval
    interval_start: float
    trained_lr: float
    saved_version: int
    saved_at: float
    pending_eval: tuple[int, float] | None
    final_row: dict[str, Any] | None
    fatal: AuraError | None
    stopping: bool
    shadow: Shadow
    off_lock: OffLock

    def _after_update(self) -> None:
        """Logging at its cadence (under the lock); evaluations and checkpoints off it (ps/off_lock.py). The last version's
        are _finish's, once the workers have their stop (here, under the lock, they outlasted the workers' timeout)."""
        t, v = self.t, self.version
        if v >= t.max_steps:  # its row's figures now (the workers still counted), its evaluation added by _finish
            self.final_row = ledger.metrics_row(
                v, self.trained_lr, self.interval, time.perf_counter() - self.interval_start, len(self.seats), self.hist
            )
            return
        evaluating = bool(t.eval_every and v % t.eval_every == 0)
        if (t.log_every and v % t.log_every == 0) or evaluating:
            self._log_row(None)
        due = t.checkpoint_every_s > 0 and time.monotonic() - self.saved_at >= t.checkpoint_every_s  # by time too, as `local` does
        saving = bool(t.checkpoint_every and v % t.checkpoint_every == 0) or due
        if evaluating or saving:
            figures = {"tokens": self.tokens, "positions": dict(self.positions), "hist": Counter(self.hist)}
            self.off_lock.submit(take(self.model_copy, self.optimizer, self.scheduler, v, evaluating, saving, figures))
            self.saved_at = time.monotonic() if saving else self.saved_at

    def _evaluate_and_save(self, snap: Snapshot) -> None:
        """On the off-lock thread: a snapshot's evaluation (its loss in the next metrics row) and checkpoint. A failed
        evaluation is said and training goes on; a failed checkpoint stops the server, as it did."""
        parts = self.shadow.parts(snap.flat)
        loss = None
        try:
            if snap.evaluate:
                if faults.slow_evaluation(self.shadow.cancel):
                    raise Cancelled
                loss = evaluate(parts, self.t, 0, 1, self.model_copy.rt)
        except Cancelled:
            log.info("the evaluation of version %d was cut short by the stop", snap.version)
            return
        except Exception as exc:
            to_file_only(f"the evaluation of version {snap.version} failed")
            log.warning("the evaluation of version %d failed (%s: %s); training goes on", snap.version, type(exc).__name__, str(exc)[:160])
        try:
            with self.lock:
                if loss is not None:
                    self.best_eval = loss if self.best_eval is None or loss < self.best_eval else self.best_eval
                    # In the next row (rows keep their versions in order: W&B drops a step that goes back), with the
                    # version whose weights it measured: updates went on while it ran.
                    self.pending_eval = (snap.version, loss)
                    log.info("version %d/%d eval %.4f (evaluated off the update lock)", snap.version, self.t.max_steps, loss)
                best = self.best_eval
            if snap.save:
                f = snap.ledger
                meta = ledger.meta(f["tokens"], f["positions"], best, f["hist"], self.t.max_steps, self.p.workers, loss)
                path = ledger.save_state(self.cfg, parts.model, self.model_copy.data.tokenizer_dir, snap.state, snap.version, meta)
                with self.lock:
                    self.saved_version = max(self.saved_version, snap.version)
                    self._write_own_stats()
                log.info("checkpoint %s (last%s)", path.name, ", best" if loss is not None and loss == best else "")
        except Exception as exc:  # a full disk (CheckpointWriteError): the server stops, as it did
            to_file_only(f"the checkpoint of version {snap.version} failed")
            with self.lock:
                failed = TrainingFailed(f"the checkpoint of version {snap.version} failed ({type(exc).__name__}: {str(exc)[:160]})")
                self.fatal, self.stopping = (exc if isinstance(exc, AuraError) else failed), True

    def _parts(self) -> Parts:
        return self.model_copy.parts(self.optimizer, self.scheduler)

    def _evaluate(self) -> float | None:
        faults.slow_evaluation()
        loss = evaluate(self._parts(), self.t, 0, 1, self.model_copy.rt)
        if loss is not None and (self.best_eval is None or loss < self.best_eval):
            self.best_eval = loss
        return loss

    def _log_row(self, eval_loss: float | None, row: dict[str, Any] | None = None) -> None:
        now = time.perf_counter()
        row = row or ledger.metrics_row(self.version, self.trained_lr, self.interval, now - self.interval_start, len(self.seats), self.hist)
        if eval_loss is not None:
            row["eval_loss"], row["eval_version"] = eval_loss, self.version
        elif self.pending_eval is not None:
            row["eval_version"], row["eval_loss"] = self.pending_eval
        self.pending_eval = None
        self.metrics.write(row)
        log.info("%s", ledger.progress_line(row, self.t.max_steps, self.hist))
        self.interval = ledger.Interval()
        self.interval_start = now

    def _save(self, eval_loss: float | None) -> None:
        meta = ledger.meta(self.tokens, self.positions, self.best_eval, self.hist, self.t.max_steps, self.p.workers, eval_loss)
        path = ledger.save(self.cfg, self.model_copy, self.optimizer, self.scheduler, self.version, meta)
        self.saved_version, self.saved_at = self.version, time.monotonic()
        self._write_own_stats()
        log.info("checkpoint %s (last%s)", path.name, ", best" if eval_loss is not None and eval_loss == self.best_eval else "")

    def _write_own_stats(self) -> None:
        links = [self.closed, *(seat.link for seat in list(self.seats.values()) if seat.link is not None)]
        extra = {"staleness": dict(self.hist), "workers_left": self.left[-20:], "max_staleness": self.p.max_staleness}
        write_server_stats(self.stats, self.cfg.run_dir, self.version, self.tokens, links, extra)
