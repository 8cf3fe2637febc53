"""`submit`, step 2: carry out a SubmitPlan with submitit, record the job, optionally wait."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from aura_hpc.errors import LaunchError
from aura_hpc.slurm import index as job_index
from aura_hpc.slurm import query as slurm_query
from aura_hpc.slurm import sbatch_env
from aura_hpc.slurm.plan import SubmitPlan

JOB_FILE = "job.json"
T = TypeVar("T")


def submit(plan: SubmitPlan, warn: Callable[[str], None] = print) -> list[str]:
    """Prepare the run directories, submit through submitit, record each job; returns the job ids."""
    slurm_query.require("sbatch")
    if not plan.check:
        _refuse_a_queued_job(plan)
    waits = None  # said once sbatch took the job: its own verdict counts every node of the partition
    with sbatch_env.left_out(plan.script):
        try:
            slurm_query.test_only(plan.script)  # refused here, nothing is written or queued
        except LaunchError as refused:
            if (waits := _nodes_it_waits_for(plan, str(refused))) is None:
                raise
    from aura_hpc.launch.run_setup import check_writable, prepare_run_dir
    from aura_hpc.slurm.job import CheckJob, TrainJob

    if plan.check:
        check_writable(plan.folder)
    for p in plan.points if not plan.check else []:
        # The built-in corpus (data.path "") is prepared here, on the login node, into output_dir.
        prepare_run_dir(p.cfg, plan.world_size)
    import submitit

    executor = submitit.SlurmExecutor(folder=plan.folder, max_num_timeout=plan.slurm.max_requeues, python=plan.python)
    executor.update_parameters(**plan.params)
    jobs: list[Any] = []
    started = time.time()
    # submitit echoes sbatch's stderr when sbatch fails; it is reported once, below, with the fix.
    quiet = contextlib.redirect_stderr(io.StringIO())
    try:
        with quiet, sbatch_env.left_out(plan.script):
            if plan.is_array:
                with executor.batch():
                    for p in plan.points:
                        jobs.append(executor.submit(TrainJob(str(p.config_path), plan.slurm.signal, plan.slurm.max_requeues)))
            elif plan.check:
                backend = plan.points[0].cfg.dist.backend
                jobs.append(executor.submit(CheckJob(backend, plan.points[0].cfg.output_dir)))
            else:
                p = plan.points[0]
                jobs.append(executor.submit(TrainJob(str(p.config_path), plan.slurm.signal, plan.slurm.max_requeues)))
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError, OSError) as exc:
        raise LaunchError(_queued_anyway(plan, str(exc), started) or _rejection(str(exc))) from None
    submitted = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    ids = [str(j.job_id) for j in jobs]
    if waits:
        warn(waits)
    script_file = plan.folder / f"{ids[0].split('_')[0]}_submission.sh"
    script = script_file.read_text(encoding="utf-8") if script_file.exists() else plan.script
    if plan.check:
        return ids
    try:
        _record(plan, ids, script, submitted)
    except OSError as exc:  # queued all the same: the ids must reach the user, or they submit again
        raise LaunchError(
            f"job(s) {', '.join(ids)} were queued, but recording them failed ({exc.strerror or type(exc).__name__}: "
            f"{exc.filename or ''}) (fix: free that place; `status`, `logs` and `cancel` take these ids meanwhile)"
        ) from None
    return ids


def _nodes_it_waits_for(plan: SubmitPlan, refused: str) -> str | None:
    """The warning for a job Slurm finds no nodes for only because some of its partition's are down or drained
    (submitted: it waits for them, as plain sbatch has it), or None for a refusal that stands."""
    from aura_hpc.slurm import node_room

    if node_room.NOT_AVAILABLE not in refused.lower():
        return None
    least = plan.slurm.nodes if plan.check else plan.slurm.min_nodes or plan.slurm.nodes  # a check job asks for all of them
    waiting = node_room.waiting_for(plan.slurm, plan.tasks_per_node, least)
    if not waiting:
        return None
    names = ", ".join(f"{n.name} ({n.state})" for n in waiting[:8]) + (f" and {len(waiting) - 8} more" if len(waiting) > 8 else "")
    return (
        f"no {least} node(s) of the partition can take this job now: {names} would, once up again; it is queued and waits "
        f"for them (`python -m aura_hpc status JOB` says why it waits; cancel it, or ask for fewer --nodes, if they do not "
        f"come back)"
    )


def _refuse_a_queued_job(plan: SubmitPlan) -> None:
    """A run directory whose job (job.json) is still queued, running or requeued takes no second job: the new
    config.yaml would be what the first trains with when it starts (or restarts), job.json would name only the
    second, and the two would train in one folder. A pending job holds no run lock, so the lock cannot tell; nor
    is --after an exception (the follower's config.yaml would be the one the first job starts with)."""
    for p in plan.points:
        try:
            recorded = json.loads((p.cfg.run_dir / JOB_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        job_id = str(recorded.get("job_id", "")) if isinstance(recorded, dict) else ""
        if not job_id:
            continue
        row = slurm_query.squeue_job(job_id)
        name = str(recorded.get("job_name") or "")
        # Ended, or the id is another job's now. COMPLETING is not ended: a job being requeued passes through it.
        if row is None or not row.active or (name and row.name and row.name != name):
            continue
        raise LaunchError(
            f"job {job_id} ({row.state}) is already queued for {p.cfg.run_dir}: a second job would change the settings "
            f"it starts with and train in the same folder (fix: `python -m aura_hpc cancel {job_id}` first, or another --run-name; "
            "a job just cancelled or ended leaves the queue within a minute)"
        )


def _record(plan: SubmitPlan, ids: list[str], script: str, submitted: str) -> None:
    """job.json and submission.sh in each run directory, and the index line that `status` and `history` read."""
    for p, job_id in zip(plan.points, ids, strict=True):
        (p.cfg.run_dir / "submission.sh").write_text(script, encoding="utf-8")
        record = {
            "job_id": job_id,
            "job_name": plan.params["job_name"],
            "submitted": submitted,
            "run_dir": str(p.cfg.run_dir),
            "log_dir": str(plan.folder),
            "sweep_point": p.label,
            "nodes": plan.slurm.nodes,
            "min_nodes": plan.slurm.min_nodes or plan.slurm.nodes,
            "tasks_per_node": plan.tasks_per_node,
            "world_size": plan.world_size,
            "cluster": str(plan.profile.path),
            "slurm": {k: getattr(plan.slurm, k) for k in plan.sources if hasattr(plan.slurm, k)},
            "sources": plan.sources,
        }
        tmp = p.cfg.run_dir / (JOB_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
        tmp.replace(p.cfg.run_dir / JOB_FILE)
        job_index.record(job_id, p.cfg.run_dir, plan.params["job_name"], submitted, plan.folder, plan.world_size)


def _since(submit_time: str, started: float) -> bool:
    """Whether squeue's SubmitTime (local time, to the second) is at or after `started`, a minute of clock skew aside."""
    try:
        return time.mktime(time.strptime(submit_time, "%Y-%m-%dT%H:%M:%S")) >= started - 60
    except (ValueError, OverflowError):
        return True  # a site's own time format: the name and comment decide


def _queued_anyway(plan: SubmitPlan, text: str, started: float) -> str:
    """sbatch's "Socket timed out" can come after slurmctld queued the job: "try again" then queued a second job for
    the same run directory, the first one unrecorded. The jobs of this name in the queue now, said ("" otherwise)."""
    if slurm_query.NO_ANSWER[0] not in text.lower():  # "socket timed out": the request may have reached slurmctld
        return ""
    name = plan.params["job_name"]
    try:  # ours (the comment submit gives its jobs), of this name, submitted since this command started
        ids = [r.job_id for r in slurm_query.squeue() if r.name == name and r.comment == "aura_hpc" and _since(r.submit, started)]
    except LaunchError as exc:
        return (
            f"sbatch did not hear back from slurmctld in time, and the queue could not be read ({exc}) (fix: check "
            f"`squeue --me -n {name}` before submitting again: a submission sbatch timed out on may still be queued)"
        )
    if not ids:
        return (
            f"sbatch did not hear back from slurmctld in time, and no job named {name!r} is in the queue yet (fix: check "
            "`squeue --me` in a minute before submitting again: a submission sbatch timed out on may still be queued)"
        )
    listed = ", ".join(ids)
    return (
        f"sbatch did not hear back from slurmctld in time, but job(s) {listed} named {name!r} are in the queue: this "
        f"submission may be among them, not recorded in its run directory (fix: `python -m aura_hpc cancel ID` for each "
        "of them, then submit again)"
    )


def _rejection(text: str) -> str:
    """sbatch's own message (submitit wraps it in a traceback-like text) plus what to change."""
    lines: list[str] = []
    for ln in text.splitlines():
        ln = ln.strip()
        if ln.lower().startswith("sbatch: error:"):
            ln = ln[len("sbatch: error:") :].strip()
            if ln not in lines:
                lines.append(ln)
    msg = "; ".join(lines) if lines else " ".join(text.split())[:400]
    return "the job was not submitted: " + slurm_query.explain("sbatch", msg)


def wait(job_ids: list[str], follow_log: Path | None = None, poll_s: float = 1.0, printer: Any = print) -> int:
    """Block until every job has ended; the exit status reflects the jobs' (0 only if all COMPLETED)."""
    return exit_status(watch(job_ids, follow_log, poll_s, printer))


def exit_status(final: dict[str, slurm_query.JobRow | None]) -> int:
    """0 only if every job COMPLETED; else the first other job's exit code, or 1 (one still pending: 1)."""
    status = 0
    for row in final.values():
        if row is None or row.state != "COMPLETED":
            status = status or _exit_code(row) or 1
    return status


def watch(
    job_ids: list[str], follow_log: Path | None = None, poll_s: float = 1.0, printer: Any = print
) -> dict[str, slurm_query.JobRow | None]:
    """Block until every job has ended, or will not start unless someone acts (said through `printer`): each one's
    last row (None where neither the queue nor the accounting knows it any more)."""
    offset = 0
    final: dict[str, slurm_query.JobRow | None] = {}
    # Accounting from before this wait cannot describe these jobs (they were queued or running then);
    # where job ids were reset, such a record is another job under the same id. A minute of margin
    # covers clock skew between this host and slurmdbd.
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 60))
    upstream: set[str] = set()  # the jobs the watched ones wait for (--after, a prepare chain), asked in the same squeue
    # Will not start unless someone acts: said once, and asked again each pass while other jobs still run (a sweep's
    # held point released meanwhile is waited for again); the wait ends when every job has ended or is stuck.
    stuck: dict[str, slurm_query.JobRow] = {}
    while True:
        pending = [j for j in job_ids if j not in final]
        rows = squeue_all_patiently([*pending, *sorted(upstream - set(pending))])  # one squeue a pass, whatever the number
        upstream = set()
        for j in pending:
            row = rows[j]
            if row is None or not row.active:
                stuck.pop(j, None)
                final[j] = final_state(j, row, since)
            elif why := never_starts(row) or waits_for_ever(row, rows, upstream):
                if j not in stuck:
                    printer(why)
                stuck[j] = row  # still PENDING: not COMPLETED, so the wait's status says it failed
            else:
                stuck.pop(j, None)
        if follow_log is not None:
            offset = print_new_lines(follow_log, offset, printer)
        if len(final) + len(stuck) == len(job_ids):
            break
        time.sleep(poll_s)
    if follow_log is not None:
        print_new_lines(follow_log, offset, printer, final=True)
    return {j: final[j] if j in final else stuck[j] for j in job_ids}


def never_starts(row: slurm_query.JobRow) -> str:
    """Why a pending job will not start unless someone acts (a watch would wait on it for ever), or ""."""
    held = slurm_query.HELD_STATES.get(row.state)
    # Slurm clears SPECIAL_EXIT at `scontrol release`, the other two only when the job starts: released, its reason
    # is no hold's any more (Resources, Priority).
    if held and row.state != "SPECIAL_EXIT" and not any(w in row.reason.lower() for w in ("hold", "held", "reservationdeleted")):
        held = None
    if held:
        return (
            f"job {row.job_id} will not start: {held} (squeue's state {row.state}) (fix: `scontrol release {row.job_id}` "
            f"lets it start, `python -m aura_hpc cancel {row.job_id}` ends it)"
        )
    if row.state != "PENDING":
        return ""
    if row.reason == "DependencyNeverSatisfied":
        return (
            f"job {row.job_id} will never start: the job it waits for (--after) did not complete successfully, and Slurm "
            f"keeps it pending (fix: `python -m aura_hpc cancel {row.job_id}`, then submit again without that --after)"
        )
    if row.reason.lower().startswith("launch failed requeued held"):
        return (
            f"job {row.job_id} is held: Slurm could not launch it on its node(s) and held it after the requeue (fix: see "
            f"slurmd's log on that node; `scontrol release {row.job_id}` tries again, `python -m aura_hpc cancel {row.job_id}` ends it)"
        )
    why = _WAITS_FOR_SOMEONE.get(row.reason)
    if why:
        return f"job {row.job_id} will not start: {why} (squeue's reason {row.reason}) (fix: {_FIXES[row.reason].format(job=row.job_id)})"
    return ""


def waits_for_ever(row: slurm_query.JobRow, rows: dict[str, slurm_query.JobRow | None], named: set[str], depth: int = 0) -> str:
    """Why a job pending on its dependency never starts: a job it needs will not start unless someone acts (Slurm
    says only "Dependency" for it, and a watch waited for ever), or "". Every job its chain names is added to
    `named`: the next pass's squeue asks for those `rows` lacks, one level further each pass."""
    if row.state != "PENDING" or row.reason != "Dependency" or depth > 8:
        return ""
    needed, any_one = slurm_query.waits_for(row.dependency)
    named.update(needed)
    stuck = []
    for job in needed:
        up = rows.get(job)
        if up is not None and up.active and (why := never_starts(up) or waits_for_ever(up, rows, named, depth + 1)):
            stuck.append(f"job {row.job_id} waits for job {job}: {why}")
    return stuck[0] if stuck and (not any_one or len(stuck) == len(needed)) else ""


def why_it_waits(row: slurm_query.JobRow) -> str:
    """never_starts or waits_for_ever for one job now, its chain asked level by level (`status JOB`); "" where the
    controller does not answer (a note, not worth `status`'s failing or waiting)."""
    rows: dict[str, slurm_query.JobRow | None] = {row.job_id: row}
    for _ in range(9):
        named: set[str] = set()
        if why := never_starts(row) or waits_for_ever(row, rows, named):
            return why
        if not (unknown := sorted(named - rows.keys())):
            return ""
        try:
            rows.update(slurm_query.squeue_jobs(unknown))
        except LaunchError:
            return ""
    return ""


# Pending reasons that no time cures (a watch waited on them for ever): a hold, or a request the partition or
# account can never grant. Capacity and priority reasons (Resources, Priority, ReqNodeNotAvail...) pass with time, and so
# may PartitionNodeLimit (also said when required nodes are down or drained: man squeue).
_WAITS_FOR_SOMEONE = {
    "JobHeldUser": "it is held (scontrol hold, or sbatch --hold)",
    "JobHeldAdmin": "an administrator holds it",
    "PartitionTimeLimit": "its time limit is over its partition's",
    "BadConstraints": "no node has the features (--constraint) it asks for",
    "InvalidAccount": "its account is not valid for this user",
    "InvalidQOS": "its quality of service is not valid for this user",
    "QOSMaxWallDurationPerJobLimit": "its time limit is over its QOS's",
    "JobHoldMaxRequeue": "Slurm held it after too many requeues (MaxBatchRequeue)",
}
_FIXES = {
    "JobHeldUser": "`scontrol release {job}` lets it start",
    "JobHeldAdmin": "ask the administrators, or `python -m aura_hpc cancel {job}`",
    "PartitionTimeLimit": "`python -m aura_hpc cancel {job}`, then submit with a shorter --time",
    "BadConstraints": "`python -m aura_hpc cancel {job}`, then submit with another --constraint",
    "InvalidAccount": "`python -m aura_hpc cancel {job}`, then submit with your --account",
    "InvalidQOS": "`python -m aura_hpc cancel {job}`, then submit with another --qos",
    "QOSMaxWallDurationPerJobLimit": "`python -m aura_hpc cancel {job}`, then submit with a shorter --time",
    "JobHoldMaxRequeue": "see why its launches failed in slurmd's log; `scontrol release {job}` tries again",
}


def final_state(job_id: str, row: slurm_query.JobRow | None, since: str, timeout_s: float = 60) -> slurm_query.JobRow | None:
    if row is not None and row.state in slurm_query.FINAL_STATES:
        # squeue knows the state but not the exit code: ask accounting for it when there is one, a few seconds
        # (it records the end after the controller: read at once, it could still lack the job, and the wait gave 1 for
        # the run's own status, 3 or 74-78).
        deadline = time.monotonic() + slurm_query.ACCOUNTING_LAG_S
        while True:
            try:
                acct = [r for r in slurm_query.sacct([job_id], since=since) if r.job_id == job_id and r.state == row.state]
            except LaunchError:
                return row
            if acct or time.monotonic() > deadline:
                return acct[-1] if acct else row
            time.sleep(1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # accounting lags behind the controller
        try:
            rows = [r for r in slurm_query.sacct([job_id], since=since) if r.job_id == job_id and r.state in slurm_query.FINAL_STATES]
        except LaunchError:
            return None
        if rows:
            return rows[-1]
        time.sleep(1)
    return None


def _exit_code(row: slurm_query.JobRow | None) -> int:
    if row is None or not row.exit_code:
        return 0
    code, _, sig = row.exit_code.partition(":")
    try:
        return int(code) or (128 + int(sig) if sig and int(sig) else 0)
    except ValueError:
        return 0


# How long a watch (`submit --wait`, `logs --follow`) keeps asking a controller that does not answer (a busy one
# times out; a failover takes minutes) before it gives up: one failed squeue ended a watch of a job that ran on.
SQUEUE_PATIENCE_S = 300.0


def squeue_patiently(job_id: str, patience_s: float = SQUEUE_PATIENCE_S) -> slurm_query.JobRow | None:
    return _patiently(lambda: slurm_query.squeue_job(job_id), patience_s)


def squeue_all_patiently(job_ids: list[str], patience_s: float = SQUEUE_PATIENCE_S) -> dict[str, slurm_query.JobRow | None]:
    """squeue_patiently for several jobs in one squeue call a pass."""
    return _patiently(lambda: slurm_query.squeue_jobs(job_ids), patience_s)


_NEVER_CURED = ("is not on path", "no slurm configuration is reachable", "invalid user")


def _patiently(ask: Callable[[], T], patience_s: float) -> T:
    failing_since, wait_s = 0.0, 2.0
    while True:
        try:
            return ask()
        except LaunchError as exc:
            # What no time cures is said at once (no squeue on PATH, no configuration: asked again for 5 minutes of
            # silence); anything else may be a controller in failover, munge restarting, a reply cut short.
            said = str(exc).lower()
            if not any(word in said for word in slurm_query.NO_ANSWER) and any(word in said for word in _NEVER_CURED):
                raise
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > patience_s:
                said = str(exc).splitlines()[0]
                raise LaunchError(f"{said} (squeue failed for {patience_s:.0f} s; the job itself may still run)") from None
            time.sleep(wait_s)
            wait_s = min(30.0, wait_s * 2)


def print_new_lines(path: Path, offset: int, printer: Any, final: bool = False) -> int:
    """The whole lines written after `offset`; `final`: the last one too, without its line break (a job's last
    words, "CUDA out of memory", often have none)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if not data:
        return offset
    end = len(data) if final else data.rfind(b"\n") + 1  # whole lines only, but at the end
    if end == 0:
        return offset
    for line in data[:end].decode("utf-8", "replace").splitlines():
        printer(line)
    return offset + end


def rank_log(log_dir: Path, job_id: str, rank: int = 0, stderr: bool = False) -> Path:
    """Slurm's per-task log as submitit names it: <job>_<task>_log.out (arrays: <array>_<index>_<task>)."""
    return log_dir / f"{job_id}_{rank}_log.{'err' if stderr else 'out'}"
