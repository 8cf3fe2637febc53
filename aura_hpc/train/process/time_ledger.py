"""Where this attempt's time went, by section: rank 0 keeps it in RUN_DIR/goodput/ for the launcher's
goodput ledger (launch/goodput.py), which adds the hangs and restarts only it sees.

The progress page (progress.py) already knows every section change; the ledger adds up the time
between them (a subtraction and an addition, no syscall) and writes a small JSON file when a
checkpoint section ends, at the end, and at most every WRITE_EVERY_S otherwise: a killed attempt
leaves its figures up to its last write, and the steps since its last checkpoint, which a restart
trains again, are told apart from the ones it kept.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

LAUNCH_ENV = "AURA_LAUNCH_ID"  # the launcher's ledger this attempt belongs to
FOLDER = "goodput"
WRITE_EVERY_S = 10.0


def process_started() -> float:
    """When this process started (unix s): imports and the device set-up count as start-up. From /proc
    to 10 ms (psutil's boot time is whole seconds, which could place a restart's process before the kill
    that caused it)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()


class TimeLedger:
    def __init__(self, run_dir: Path) -> None:
        self.started = process_started()
        self.launch = os.environ.get(LAUNCH_ENV, "")
        self.spent: dict[str, float] = defaultdict(float)
        self.first_step_at: float | None = None
        self.resumed_from: int | None = None
        self.saves: list[list[float]] = []  # [step, this attempt's step time up to that checkpoint]
        self.written = 0.0
        folder = run_dir / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"attempt-{self.launch or 'none'}-{self.started:.3f}-{os.getpid()}.json"

    def changed(self, old: str, new: str, since: float, now: float, step: int) -> None:
        self.spent[old] += now - since
        if old == "start-up" and self.first_step_at is None:
            self.first_step_at, self.resumed_from = now, step - 1
        if old == "checkpoint" and new != "finished":
            self.saves.append([step, round(self.spent["step"], 4)])
            self.write(new, now, now, step)
        elif new == "finished":
            self.write(new, now, now, step)

    def tick(self, section: str, since: float, now: float, step: int) -> None:
        if now - self.written >= WRITE_EVERY_S:
            self.write(section, since, now, step)

    def write(self, section: str, since: float, now: float, step: int) -> None:
        spent = dict(self.spent)
        spent[section] = spent.get(section, 0.0) + now - since  # the open section, so far
        record = {
            "launch": self.launch,
            "started": self.started,
            "first_step_at": self.first_step_at,
            "resumed_from": self.resumed_from,
            "step": step,
            "spent": {k: round(v, 4) for k, v in spent.items()},
            "saves": self.saves,
            "updated": now,
            "finished": section == "finished",
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk costs the ledger, never the run
        self.written = now
