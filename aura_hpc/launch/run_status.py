"""`status` and `logs` for a run started with `local`: everything is in its run directory.

A Slurm run has job.json (its job id); a local run has none, so its state comes from the run
lock (a live holder: running), summary.json (finished or stopped at train.stop_at) and the
newest metrics row.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from aura_hpc.errors import LaunchError
from aura_hpc.launch.run_lock import LOCK_NAME, RunLock, fs_now, read_json
from aura_hpc.train.loop.stragglers import THRESHOLD as STRAGGLER_THRESHOLD
from aura_hpc.train.process.worker_log import JOINED


def local_config(target: str | Path) -> Path | None:
    """The config a `local` run left in its directory: config.yaml, or on a LAN node other than 0
    (with a folder of its own) config.nodeN.yaml; None where it is no local run's directory."""
    p = Path(target).expanduser()
    if not p.is_dir() or (p / "job.json").exists():
        return None
    return next((c for c in [p / "config.yaml", *sorted(p.glob("config.node*.yaml"))] if c.is_file()), None)


def is_local_run(target: str | Path) -> bool:
    return local_config(target) is not None


def local_status(run_dir: Path, latest: dict[str, Any]) -> dict[str, Any]:
    """One status row (the columns `status` shows for jobs) for a local run directory."""
    run_dir = run_dir.expanduser().resolve()
    lock = read_json(run_dir / LOCK_NAME)
    summary = _this_launchs_summary(run_dir)
    state, reason = "STOPPED", "re-run the same `local` command to resume"
    try:
        mtime = (run_dir / LOCK_NAME).stat().st_mtime
    except OSError:  # released since it was read: the run ended meanwhile
        lock = None
    if lock is not None:
        mine = RunLock(run_dir)
        # Another host's heartbeat is judged by the clock that stamps the folder's files (an NFS server's): a login
        # node whose clock ran ahead read a live run as STOPPED, and `logs -f` ended at once.
        now = fs_now(run_dir) if lock.get("host") != mine.record["host"] else None
        try:
            if not mine.holder_is_gone(lock, mtime, now):
                state, reason = "RUNNING", f"PID {lock.get('pid')} on {lock.get('host')} since {lock.get('since')}"
        except LaunchError as exc:  # its launcher is gone, its workers still stop (a SIGKILLed launcher): one row, not a traceback
            state, reason = "STOPPING", str(exc)
    if state not in ("RUNNING", "STOPPING") and summary is not None and summary.get("step") == latest.get("step", summary.get("step")):
        state = "COMPLETED" if summary.get("finished") else "STOPPED"
        reason = "" if summary.get("finished") else "train.stop_at reached; re-run to continue"
    hang = read_json(run_dir / "hangs" / "last.json")
    metrics = run_dir / "metrics.jsonl"
    logged_at = metrics.stat().st_mtime if metrics.exists() else 0.0
    if hang is not None and state != "COMPLETED" and float(hang.get("declared_at", 0) or 0) >= logged_at:
        reason = str(hang.get("line", "hung"))  # the watchdog's verdict came after the last metrics row
    score = latest.get("slowest_score")
    if isinstance(score, (int, float)) and score < STRAGGLER_THRESHOLD and state == "RUNNING":
        reason = f"straggler: rank {latest.get('slowest_rank')} (score {score:.2f}); {reason}"
    return {
        "job_id": "local",
        "name": run_dir.name,
        "state": state,
        "nodes": "",
        "elapsed": f"{latest['elapsed_s']:.0f}s" if isinstance(latest.get("elapsed_s"), (int, float)) else "",  # training time
        "time_left": "",
        "reason": reason,
        "step": latest.get("step"),
        "loss": latest.get("loss"),
        "tokens_per_s": latest.get("tokens_per_s"),
        "run_dir": str(run_dir),
        "holder": lock if state == "RUNNING" else None,  # the run lock's record: host, pid, since
    }


def _this_launchs_summary(run_dir: Path) -> dict[str, Any] | None:
    """summary.json when the newest launch wrote it, not an earlier launch's (a finished run extended with a larger
    train.max_steps, then crashed, read COMPLETED). The summary names its launch; one written before that did is judged by
    file times (each launch writes config.yaml first), which a copy (`cp -r`, `scp -r`) does not keep: a finished run read
    STOPPED there."""
    from aura_hpc.launch import goodput

    summary = read_json(run_dir / "summary.json")
    config = local_config(run_dir)
    wrote = summary.get("launch") if summary is not None else None
    if isinstance(wrote, str) and wrote and (newest := goodput.newest_launch(run_dir)) is not None:
        return summary if wrote == newest else None
    if summary is not None and config is not None:
        with contextlib.suppress(OSError):
            if (run_dir / "summary.json").stat().st_mtime < config.stat().st_mtime:
                return None
    return summary


def goodput_note(run_dir: Path, state: str) -> str | None:
    """Where the newest launch's time went: the finished run's split (summary.json), or a running one's so far."""
    import time

    from aura_hpc.launch import goodput

    summary = _this_launchs_summary(run_dir)
    split = summary.get("goodput") if summary is not None and state != "RUNNING" else None
    if not isinstance(split, dict):
        launch = goodput.newest_launch(run_dir)
        split = goodput.ledger(run_dir, launch, time.time()) if launch and state == "RUNNING" else None
    return goodput.line(split) if split else None


def local_log(run_dir: Path, rank: int, stderr: bool = False) -> Path:
    if stderr:
        return _node_stderr(run_dir.expanduser() / "logs", rank)
    path = run_dir.expanduser() / "logs" / f"rank_{rank}.log"
    if not path.exists():
        ranks = _ranks_logged(run_dir.expanduser() / "logs")
        raise LaunchError(f"{path} does not exist (fix: --rank one of {ranks})" if ranks else f"{run_dir} has no rank logs yet")
    return path


def no_stderr_note(run_dir: Path, rank: int) -> str | None:
    """What `logs --stderr` says of a run whose ranks ran here and wrote nothing to stderr: a clean launch keeps no
    stderr log (launch/native_stderr.py), and sending the user to node 0's folder was wrong on node 0 itself."""
    logs = run_dir.expanduser() / "logs"
    if any(logs.glob("stderr_node*.log")) or not (logs / f"rank_{rank}.log").is_file():
        return None
    return (
        f"{logs} has no stderr log: nothing was written to stderr where rank {rank} ran (one is kept only when a process "
        f"wrote there: a traceback, torch's C++ warnings); its log: python -m aura_hpc logs {run_dir} --rank {rank}"
    )


def _ranks_logged(logs: Path) -> str:
    """The ranks whose logs are in `logs`, for a fix that names them ("" where none is): in number order, runs of
    ranks as ranges ("0-15, 24-31": 8 nodes of 8 GPUs on one shared folder name 64 ranks, not a line of them)."""
    ranks = sorted({int(n) for p in logs.glob("rank_*.log") if (n := p.stem.removeprefix("rank_")).isdigit()})
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans)


def _node_stderr(logs: Path, rank: int) -> Path:
    """The stderr log of the node that ran `rank` (a node's workers share one: Python's tracebacks and
    torch's C++ lines): the one where the rank said it joined, else this machine's only one if no rank
    joined there (a failure before the ranks met)."""
    nodes = sorted(logs.glob("stderr_node*.log"))
    mark, joined = f"[rank{rank}]: {JOINED}".encode(), False
    for path in nodes:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            text = f.read()
            if mark in text:
                return path
            joined |= JOINED.encode() in text
    if len(nodes) == 1 and not joined:  # no rank got as far as joining: the start-up failure is there
        return nodes[0]
    names = ", ".join(p.name for p in nodes)
    ranks = _ranks_logged(logs)
    raise LaunchError(
        f"no stderr log here names rank {rank} (fix: read it on the machine that ran it; here: {names})"
        if nodes
        else f"{logs} has no stderr log, and rank {rank} did not run here (fix: --rank one of {ranks}, or read it on the machine "
        f"that ran rank {rank})"
        if ranks
        else f"{logs} has no stderr log (fix: the run's node 0 keeps it in its logs/ folder)"
    )
