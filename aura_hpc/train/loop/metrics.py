"""Metrics as JSON lines, TensorBoard events and the experiment trackers of tracking.backends (rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aura_hpc.config import RunConfig

log = logging.getLogger("aura_hpc")


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int, cfg: RunConfig | None = None, mfu_scale: float | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.mfu_scale = mfu_scale  # model FLOPs utilisation per token/s, where the GPU's peak is known
        self.drop_rows_after(resume_step)
        self._tb: Any = None
        self._tb_lock = threading.Lock()  # the monitor thread's samples against a writer being replaced or closed
        self.trackers: Any = None
        if cfg is not None:
            from aura_hpc.config.tracking import backends
            from aura_hpc.train.loop.trackers import Trackers

            self.trackers = Trackers(cfg, resume_step)  # refuses a tracker that is not installed, before any row
            self.trackers.start()
            from aura_hpc.train.process import progress

            progress.current().on_enter.append(self._section)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb_dir = run_dir / "tensorboard"
        if cfg is None or "tensorboard" in backends(cfg):
            self._tb = self._tensorboard(resume_step)

    def _tensorboard(self, step: int) -> Any:
        """A new TensorBoard event file that starts by dropping every earlier event past `step`. TensorBoard takes
        a file's session start for a restart (and purges) only after a first one: a fresh run writes it too (at
        step 1), so that the first resume drops what the crashed attempt logged past its checkpoint."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self._tb_dir), purge_step=step + 1)

    def rolled_back(self, step: int) -> None:
        """Back to a checkpoint's `step` mid-run: the steps after it are redone, so what was logged for them goes."""
        self.drop_rows_after(step)
        with self._tb_lock:  # a sample added to the closed writer made torch open a stray event file
            if self._tb is not None:
                self._tb.close()
                self._tb = self._tensorboard(step)

    def _section(self, section: str, step: int) -> None:
        if section == "checkpoint" and self.trackers is not None:
            self.trackers.checkpointed()

    def drop_rows_after(self, step: int) -> None:
        """Rows logged after the checkpoint we resume (or roll back) to describe steps that will be redone."""
        if getattr(self, "_file", None) is not None:
            self._file.flush()
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        kept = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step", 0), (int, float)) and row.get("step", 0) <= step:
                kept.append(line)
        if kept == lines and (not text or text.endswith("\n")):  # a last line cut short of its end: the next row joined it
            return
        # Written beside it and renamed over it: truncated in place, a full disk or a kill mid-write lost the whole history.
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(k + "\n" for k in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if getattr(self, "_file", None) is not None:  # a rollback: the open handle still appends to the replaced file
            self._file.close()
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if self.mfu_scale and row.get("tokens_per_s"):
            row = {**row, "mfu": round(row["tokens_per_s"] * self.mfu_scale, 4)}
        # A non-finite number (an fp16 overflow's grad_norm) as null: json.dumps wrote Infinity and NaN, which
        # strict readers (jq, JavaScript, pandas' ujson) refuse, the whole file with them.
        self._file.write(json.dumps(_finite(row)) + "\n")
        self._file.flush()
        step = int(row["step"])
        if self.trackers is not None:
            from aura_hpc.train.loop.trackers import scalars

            self.trackers.log(scalars(row), step)
        if self._tb is None:
            return
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._tb.add_scalar(f"train/{k}" if k != "eval_loss" else "eval/loss", v, step)
            elif isinstance(v, list):  # one value per rank (straggler scores): a curve per rank
                for r, x in enumerate(v):
                    if isinstance(x, (int, float)) and math.isfinite(x):
                        self._tb.add_scalar(f"{k}/rank{r}", x, step)

    def resources(self, row: dict[str, Any], step: int) -> None:
        """A resource sample (from the monitor thread) as TensorBoard scalars at the current step."""
        if self.trackers is not None:
            from aura_hpc.train.loop.trackers import scalars

            self.trackers.log(scalars(row, "resources/"), step)
        with self._tb_lock:
            if self._tb is None:
                return
            for k, v in row.items():
                if k not in ("time",) and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"resources/{k}", v, step)
            for g in row.get("gpus", []):
                for k, v in g.items():
                    if k != "index" and isinstance(v, (int, float)) and math.isfinite(v):
                        self._tb.add_scalar(f"gpu{g.get('index', 0)}/{k}", v, step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self, failed: bool = False) -> None:
        """Every row flushed (TensorBoard's writer may hold two minutes of them) and the trackers finished
        (their thread, never joined otherwise, dies with the process); again later, nothing. `failed`: the
        run ends on an error."""
        # Each part on its own: a full disk failing TensorBoard's flush must not cost the trackers their end,
        # nor the run its own exit status and line.
        with self._tb_lock:
            tb, self._tb = self._tb, None
        for part, close in (("metrics.jsonl", self._file.close), ("TensorBoard", tb.close if tb is not None else None)):
            try:
                if close is not None:
                    close()
            except Exception as exc:
                log.warning("%s could not be closed (%s)", part, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            try:
                trackers.finish(failed)
            except Exception as exc:
                log.warning("tracking: the trackers could not finish (%s)", type(exc).__name__)


@dataclass
class Interval:
    """What the next metrics row reports: the mean loss of the good steps since the last row, and
    the throughput of the steps timed since the clock last started (compilation, evaluation and
    checkpoints stay outside it)."""

    loss: float = 0.0
    steps: int = 0
    tokens: int = 0
    timed_steps: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: float, tokens: int) -> None:
        self.loss += loss
        self.steps += 1
        self.tokens += tokens
        self.timed_steps += 1

    def restart_clock(self) -> None:
        self.tokens, self.timed_steps, self.start = 0, 0, time.perf_counter()

    def reset(self) -> None:
        self.loss, self.steps = 0.0, 0
        self.restart_clock()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
