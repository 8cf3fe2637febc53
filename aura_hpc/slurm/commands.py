"""`status`, `logs`, `cancel` and `history`: following submitted jobs over squeue/sacct."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from aura_hpc.errors import LaunchError
from aura_hpc.launch.run_status import goodput_note
from aura_hpc.slurm import index as job_index
from aura_hpc.slurm import query as slurm_query
from aura_hpc.slurm.submit import (
    exit_status,
    final_state,
    never_starts,
    print_new_lines,
    rank_log,
    squeue_all_patiently,
    waits_for_ever,
    why_it_waits,
)


def latest_metrics(run_dir: Path | None) -> dict[str, Any]:
    """The newest training row of a run's metrics.jsonl (read from the end: files grow long)."""
    if run_dir is None:
        return {}
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row and "loss" in row:
            return row
    return {}


def _row_dict(row: slurm_query.JobRow, run_dir: Path | None, its_metrics: bool = True) -> dict[str, Any]:
    """`its_metrics`: whether the run's newest metrics row is this job's (not where a later job resumed the run)."""
    d: dict[str, Any] = row.to_dict()
    if not row.active:
        d["time_left"] = ""
    m = latest_metrics(run_dir) if its_metrics else {}
    d["run_dir"] = str(run_dir) if run_dir else None
    d["step"] = m.get("step")
    d["loss"] = m.get("loss")
    d["tokens_per_s"] = m.get("tokens_per_s")
    return d


def status(target: str | None, all_jobs: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows for the table/--json and notes to show under it."""
    notes: list[str] = []
    if target:
        job_id, run_dir, info = job_index.resolve(target)
        later = str((info or {}).get("superseded_by") or "")
        if later:
            notes.append(f"run {run_dir} was submitted again as job {later}: its step and loss are that job's (`status {later}`)")
        row = slurm_query.squeue_job(job_id)
        if row is None:
            if not slurm_query.accounting_enabled():
                notes.append("job accounting is disabled on this cluster: finished jobs are known only from their run directory")
                summary = _summary(run_dir)
                if summary is None:
                    raise LaunchError(f"job {job_id} is not in the queue and this cluster keeps no accounting (fix: check the id)")
                state = "COMPLETED" if summary.get("finished") else "UNKNOWN"
                row = slurm_query.JobRow(job_id, "", state, "", "", source="run directory")
            else:
                found = list(_attempts_folded(slurm_query.sacct([job_id], attempts=True)).values())
                rows = [r for r in found if r.job_id == job_id]
                elements = [r for r in found if r.job_id.startswith(f"{job_id}_")]
                if not rows and elements:  # a sweep's array id, once its elements have left the queue
                    return [_row_dict(r, None) for r in elements], notes
                if not rows:
                    raise LaunchError(f"job {job_id} is unknown to squeue and sacct (fix: check the id with `python -m aura_hpc history`)")
                row = rows[-1]
        if launch := _launch_note(row, run_dir, info):
            notes.append(launch)
        if row.active and (why := why_it_waits(row)):
            notes.append(why)  # pending for "Dependency" behind a held job, or held itself: no time cures it
        if run_dir is not None and not later and (split := goodput_note(run_dir, row.state)):
            notes.append(split)  # where the job's time went, across its requeues
        return [_row_dict(row, run_dir, its_metrics=not later)], notes
    rows = slurm_query.squeue()
    known = job_index.run_dirs()
    # The jobs ours may wait for, an array also under its own id (`afterok:123_*`); pending elements share one row,
    # 123_[0-4], judged under the id `cancel` takes.
    judged = {r.job_id: dataclasses.replace(r, job_id=r.job_id.split("_[")[0]) for r in rows}
    everyone: dict[str, slurm_query.JobRow | None] = {r.job_id: r for r in judged.values()}
    for r in judged.values():
        everyone.setdefault(r.job_id.split("_")[0], r)
    if not all_jobs:
        rows = [r for r in rows if r.comment == "aura_hpc" or r.job_id in known]
    for r in (judged[r.job_id] for r in rows if r.active):
        if why := never_starts(r) or waits_for_ever(r, everyone, set()):
            notes.append(why)
    if not rows:
        notes.append("no aura_hpc jobs in the queue" + ("" if all_jobs else " (--all shows your other jobs; `history` the finished ones)"))
    return [_row_dict(r, known.get(r.job_id)) for r in rows], notes


def _launch_note(row: slurm_query.JobRow, run_dir: Path | None, info: dict[str, Any] | None) -> str | None:
    """_failed_at_launch for a job as its record (job.json, or its index line) places its logs; none where that folder
    is only a guess (an earlier job's index line from before it held one)."""
    if info is not None and info.get("log_dir_guessed"):
        return None
    return _failed_at_launch(row, run_dir, Path(info["log_dir"]) if info is not None else None)


def _failed_at_launch(row: slurm_query.JobRow, run_dir: Path | None, log_dir: Path | None = None) -> str | None:
    """A job that failed before any rank wrote a line: Slurm could not start the tasks, most often because
    the log files under output_dir could not be opened on the compute nodes (only slurmd's log says so).
    `log_dir`: where job.json says its logs go (a sweep's are in the sweep's folder, not the point's)."""
    if row.state not in ("FAILED", "NODE_FAIL") or run_dir is None:
        return None
    folder = log_dir or run_dir / "slurm"
    logs = list(folder.glob(f"{row.job_id}_*_log.*")) if folder.is_dir() else []
    if any(p.stat().st_size > 0 for p in logs):
        return None
    where = f"{run_dir} does not exist on this machine either" if not run_dir.is_dir() else f"nothing was written under {run_dir}"
    return (
        f"job {row.job_id} failed before any rank started (exit {row.exit_code or '?'}): Slurm could not launch its tasks "
        f"on {row.nodelist if row.nodelist not in ('', 'None assigned') else 'its node(s)'}; {where}. Usually output_dir "
        "is not mounted (or not writable) there, so the job's log files could not be opened (fix: mount output_dir on "
        "every node, check with `python -m aura_hpc submit --check`, and see slurmd's log on that node for the exact cause)"
    )


def _summary(run_dir: Path | None) -> dict[str, Any] | None:
    if run_dir is None or not (run_dir / "summary.json").exists():
        return None
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    return data


def log_file(target: str, rank: int, stderr: bool) -> tuple[str, Path]:
    job_id, path, _, _ = _log_of(target, rank, stderr)
    return job_id, path


def _log_of(target: str, rank: int, stderr: bool) -> tuple[str, Path, Path | None, dict[str, Any]]:
    """The job's id, the rank's log file, the run directory and the job's record."""
    job_id, run_dir, info = job_index.resolve(target)
    if info is None and run_dir is not None and not run_dir.is_dir():
        raise LaunchError(
            f"job {job_id}'s run directory {run_dir} does not exist on this machine: output_dir was deleted, or is not "
            "mounted here (fix: mount the shared output_dir on this node and on every compute node, then resubmit)"
        )
    found = {str(e.get("job_id")) for e in job_index.entries() if str(e.get("job_id", "")).startswith(f"{job_id}_")}
    points = sorted(found, key=lambda p: (len(p), p))  # by index: 123_2 before 123_10
    if info is None and points:  # a sweep's id, as `submit` printed it: each point has its own logs
        shown = ", ".join(points) if len(points) <= 8 else f"{', '.join(points[:3])}, ... {', '.join(points[-2:])}"
        raise LaunchError(
            f"job {job_id} is a sweep of {len(points)} points, each with its own logs (fix: `logs {points[0]}`, one of {shown})"
        )
    if info is None:
        raise LaunchError(f"no run directory is known for job {job_id} (fix: pass its RUN_DIR, or submit it with `submit`)")
    world = info.get("world_size")  # unknown for an earlier job of a run submitted again, from an older index line
    if isinstance(world, int) and not 0 <= rank < world:
        raise LaunchError(f"--rank {rank} is not a rank of job {job_id}, which has {world} (fix: --rank 0..{world - 1})")
    return job_id, rank_log(Path(info["log_dir"]), job_id, rank, stderr), run_dir, info


def follow_log(target: str, rank: int, stderr: bool, printer: Any, say: Any) -> int:
    """`logs --follow`: the log as it grows, then how the job ended (`say`), even where it left no line (it failed at
    launch, or was cancelled while pending). The status is the job's, as `submit --wait` gives it."""
    job_id, path, run_dir, info = _log_of(target, rank, stderr)
    final = follow(job_id, path, printer, since=_before(info.get("submitted")))
    code = exit_status({job_id: final})
    if final is None:
        try:
            kept = slurm_query.accounting_enabled()
        except LaunchError as exc:
            say(f"job {job_id} has left the queue, and how it ended could not be asked: {exc}")
            return code
        said = "the accounting has no record of how it ended" if kept else "this cluster keeps no job accounting to say how it ended"
        say(f"job {job_id} has left the queue; {said} (its log above is what is known)")
        return code
    say(f"job {job_id} ended: {final.state}" + (f" (exit status {code})" if code else ""))
    if why := _launch_note(final, run_dir, info):
        say(why)
    return code


def absent_log_note(target: str, rank: int, stderr: bool) -> str:
    """What `logs` says of a rank's log that is not there: whether the job still waits to start, or ended without it
    (a job that failed at launch a day ago was said to be perhaps still pending)."""
    job_id, path, run_dir, info = _log_of(target, rank, stderr)
    try:
        row = slurm_query.squeue_job(job_id)
        if row is not None and row.active:
            why = f" ({row.reason})" if row.state == "PENDING" and row.reason else ""
            return f"{path} does not exist yet: job {job_id} is {row.state}{why} (--follow waits for it)"
        final = final_state(job_id, row, _before(info.get("submitted")) or "", timeout_s=1)
    except LaunchError as exc:  # the controller away: the log's absence is still the answer
        return f"{path} does not exist yet, and Slurm could not say how job {job_id} is ({str(exc).split(' (fix: ')[0][:160]})"
    if final is None:
        return f"{path} does not exist, and job {job_id} has left the queue (how it ended is not known here)"
    return " ".join(
        filter(None, [f"{path} does not exist: job {job_id} ended {final.state} without writing it.", _launch_note(final, run_dir, info)])
    )


def _before(submitted: object) -> str | None:
    """sacct's -S (this machine's local time) for a job submitted at `submitted` (job.json's, with the submitting
    machine's UTC offset: a login node in another time zone), a minute early; None where unknown."""
    from datetime import datetime

    try:
        at = datetime.strptime(str(submitted), "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (ValueError, OverflowError):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(at - 60))


def follow(job_id: str, path: Path, printer: Any, poll_s: float = 0.5, since: str | None = None) -> slurm_query.JobRow | None:
    """Print the log as it grows; once the job has ended and the last lines are out, its final row (None where
    neither the queue nor the accounting knows it). `since`: sacct's start time for that row."""
    offset = 0
    upstream: set[str] = set()  # the jobs it waits for (--after), asked in the same squeue
    first = True
    while True:
        rows = squeue_all_patiently([job_id, *sorted(upstream - {job_id})])
        row = rows[job_id]
        ended = row is None or not row.active
        offset = print_new_lines(path, offset, printer)
        if ended:
            print_new_lines(path, offset, printer, final=True)
            # Gone from the queue before the follow began: the accounting has it by now, or never will (purged, another
            # cluster's id); a job that just ended is given the accounting's usual lag.
            wait_s = slurm_query.ACCOUNTING_LAG_S if first and row is None else 60.0
            return final_state(job_id, row, since or "", timeout_s=wait_s)
        first = False
        upstream = set()
        if why := never_starts(row) or waits_for_ever(row, rows, upstream):
            raise LaunchError(why)
        time.sleep(poll_s)


def cancel(target: str) -> str:
    job_id, _, info = job_index.resolve(target)
    row = slurm_query.squeue_job(job_id)
    if row is None:
        raise LaunchError(f"job {job_id} is not in the queue (fix: `python -m aura_hpc status --all` lists the jobs you can cancel)")
    if not row.active:
        raise LaunchError(f"job {job_id} has already ended ({row.state}); nothing to cancel")
    if row.uid and row.uid != str(os.getuid()):
        # An id not in this user's index, or one of a cluster whose ids restarted: an operator's or a coordinator's
        # scancel would end someone else's job.
        raise LaunchError(
            f"job {job_id} is {row.user or 'uid ' + row.uid}'s, not yours: not cancelled "
            "(fix: `python -m aura_hpc status` lists your jobs; scancel it yourself if you mean to end another user's job)"
        )
    recorded = str((info or {}).get("job_name") or "")
    if recorded and row.name and row.name != recorded:
        # Job ids restart (a controller's state reset), and two clusters may share one output_dir: the id in an old
        # job.json can be someone else's job now.
        raise LaunchError(
            f"job {job_id} in the queue is named {row.name!r}, not {recorded!r} as this run's job.json says: it is another "
            f"job now, not cancelled (fix: `python -m aura_hpc status --all` lists yours; scancel the right id)"
        )
    slurm_query.scancel(job_id)
    return job_id


def history(since: str, all_jobs: bool = False) -> list[dict[str, Any]]:
    if not slurm_query.accounting_enabled():
        raise LaunchError(
            "job accounting is disabled on this cluster, so there is no history (fix: `status` shows queued and running jobs)"
        )
    # One row per job: its last attempt's state, the first attempt's submit time, and how often it
    # was requeued (sacct without -D shows only the last attempt, submitted at the requeue).
    # An attempt follows an earlier one that ended REQUEUED (scontrol requeue, our SIGUSR2 stop), or
    # NODE_FAIL / PREEMPTED under the same name (Slurm requeued it itself: a node went down under a job
    # submitted with --requeue, or PreemptMode=REQUEUE). A job id seen before with another end is an
    # older job (ids restart when a cluster's state is reset).
    rows = slurm_query.sacct(since=since, attempts=True)
    # A time window leaves out the jobs that were never eligible to start (held, or waiting on a dependency, then
    # cancelled: a prepare chain's later jobs): Slurm's accounting keeps only those eligible before its end.
    # Asked by how they ended, they come back; not the record slurmdbd keeps until slurmctld sends the job's details
    # (named "allocation", on 0 nodes: a requeued attempt has one for a moment too).
    seen = {(r.job_id, r.submit) for r in rows}  # an id alone may be an older job's (a cluster's state reset)
    ended = slurm_query.sacct(since=since, attempts=True, ended_as="CANCELLED,DEADLINE")
    rows += [r for r in ended if (r.job_id, r.submit) not in seen and r.nodes not in ("", "0")]
    jobs = _attempts_folded(rows)
    out = []
    known = job_index.run_dirs()
    for r in jobs.values():
        run_dir = known.get(r.job_id)
        if not all_jobs and r.comment != "aura_hpc" and run_dir is None:
            continue  # as `status`: the user's other jobs only with --all
        d = r.to_dict()
        d["run_dir"] = str(run_dir) if run_dir else None
        out.append(d)
    return sorted(out, key=lambda d: str(d.get("submit") or ""))


def _attempts_folded(rows: list[slurm_query.JobRow]) -> dict[str, slurm_query.JobRow]:
    """sacct -D's rows, one per attempt, as one row per job: its last attempt's state, its first attempt's submit time
    and how often it was requeued. Oldest first: a job id restarted by a reset cluster folds onto the newer job."""
    jobs: dict[str, slurm_query.JobRow] = {}
    for r in sorted(rows, key=lambda r: r.submit):
        earlier = jobs.get(r.job_id)
        if earlier is not None and _requeued_into(earlier, r):
            r.submit, r.requeues = earlier.submit, earlier.requeues + 1
        jobs[r.job_id] = r
    return jobs


def _requeued_into(earlier: slurm_query.JobRow, later: slurm_query.JobRow) -> bool:
    if earlier.state in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return True
    return earlier.state in ("NODE_FAIL", "PREEMPTED") and earlier.name == later.name
