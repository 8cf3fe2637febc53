"""The hang watchdog's calibration: the longest time each section took, in RUN_DIR/hang_calibration.json, so that a
resumed run starts calibrated. Written behind the watch, never by it: RUN_DIR is on shared storage (NFS, Lustre),
and a watch blocked in a write to a mount that stopped answering, the hang it exists to name, would name nothing."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from aura_hpc.config import RunConfig
from aura_hpc.train.process import progress

CALIBRATION = "hang_calibration.json"
FACTOR = 5.0  # a section may take this many times the longest seen before it counts as hung


def read_calibration(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if k in progress.SECTIONS and isinstance(v, (int, float)) and 0 <= v < 1e6}


def stop_grace_s(cfg: RunConfig) -> int:
    """How long the agent waits for the workers after a stop signal before it kills them: the stop's checkpoint and one
    still being written before it (an asynchronous save), each given what this watch gives a checkpoint, and two steps
    to reach it. A hang meanwhile is the watch's to name (in seconds where the ranks train: `hung(stopping=True)`). A
    fixed 120 s killed the stop's checkpoint of a large model written to NFS over 1 GbE (16 GB: two minutes) mid-write."""
    if not cfg.health.hang_watch:  # nothing would end a hang meanwhile but this wait
        return 120
    calibration = read_calibration(cfg.run_dir / CALIBRATION)
    one = max(cfg.health.hang_section_floor_s, FACTOR * calibration.get("checkpoint", 0.0))
    return int(max(120.0, 2 * one + 2 * calibration.get("step", 0.0) + 30.0))


class CalibrationFile:
    """The newest calibration written by a thread of its own; one write at a time, the latest values each time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._latest: dict[str, float] | None = None
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None

    def write_behind(self, data: dict[str, float]) -> None:
        with self._lock:
            self._latest = dict(data)
            if self._writer is None:  # the writer clears it under this lock as it ends: no update waits for a next one
                self._writer = threading.Thread(target=self._write, name="aura-hang-calibration", daemon=True)
                self._writer.start()

    def flush(self, timeout: float = 5.0) -> None:
        """What is pending, written within `timeout` (the launcher's exit: a hung mount does not hold it up)."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def _write(self) -> None:
        while True:
            with self._lock:
                data, self._latest = self._latest, None
                if data is None:
                    self._writer = None
                    return
            # The host in the name: two nodes' watches on one shared run directory.
            tmp = self.path.with_name(f".{self.path.name}.{socket.gethostname()}.{os.getpid()}")
            try:
                tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError:
                tmp.unlink(missing_ok=True)
