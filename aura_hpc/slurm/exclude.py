"""Nodes a requeued job leaves out: a node whose rank hung, one that stayed a straggler, one that failed screening.

Slurm refuses to change a running job's excluded nodes ("Job is no longer pending execution"), but a
requeue makes the job pending at once (it stays "completing" until its processes are gone, and the one
asking is among them): the exclusion is set right after `scontrol requeue`, before Slurm can start the
job again. It is only set while the job's partition keeps enough other usable nodes for the job's
minimum node count, and Slurm itself finds the job's request (its constraint, GPUs, CPUs and memory per
node) satisfiable on them (`sbatch --test-only`: a partition of two kinds of node has fewer spare of the kind
asked for); otherwise the job would wait forever (ReqNodeNotAvail), and it is requeued on the same nodes
with a line that says so.

Every node to leave out is kept in RUN_DIR/excluded_nodes.json (ops/excluded_nodes.py), so the next
requeue, whatever causes it (a hang, the pre-timeout signal), leaves out all of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from aura_hpc.ops import excluded_nodes
from aura_hpc.slurm.query import ACCOUNTING_LAG_S, HELD_STATES, NO_ANSWER

# What the accounting shows of a started job before it records its end (PENDING: its start not recorded yet, or it
# was requeued).
NOT_ENDED = ("", "PENDING", "RUNNING", "RESIZING", "SUSPENDED")
# A job someone stopped: a cancel, or a preemption of PreemptMode=CANCEL.
STOPPED_BY_SOMEONE = ("CANCELLED", "PREEMPTED")
UNUSABLE = ("down", "drain", "drng", "fail", "maint", "unk", "inval", "futr", "npc", "resv", "boot", "powered", "pow_dn")


def unusable_state(state: str) -> bool:
    """A node in sinfo's compact state `state` gets no new work. Its suffixes: `*` not responding, `$` in a
    maintenance reservation; the others (~ powered off, # powering up, % powering down, ...) are left to the name."""
    return state.endswith(("*", "$")) or state.rstrip("~#!%@^-").startswith(UNUSABLE)


def outlive_the_requeue() -> None:
    """A requeue sends SIGTERM to every process of the job (SIGKILL only KillWait later, 30 s by default): the
    one asking must outlive it to set the excluded nodes, and so must the scontrol it starts (an ignored signal
    stays ignored across exec)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _scontrol(*args: str) -> subprocess.CompletedProcess[str]:
    # Times in UTC, Slurm's standard format: a local time is ambiguous in the hour a clock change repeats.
    env = {**os.environ, "TZ": "UTC0", "SLURM_TIME_FORMAT": "standard"}
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30, env=env)


def job_ref(job_id: int) -> str:
    """How scontrol and sacct are told of this job: the sweep's element that has the array's id as its own (the last
    split off) as ARRAY_TASK, as `scontrol requeue|update|show` read the array's id as the whole array: its requeue
    requeued every sibling, finished and cancelled ones included. Any other job by its id: a job sbatch started from
    inside an array element inherits that element's SLURM_ARRAY_* variables (sbatch exports the environment)."""
    e = os.environ
    mine = e.get("SLURM_JOB_ID") == str(job_id) == e.get("SLURM_ARRAY_JOB_ID")
    return f"{job_id}_{e['SLURM_ARRAY_TASK_ID']}" if mine and e.get("SLURM_ARRAY_TASK_ID", "").isdigit() else str(job_id)


RESUBMIT = "(fix: submit the same command again to resume from its newest checkpoint)"
# What `scontrol requeue` answers for a job already back in the queue: another hand's requeue came first (not
# "Job is no longer pending execution", which is a running job's answer to an update).
REQUEUED_BY_ANOTHER = "job is pending execution"


@dataclass(frozen=True)
class Stopped:
    """Why a job is ending by another hand ("" when it is not, or unknown), and what its owner does about it."""

    why: str = ""
    then: str = RESUBMIT
    requeued_anyway: bool = False  # another hand put it back in the queue: nothing to submit

    def __bool__(self) -> bool:
        return bool(self.why)

    def __str__(self) -> str:
        return f"{self.why} {self.then}" if self.why else ""

    @property
    def line(self) -> str:
        return f"not requeued{' again' if self.requeued_anyway else ''}: {self}"


def requeue(job_id: int) -> str | None:
    """Ask Slurm to requeue the job: why it could not, or None. A negative status is scontrol killed by the
    requeue's own signal, after it asked. A job already back in the queue (another hand's requeue since it was
    last read) is what was asked."""
    try:
        done = _scontrol("requeue", job_ref(job_id))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol could not be run ({exc}; a container image may lack the Slurm client)"
    answer = (done.stderr + done.stdout).lower()
    if done.returncode > 0 and (REQUEUED_BY_ANOTHER not in answer or "no longer" in answer):
        return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
    return None


def why_stopped(job_id: int, restarts: int | None = None) -> Stopped:
    """Why the job is ending by another hand: a cancel (scancel), a preemption that cancels, or a requeue already
    made (Slurm's own after a node failure or a preemption that requeues, an admin's or our watchdog's `scontrol
    requeue`), told by its Restarts past `restarts` (this attempt's SLURM_RESTART_COUNT): requeued a second time, it
    failed ("Job is pending execution") and its line said to submit again, a second job for one run.
    `scontrol requeue` takes a job whose processes are still stopping (COMPLETING) and undoes the cancel (tried on
    Slurm 22.05: Restarts=1, back to pending). While it completes, only the accounting says why; without
    an answer from it, a job that ends before its time limit was stopped by someone (a cancel, a preemption, a
    requeue already asked): not requeued again. Unknown (no Slurm client in the image, no answer) reads as not
    cancelled: the requeue decides as before. A sweep's last element has the array's id: only this job's own record
    counts, not its siblings'."""
    deadline = time.monotonic() + 20  # within KillWait (30 s by default) of a cancel's SIGTERM
    while True:
        try:
            shown = _scontrol("show", "job", "-o", job_ref(job_id))
        except (OSError, subprocess.TimeoutExpired):
            return Stopped()
        # A busy controller's "Socket timed out" is no answer: asked again.
        if shown.returncode == 0 or "invalid job id" in shown.stderr.lower() or time.monotonic() > deadline - 2:
            break
        time.sleep(2.0)
    # The line that starts with this job's id (not ArrayJobId=); its last JobState= field (JobName, before it, is
    # not quoted: a name holding "JobState=CANCELLED" read as the state).
    fields = next((line.split() for line in shown.stdout.splitlines() if line.split()[:1] == [f"JobId={job_id}"]), [])
    state = next((f.split("=", 1)[1] for f in reversed(fields) if f.startswith("JobState=")), "")
    if restarts is not None and not state.startswith(STOPPED_BY_SOMEONE) and (requeued := _requeued_by_another(fields, restarts, job_id)):
        return requeued
    if state == "COMPLETING":
        early = _ended_early(fields)
        if early is False:  # at its time limit: a timeout, which the requeue is for (KillWait leaves no time to ask)
            return Stopped()
        state = _accounted_state(job_id, min(ACCOUNTING_LAG_S, max(0.0, deadline - time.monotonic())))
        if not state and early:
            return Stopped(
                f"job {job_ref(job_id)} is ending before its time limit (a cancel, a preemption or a requeue already asked; "
                "no accounting says which)"
            )
    word = state.split(" ")[0].lower()
    return Stopped(f"job {job_ref(job_id)} was {word}" if state.startswith(STOPPED_BY_SOMEONE) else "")


def _requeued_by_another(fields: list[str], restarts: int, job_id: int) -> Stopped:
    """The job's Restarts past this attempt's: requeued by another hand, and maybe held (`scontrol requeuehold`, a
    prolog that failed: Priority=0 while it still completes). Read around the last JobState= field: Priority comes
    before it, Reason and Restarts after it, and the job's name (before them all) is not quoted."""
    at = max((i for i, f in enumerate(fields) if f.startswith("JobState=")), default=len(fields))
    before = dict(f.split("=", 1) for f in fields[:at] if "=" in f)
    after = dict(f.split("=", 1) for f in reversed(fields[at:]) if "=" in f)  # the first of each after JobState
    counted, state, reason = after.get("Restarts", ""), after.get("JobState", ""), after.get("Reason", "")
    if not counted.isdigit() or int(counted) <= restarts:
        return Stopped()
    ref = job_ref(job_id)
    if before.get("Priority") == "0" or state in HELD_STATES or "held" in reason.lower():
        return Stopped(
            f"job {ref} was requeued and held by another hand (Restarts={counted}, Reason={reason})",
            f"(nothing to submit: `scontrol release {ref}` lets it start again from its newest checkpoint)",
            requeued_anyway=True,
        )
    return Stopped(
        f"job {ref} was already requeued by another hand (Slurm's, or an scontrol requeue: Restarts={counted})",
        f"(nothing to submit while `squeue -j {ref}` lists it: Slurm starts it again, and it resumes from its newest checkpoint)",
        requeued_anyway=True,
    )


def after_another_hands_requeue(job_id: int, run_dir: Path, say: Callable[[str], None]) -> None:
    """A job requeued by another hand is pending all the same: the kept nodes are left out of it as after our own."""
    outlive_the_requeue()
    apply_after_requeue(job_id, run_dir, say, True)


def _ended_early(fields: list[str]) -> bool | None:
    """Whether a completing job's end came before its time limit (its EndTime is set when it ends); None when its
    fields do not say (an unlimited job). Its times are UTC (_scontrol): read in local time, a job cancelled across
    the spring clock change after 61 minutes of a 2-hour limit ran 2 h 1 min, a timeout, and was requeued."""
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    try:
        start, end = (datetime.fromisoformat(values[k]).replace(tzinfo=UTC) for k in ("StartTime", "EndTime"))
        days, _, clock = values["TimeLimit"].rpartition("-")
        parts = [int(p) for p in clock.split(":")]
    except (KeyError, ValueError):
        return None
    limit = int(days or 0) * 86400 + sum(p * 60**i for i, p in enumerate(reversed(parts)))
    return (end - start).total_seconds() < limit - 60


def _accounted_state(job_id: int, wait_s: float = ACCOUNTING_LAG_S) -> str:
    """The job's own state in the accounting once it records the end: slurmctld sends it to slurmdbd on a queue of
    its own, and on a loaded controller a cancel can reach it after rank 0 asks (read then, the requeue undid it).
    "" when the accounting cannot be asked (no sacct, an error) or still has no end after `wait_s`."""
    deadline = time.monotonic() + wait_s
    cmd = ["sacct", "-X", "-n", "-P", "-j", job_ref(job_id), "-o", "JobIDRaw,State"]
    while True:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        if done.returncode != 0:
            return ""
        rows = [line.split("|") for line in done.stdout.splitlines()]
        state = next((row[1].strip() for row in reversed(rows) if len(row) > 1 and row[0] == str(job_id)), "")
        if state.split(" ")[0] not in NOT_ENDED or time.monotonic() > deadline:
            return "" if state.split(" ")[0] in NOT_ENDED else state
        time.sleep(0.5)


def _job_fields(job_id: int) -> dict[str, str]:
    """The job's record; a failed query raises (read as empty, the job's own --exclude list was overwritten)."""
    done = _scontrol("show", "job", "-o", job_ref(job_id))
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
    if done.returncode != 0 or "NumNodes" not in fields or "Partition" not in fields:
        raise ValueError(f"scontrol show job {job_id}: {(done.stderr or done.stdout).strip()[:200] or f'exit status {done.returncode}'}")
    return fields


def _hostnames(expr: str) -> list[str]:
    if not expr or expr == "(null)":
        return []
    out = _scontrol("show", "hostnames", expr)
    if out.returncode != 0:
        raise ValueError(f"scontrol show hostnames {expr}: {out.stderr.strip()[:200] or f'exit status {out.returncode}'}")
    return out.stdout.split()


def _nodes_by_use(partition: str) -> tuple[list[str], list[str]]:
    """The partition's (usable, unusable) nodes."""
    args = ["sinfo", "-h", "-N", "-o", "%N %t"] + (["-p", partition] if partition else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:  # a busy controller's answer read as an empty partition: "no node to spare"
        raise ValueError(f"sinfo: {(done.stderr or done.stdout).strip()[:200] or f'exit status {done.returncode}'}")
    out = done.stdout
    usable, unusable = set(), set()
    for line in out.splitlines():
        name, _, state = line.partition(" ")
        state = state.strip()
        if name:
            (unusable if unusable_state(state) else usable).add(name)
    return sorted(usable), sorted(unusable - usable)


def _given(value: str | None) -> str:
    """A field of `scontrol show job` the job set ("" for Slurm's words for none)."""
    return "" if value in (None, "", "(null)", "0", "*") else str(value)


def _request(job: dict[str, str], least: int, exclude: list[str]) -> list[str]:
    """`sbatch --test-only` for what the job asks of each node, on `least` nodes, without `exclude`."""
    args = ["sbatch", "--test-only", "--nodes", str(least), "--output", "/dev/null"]
    for flag, key in (("--partition", "Partition"), ("--account", "Account"), ("--qos", "QOS"), ("--constraint", "Features")):
        if _given(job.get(key)):
            args += [flag, job[key]]
    per_node = job.get("NtasksPerN:B:S:C", "").split(":")[0]
    if _given(per_node):
        args += ["--ntasks-per-node", per_node]
    if _given(job.get("CPUs/Task")):
        args += ["--cpus-per-task", job["CPUs/Task"]]
    if _given(job.get("MinMemoryNode")):
        args += ["--mem", job["MinMemoryNode"]]
    if job.get("TimeLimit", "").replace("-", "").replace(":", "").isdigit():
        args += ["--time", job["TimeLimit"]]
    # GPUs per node: `gres/gpu:8` (Slurm 23+) or `gres:gpu:8` (22.05); other per-node TRES are not nodes' features.
    gres = [t.split("/", 1)[-1] if t.startswith("gres/") else t.removeprefix("gres:") for t in job.get("TresPerNode", "").split(",")]
    gres = [g for g in gres if g and not g.startswith(("gres", "(null)"))]
    if gres:
        args += ["--gres", ",".join(gres)]
    if exclude:
        args += ["--exclude", ",".join(exclude)]
    return [*args, "--wrap", "true"]


def _slurm_refuses(job: dict[str, str], least: int, exclude: list[str]) -> str:
    """Why Slurm could never start the job without `exclude` ("" when it could). Inside the job, its
    SBATCH_* settings are not this question's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBATCH_")}
    done = subprocess.run(_request(job, least, exclude), capture_output=True, text=True, timeout=30, env=env)
    if done.returncode == 0:
        return ""
    said = " ".join((done.stderr or done.stdout).split())
    if any(word in said.lower() for word in NO_ANSWER):  # the controller did not answer: not a refusal of the request
        raise ValueError(f"sbatch --test-only: {said[:200]}")
    return said.removeprefix("sbatch: ").removeprefix("error: ")[:200] or f"sbatch --test-only: exit status {done.returncode}"


@dataclass
class _Room:
    leave_out: list[str]  # every node the job would then exclude (its own list and ours)
    left: list[str]  # the usable nodes of its partition beside them
    least: int  # the fewest nodes the job can start on
    partition: str
    refused: str  # why Slurm could not start the job on the nodes left ("" when it could)


def _room(job_id: int, nodes: list[str], least: int | None = None) -> _Room:
    """`least`: the job's --nodes minimum where known (job.json): a running job's NumNodes is what it was given,
    only a pending one's reads MIN-MAX, and a job of --nodes 3:4 on 4 nodes was judged as one of 4."""
    job = _job_fields(job_id)
    already = set(_hostnames(job.get("ExcNodeList", "")))
    least = least or int(job.get("NumNodes", "1").split("-")[0])
    partition = job.get("Partition", "")
    leave_out = sorted(already | set(nodes))
    usable, unusable = _nodes_by_use(partition)
    left = [n for n in usable if n not in leave_out]
    refused = "" if len(left) < least else _slurm_refuses(job, least, sorted(set(leave_out) | set(unusable)))
    return _Room(leave_out, left, least, partition or "?", refused)


def _least(run_dir: Path | None) -> int | None:
    """The --nodes minimum `submit` recorded in the run's job.json, or None."""
    try:
        value = json.loads((run_dir / "job.json").read_text(encoding="utf-8")).get("min_nodes") if run_dir else None
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int and value > 0 else None


def _judge(job_id: int, nodes: list[str], least: int | None = None) -> tuple[_Room | None, str]:
    """(the room the job would have without `nodes`, why they cannot be left out: "" when they can)."""
    try:
        room = _room(job_id, nodes, least)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return None, f"Slurm could not be asked which nodes are spare ({exc}; inside a container image, scontrol may be missing)"
    if len(room.left) < room.least:
        return room, (
            f"partition {room.partition} would keep {len(room.left)} usable node(s) for a job of {room.least} "
            "(fix: submit with --nodes MIN:MAX so it can start on fewer, or ask an admin to drain the node)"
        )
    if room.refused:
        return room, (
            f"Slurm finds no {room.least} node(s) for the job's request (constraint, GPUs, CPUs, memory per node) in partition "
            f"{room.partition} without them: {room.refused} (fix: submit with --nodes MIN:MAX or a wider --constraint, or ask an "
            "admin to drain the node)"
        )
    return room, ""


def why_not_leave_out(job_id: int, nodes: list[str], run_dir: Path | None = None) -> str:
    """ "" when the job's partition keeps enough usable nodes for the job without `nodes` (and those it already
    excludes); otherwise why not, with the fix."""
    return _judge(job_id, nodes, _least(run_dir))[1]


JUDGE_BUDGET_S = 20.0  # the requeue waits this long at most for the judgement of which nodes to leave out


@dataclass
class Judged:
    """What a requeue will leave out, judged before it is asked for (see judge_before_requeue)."""

    room: _Room
    nodes: list[str]
    names: str


def judge_unless_stopped(job_id: int, run_dir: Path, say: Callable[[str], None], restarts: int) -> tuple[Judged | None, Stopped]:
    """judge_before_requeue, and why the job is being stopped by another hand where the judgement took its time (up
    to 20 s): a cancel or a requeue that landed meanwhile is neither undone nor doubled by this requeue."""
    judging = time.monotonic()
    judged = judge_before_requeue(job_id, run_dir, say)
    return judged, why_stopped(job_id, restarts) if time.monotonic() - judging > 1 else Stopped()


def judge_before_requeue(job_id: int, run_dir: Path, say: Callable[[str], None]) -> Judged | None:
    """The kept nodes the partition can spare, judged while the job still runs: after `scontrol requeue` only
    KillWait (30 s by default) is left before SIGKILL, and the judgement's four Slurm queries (30 s each at most)
    on a busy controller outlasted it: the node was not left out and nothing said why."""
    nodes = excluded_nodes.wanted(run_dir)
    if not nodes:
        return None
    names = ", ".join(f"{n} ({nodes[n].get('why', '')})" for n in sorted(nodes))
    # Within a budget: before a pre-timeout requeue the job's time is short, and the requeue comes first.
    judged: list[tuple[_Room | None, str]] = []

    def ask() -> None:
        try:
            judged.append(_judge(job_id, sorted(nodes), _least(run_dir)))
        except Exception as exc:  # whatever it is, the requeue still goes
            judged.append((None, f"Slurm could not be asked which nodes are spare ({type(exc).__name__}: {exc})"))

    try:
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(JUDGE_BUDGET_S)
    except RuntimeError as exc:  # no thread to be had (a pids limit): the requeue still goes
        judged.append((None, f"no thread to ask Slurm ({exc})"))
    if not judged:
        say(f"not leaving out {names}: Slurm did not say which nodes are spare within {JUDGE_BUDGET_S:.0f} s (a busy controller)")
        return None
    room, why_not = judged[0]
    if room is None or why_not:
        say(f"not leaving out {names}: {why_not}")
        return None
    return Judged(room, sorted(nodes), names)


def apply_after_requeue(job_id: int, run_dir: Path, say: Callable[[str], None], judged: Judged | bool | None = True) -> list[str]:
    """Leave the kept nodes out of the requeued job where the partition can spare them; the nodes left out.
    `judged`: judge_before_requeue's answer (True: judge now)."""
    if judged is True:
        judged = judge_before_requeue(job_id, run_dir, say)
    if not isinstance(judged, Judged):
        return []
    room, names = judged.room, judged.names
    try:
        done = _scontrol("update", f"JobId={job_ref(job_id)}", f"ExcNodeList={','.join(room.leave_out)}")
    except (OSError, subprocess.TimeoutExpired) as exc:  # a busy controller: the requeue itself stands
        done = subprocess.CompletedProcess([], 1, "", f"scontrol did not answer ({exc})")
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        say(f"the requeued job keeps its nodes: scontrol could not leave out {names}: {reason}")
        return []
    say(f"the requeued job leaves out {names} ({len(room.left)} usable node(s) remain in partition {room.partition})")
    return judged.nodes
