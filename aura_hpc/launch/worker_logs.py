"""What the workers' own logs (RUN_DIR/logs/rank_N.log, appended to by every launch) say about why they
stopped: read by the launcher for its one-line verdict, from where this launch began in each log (an
earlier launch's error is not this one's)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aura_hpc.errors import EXIT_USER_ERROR, EXITING_LINE, FINAL_LINE, NOT_RESTARTED

Offsets = dict[str, int]  # a rank log's name -> its size when a launch began


def offsets(plan: Any) -> Offsets:
    """Where this launch begins in each rank log of the run."""
    out: Offsets = {}
    for path in (plan.cfg.run_dir / "logs").glob("rank_*.log"):
        try:
            out[path.name] = path.stat().st_size
        except OSError:
            continue
    return out


def tail(path: Path, size: int = 65536, start: int = 0) -> list[str] | None:
    """The last `size` bytes of a rank's log after byte `start`, as lines; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - size))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def node_logs(plan: Any) -> list[Path]:
    """This node's ranks' logs: those whose newest start line names this node (nodes may run different
    numbers of processes, so the ranks are not node_rank * nproc on); before any, that guess."""
    logs = plan.cfg.run_dir / "logs"
    mine = []
    for path in sorted(logs.glob("rank_*.log")):
        lines = tail(path, 262144)
        if lines is None:
            continue
        starts = [ln for ln in lines if "start rank=" in ln]
        if starts and f" node_rank={plan.node_rank} " in starts[-1]:
            mine.append(path)
    first = plan.node_rank * plan.nproc
    return mine or [logs / f"rank_{r}.log" for r in range(first, first + plan.nproc)]


def trained_since(plan: Any, started: float) -> bool:
    """This node's workers started training in this attempt (their logs say so since `started`)."""
    for path in node_logs(plan):
        try:
            if path.stat().st_mtime >= started and "start rank=" in path.read_text(encoding="utf-8", errors="replace"):
                return True
        except OSError:
            continue
    return False


def _latest_attempt(path: Path) -> list[str] | None:
    lines = tail(path)
    if lines is None:
        return None
    starts = [i for i, line in enumerate(lines) if "start rank=" in line]
    return lines[starts[-1] :] if starts else lines


def exited_with(plan: Any, code: int) -> bool:
    """Some worker of this node logged `code` as its exit status in its latest attempt (train/worker.py, and a
    stop's checkpoint agreed by every rank: train/loop/endings.py)."""
    attempts = [_latest_attempt(path) or [] for path in node_logs(plan)]
    return any(line.endswith(f"{EXITING_LINE}{code}") for latest in attempts for line in latest)


def not_restarted(plan: Any, since: Offsets) -> int | None:
    """The status in NOT_RESTARTED (the first in its order) that a worker of this node logged as it left in
    this launch (`since`: where it began in each log), or None."""
    logged = set()
    for path in node_logs(plan):
        for line in tail(path, start=since.get(path.name, 0)) or []:
            code = line.rpartition(FINAL_LINE)[2] if FINAL_LINE in line else ""
            if code.isdigit():
                logged.add(int(code))
    return next((c for c in NOT_RESTARTED if c in logged), None)


def refused_here(plan: Any) -> str | None:
    """The reason a worker of this node gave for refusing its input in its latest attempt (it logged
    the error, then its exit status 2: train/worker.py), or None."""
    for path in node_logs(plan):
        latest = _latest_attempt(path)
        if latest is None:
            continue
        if any(line.endswith(f"{EXITING_LINE}{EXIT_USER_ERROR}") for line in latest):
            errors = [line.split(" ERROR ", 1)[1].strip() for line in latest if " ERROR " in line]
            if errors:
                return errors[-1]
    return None


LOST_PEER = "lost the connection to the rank(s) at"


def worker_error(plan: Any, since: Offsets | None = None) -> str | None:
    """The last error a worker of this machine logged in this launch (each logs its error before leaving):
    the newest one of the log was quoted for a rank killed before it logged anything, from a launch before."""
    said = []
    for path in node_logs(plan):
        lines = tail(path, start=(since or {}).get(path.name, 0))
        if lines is None:
            continue
        for line in reversed(lines):
            if " ERROR " in line:
                said.append(line.split(" ERROR ", 1)[1].strip())
                break
    # A rank that stopped on its own error takes its peers down: theirs say they lost it. The cause is the line to show
    # (rank 0's "lost the connection" was shown for rank 1's damaged data).
    return next((s for s in said if not s.startswith(LOST_PEER)), said[0] if said else None)


def data_unavailable_line(plan: Any) -> str:
    """Rank 0's own line about the data that could not be read (its log holds it)."""
    log = plan.cfg.run_dir / "logs" / "rank_0.log"
    try:
        lines = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if "data unavailable: " in ln]
    except OSError:
        lines = []
    if lines:
        return lines[-1].split("data unavailable: ", 1)[1]
    return f"the training data could not be read (see {log}); re-run the same command to resume once it can be read"
