"""The goodput ledger of one `local` launch: its wall time split into what it was spent on.

Rank 0 of each attempt keeps its own sections' time (train/process/time_ledger.py); only the launcher
sees the rest: its own set-up before the first worker, hangs (the last progress to the kill), and the
restarts between attempts. The steps an attempt trained after its last checkpoint are trained again by
the next attempt: that time is "recomputed", not productive. What no part explains is `other`, so the
parts and `other` add up to the wall time by construction, and a large `other` says the ledger misses
something (the tests hold it under 2%).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.train.process.time_ledger import FOLDER, LAUNCH_ENV

PARTS = ("productive steps", "start-up", "checkpoints", "evaluation", "data waits", "recomputed", "hangs", "restarts", "set-up and exit")


@dataclass
class Launch:
    run_dir: Path
    id: str
    started: float
    hangs: list[dict[str, float]] = field(default_factory=list)

    requeues: list[float] = field(default_factory=list)  # Slurm: when the job was requeued (then it waited in the queue)

    @classmethod
    def begin(cls, run_dir: Path, started: float, launch_id: str = "") -> Launch:
        launch = cls(run_dir, launch_id or f"{started:.3f}-{os.getpid()}", started)
        os.environ[LAUNCH_ENV] = launch.id
        launch._write()
        return launch

    @classmethod
    def of_slurm_job(cls, run_dir: Path, job_id: int, started: float) -> Launch:
        """A Slurm job's ledger, one across its requeues: its first attempt begins it, a requeued one goes on with it."""
        launch_id = f"slurm-{job_id}"
        try:
            kept = json.loads((run_dir / FOLDER / f"launch-{launch_id}.json").read_text(encoding="utf-8"))
            launch = cls(run_dir, launch_id, float(kept["started"]), list(kept.get("hangs") or []), list(kept.get("requeues") or []))
        except (OSError, ValueError, KeyError, TypeError):
            return cls.begin(run_dir, started, launch_id)
        os.environ[LAUNCH_ENV] = launch.id
        return launch

    def requeued(self, at: float) -> None:
        self.requeues.append(at)
        self._write()

    def hang(self, last_progress: float, killed_at: float) -> None:
        self.hangs.append({"last_progress": last_progress, "killed_at": killed_at})
        self._write()

    def _write(self) -> None:
        folder = self.run_dir / FOLDER
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            record = {"started": self.started, "hangs": self.hangs, "requeues": self.requeues}
            tmp = folder / f".launch-{self.id}.json.{os.getpid()}"
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, folder / f"launch-{self.id}.json")

    def finish(self) -> dict[str, Any] | None:
        """The split at the end of the launch, added to summary.json (when the run wrote one in this launch)."""
        split = ledger(self.run_dir, self.id, time.time())
        if split is None:
            return None
        summary = self.run_dir / "summary.json"
        with contextlib.suppress(OSError, ValueError):
            if summary.stat().st_mtime >= self.started:
                data = json.loads(summary.read_text(encoding="utf-8"))
                data["goodput"] = split
                tmp = summary.with_name(".summary.json.tmp")
                tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
                os.replace(tmp, summary)
        return split


def _attempts(run_dir: Path, launch_id: str) -> list[dict[str, Any]]:
    out = []
    for path in (run_dir / FOLDER).glob(f"attempt-{launch_id}-*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(record, dict) and isinstance(record.get("started"), (int, float)):
                out.append(record)
    return sorted(out, key=lambda r: r["started"])


def newest_launch(run_dir: Path) -> str | None:
    """By the start its record holds: a run directory copied with `cp -r` or `scp -r` has new file times, in the order
    the copy made them."""

    def started(path: Path) -> float:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return float(json.loads(path.read_text(encoding="utf-8"))["started"])
        with contextlib.suppress(OSError):
            return path.stat().st_mtime
        return 0.0

    launches = sorted((run_dir / FOLDER).glob("launch-*.json"), key=started)
    return launches[-1].stem.removeprefix("launch-") if launches else None


def ledger(run_dir: Path, launch_id: str, now: float) -> dict[str, Any] | None:
    """Seconds and fractions of the launch's wall time per part (None without a launch record)."""
    try:
        launch = json.loads((run_dir / FOLDER / f"launch-{launch_id}.json").read_text(encoding="utf-8"))
        started = float(launch["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    attempts = _attempts(run_dir, launch_id)
    hangs = [h for h in launch.get("hangs") or [] if isinstance(h, dict)] + _watchdog_hangs(run_dir, launch_id)
    requeues = [float(t) for t in launch.get("requeues") or [] if isinstance(t, (int, float))]
    parts = dict.fromkeys(PARTS, 0.0)
    for i, a in enumerate(attempts):
        spent = {k: float(v) for k, v in (a.get("spent") or {}).items()}
        first = a.get("first_step_at")
        parts["start-up"] += (float(first) if first else float(a["updated"])) - float(a["started"])
        parts["checkpoints"] += spent.get("checkpoint", 0.0)
        parts["evaluation"] += spent.get("evaluation", 0.0)
        parts["data waits"] += spent.get("data", 0.0)
        parts["productive steps"] += spent.get("meeting", 0.0)  # DiLoCo's meetings are its training
        steps = spent.get("step", 0.0)
        later = attempts[i + 1] if i + 1 < len(attempts) else None
        if later is None or a.get("finished"):
            parts["productive steps"] += steps
            continue
        # Its ledger was last written up to WRITE_EVERY_S before the hang's last progress: it trained until
        # then. Or after it: a rank that outlived its peers' kill (another node's, under Slurm) wrote its
        # open step on the way out, the wait included; that wait is the hang's.
        ended = [float(h["last_progress"]) for h in hangs if float(a["started"]) < float(h["killed_at"]) <= float(later["started"])]
        if ended:
            steps = max(0.0, steps + max(ended) - float(a["updated"]))
        resumed = later.get("resumed_from")
        kept = max((float(t) for s, t in a.get("saves") or [] if resumed is not None and s <= resumed), default=0.0)
        parts["productive steps"] += kept
        parts["recomputed"] += max(0.0, steps - kept)
    for h in hangs:
        parts["hangs"] += max(0.0, float(h["killed_at"]) - float(h["last_progress"]))
    # From the kill (or a requeue without a hang) to the next attempt's first process; under Slurm that
    # includes the requeued job's wait in the queue.
    ends = sorted([float(h["killed_at"]) for h in hangs] + requeues)
    for i, t in enumerate(ends):
        nxt = next((float(a["started"]) for a in attempts if float(a["started"]) > t), None)
        if nxt is not None and not (i + 1 < len(ends) and ends[i + 1] < nxt):  # one restart per gap
            parts["restarts"] += nxt - t
    if attempts:
        last = attempts[-1]
        ended = float(last["updated"]) if last.get("finished") else now
        parts["set-up and exit"] = float(attempts[0]["started"]) - started + max(0.0, now - ended)
    else:
        parts["set-up and exit"] = now - started
    wall = max(now - started, 1e-9)
    parts["other"] = wall - sum(parts.values())
    return {
        "wall_s": round(wall, 3),
        "seconds": {k: round(v, 3) for k, v in parts.items()},
        "fractions": {k: round(v / wall, 4) for k, v in parts.items()},
    }


def _watchdog_hangs(run_dir: Path, launch_id: str) -> list[dict[str, float]]:
    """Hangs a Slurm node's watchdog recorded (its own file: it is another process than the ledger's)."""
    out = []
    for path in (run_dir / FOLDER).glob(f"hang-{launch_id}-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            h = json.loads(path.read_text(encoding="utf-8"))
            out.append({"last_progress": float(h["last_progress"]), "killed_at": float(h["killed_at"])})
    return out


def record_hang(run_dir: Path, launch_id: str, last_progress: float, killed_at: float) -> None:
    """A hang seen by a process other than the launch's (the Slurm watchdog beside a node's tasks)."""
    folder = run_dir / FOLDER
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"hang-{launch_id}-{killed_at:.3f}-{os.getpid()}.json"
        path.write_text(json.dumps({"last_progress": last_progress, "killed_at": killed_at}), encoding="utf-8")


def line(split: dict[str, Any]) -> str:
    """`time: 81% productive steps, 12% start-up, ... of 2m05s`: the parts of 0.5% or more, largest first."""
    fr = split["fractions"]
    shown = sorted(((v, k) for k, v in fr.items() if v >= 0.005), reverse=True)
    seconds = round(float(split["wall_s"]))  # rounded once: 119.6 s read "1m60s"
    return "time: " + ", ".join(f"{v:.0%} {k}" for v, k in shown) + f" of {seconds // 60}m{seconds % 60:02d}s (goodput ledger)"
