"""Thin wrappers over the real Slurm commands (squeue, sacct, scancel) with one-line errors."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from aura_hpc.errors import LaunchError

FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
}
# How long the accounting may take to record a job's end after the controller (slurmctld sends it to slurmdbd on a
# queue of its own, later on a busy controller).
ACCOUNTING_LAG_S = 10.0
# What Slurm's clients say when the controller did not answer (a busy or restarting slurmctld).
NO_ANSWER = ("socket timed out", "unable to contact slurm controller", "zero bytes were transmitted", "connection refused")
# Ended, but kept pending by Slurm until someone releases or cancels the job: not final, and a wait on it never ends.
HELD_STATES = {
    "SPECIAL_EXIT": "it was requeued and held after a special exit (the cluster's epilog asked for it)",
    "REQUEUE_HOLD": "it was requeued and is held",
    "RESV_DEL_HOLD": "its reservation was deleted and Slurm holds it",
}
# A job's name and comment are free text (a `|` in --job-name arrives literally), so fields are split on
# ASCII's unit separator, a control character our own values refuse (slurm/script_safety.py).
SEP = "\x1f"
# JobArrayID: a sweep's element as `123_4` (the id its index and logs know); squeue's JobID is the raw id.
SQUEUE_FIELDS = (
    "JobArrayID", "Name", "State", "NumNodes", "TimeUsed", "TimeLeft", "Reason", "Comment", "SubmitTime", "UserName", "Dependency",
    "RestartCnt", "UserId",
)  # fmt: skip


@dataclass
class JobRow:
    job_id: str
    name: str
    state: str
    nodes: str
    elapsed: str
    time_left: str = ""
    reason: str = ""
    comment: str = ""
    submit: str = ""
    exit_code: str = ""
    source: str = "squeue"
    requeues: int = 0  # earlier attempts of this job (requeued), from sacct -D
    nodelist: str = ""  # the nodes it ran (or failed to start) on, from sacct
    dependency: str = ""  # what a pending job still waits for, as squeue says it: afterok:123_*(unfulfilled)
    user: str = ""  # whose job it is, as squeue names the owner (`cancel` cancels only the caller's own)
    uid: str = ""  # the owner's numeric id: what `cancel` compares (a name lookup that failed reads `nobody`)

    @property
    def active(self) -> bool:
        return self.state not in FINAL_STATES

    def to_dict(self) -> dict[str, str | bool]:
        return {
            "job_id": self.job_id,
            "name": self.name,
            "state": self.state,
            "nodes": self.nodes,
            "elapsed": self.elapsed,
            "time_left": self.time_left,
            "reason": self.reason,
            "submit": self.submit,
            "exit_code": self.exit_code,
            "source": self.source,
            "requeues": self.requeues,
        }


def require(command: str = "sbatch") -> None:
    if shutil.which(command) is None:
        if command == "sacct" and shutil.which("squeue"):  # a login node without the accounting client: Slurm is here
            raise LaunchError(
                "Slurm's sacct is not on PATH, though squeue is: finished jobs cannot be asked from this machine (fix: install "
                "Slurm's sacct here (Debian: slurm-client), or ask from another login node; `status` shows queued and running jobs)"
            )
        raise LaunchError(
            f"Slurm's {command} is not on PATH: this machine is not a Slurm login node "
            "(fix: run on the cluster's login node, `module load slurm`, or use `python -m aura_hpc local`)"
        )


NO_CONFIG = (
    "no Slurm configuration is reachable from this machine: {why} (fix: export SLURM_CONF=/path/to/the cluster's "
    "slurm.conf, or run on a login node whose slurmctld is reachable; `scontrol ping` must answer)"
)


def require_config() -> None:
    """A SLURM_CONF that names no file makes every Slurm command retry for 60 s before failing: say it now."""
    import os

    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        raise LaunchError(NO_CONFIG.format(why=f"SLURM_CONF={conf} does not exist"))


def _run(cmd: list[str], timeout: float = 30) -> str:
    require(cmd[0])
    require_config()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{cmd[0]} did not answer within {timeout:.0f}s (fix: check that slurmctld is up: scontrol ping)") from None
    if done.returncode != 0:
        raise LaunchError(explain(cmd[0], done.stderr or done.stdout))
    return done.stdout


# Slurm's error texts (lower case) -> what the user should change; the first match wins.
_NO_CONFIG_FIX = (
    "no Slurm configuration is reachable from this machine (no slurm.conf, and no controller found for a configless "
    "setup): export SLURM_CONF=/path/to/slurm.conf, or run on the cluster's login node"
)
_CONFIGLESS_STEPS = ("resolve_ctls_from_dns_srv:", "fetch_config:", "_establish_config_source:")
_FIXES: list[tuple[tuple[str, ...], str]] = [
    (("failed to fetch config", "dns srv lookup failed", "cannot stat file"), _NO_CONFIG_FIX),
    (
        ("unable to process configuration file",),
        "Slurm could not read its slurm.conf (its message names the key or line): correct that line, or export "
        "SLURM_CONF=/path/to/the cluster's slurm.conf",
    ),
    (  # before slurmctld's: its "Connection refused" is the accounting database's here (scontrol ping says all is well)
        ("problem talking to the database", "persistent connection"),
        "slurmdbd, the job accounting database, is not reachable: check `sacctmgr ping`, or ask your admins (`status` "
        "still shows queued and running jobs)",
    ),
    (("socket timed out",), "slurmctld is busy or restarting and did not answer in time: try again in a minute (`scontrol ping`)"),
    (
        ("unable to contact slurm controller", "connection refused", "connect failure"),
        "slurmctld is not reachable: check `scontrol ping` and SLURM_CONF, or ask your admins",
    ),
    (("invalid partition",), "choose a partition that `sinfo -s` lists (--partition NAME)"),
    (
        ("invalid account", "association"),
        "choose an account you belong to: `sacctmgr show assoc user=$USER format=account` (--account NAME)",
    ),
    (  # before "time limit": Slurm's text for every association or QOS limit names "time limits" too
        ("accounting/qos policy",),
        "the job is over a limit of your account or QOS (jobs queued or running, GPUs, nodes, wall time: the reason is in "
        "Slurm's message): see `sacctmgr show assoc user=$USER` and `sacctmgr show qos`, then wait for your other jobs "
        "to end or ask for less",
    ),
    (("time limit",), "ask for less time (--time) than the partition's limit shown by `sinfo -s`"),
    (
        ("invalid time specification",),
        "give the time as Slurm reads it (history --since, or a --begin of your profile): 2026-11-30, 2026-11-30T14:00, "
        "now-2days or now-6hours",
    ),
    (("qos",), "choose a QOS you may use (--qos NAME), see `sacctmgr show assoc user=$USER format=qos`"),
    (("invalid job id",), "check the job id with `python -m aura_hpc status --all` (finished jobs: history)"),
    (
        ("node configuration is not available", "requested node config"),
        "ask for fewer GPUs/CPUs/memory per node or fewer nodes than the partition has (`sinfo -N -l`)",
    ),
    (("accounting storage is disabled",), "this cluster keeps no job accounting; use `status` while jobs are queued or running"),
]
_DEFAULT_FIX = "see Slurm's message; `sinfo -s` and `scontrol show partition` show what the cluster offers"


def explain(command: str, stderr: str) -> str:
    """Slurm's own message plus what to change."""
    lines = [line.strip().removeprefix(f"{command}: ") for line in stderr.strip().splitlines() if line.strip()]
    low = " ".join(lines).lower()
    fix = next((fix for needles, fix in _FIXES if any(n in low for n in needles)), _DEFAULT_FIX)
    if fix is _NO_CONFIG_FIX:
        # Without a slurm.conf Slurm logs each place it then looked for a configless controller (DNS SRV records, a
        # fetch) before its fatal line: three lines of its internals in a laptop user's `status`, which the fix says
        # in words. A slurm.conf it could not read keeps every line (the one that names the bad line of the file).
        lines = [line for line in lines if not any(step in line for step in _CONFIGLESS_STEPS)] or lines
    return f"{command}: {' '.join(lines) or f'{command} failed'} (fix: {fix})"


def squeue(job_ids: list[str] | None = None, all_users: bool = False, all_states: bool = False) -> list[JobRow]:
    cmd = ["squeue", "-h", "-O", ",".join(f"{f}:{SEP}" for f in SQUEUE_FIELDS)]
    if job_ids:
        # One row per array element (-r): pending elements otherwise share one row, 123_[3,5,8-99%8], which squeue
        # also cuts at 31 characters (its id buffer), and the elements past the cut read as ended.
        cmd += ["-r", "-j", ",".join(job_ids)]
    elif not all_users:
        # The real uid (squeue takes ids): getpass reads LOGNAME/USER first, which `su`, `sudo -E` or a container
        # leave naming someone else, and `status` listed that user's jobs while `history` (sacct) read ours.
        cmd += ["-u", str(os.getuid())]
    if all_states:
        cmd += ["-t", "all"]
    rows = []
    for line in _run(cmd).splitlines():
        parts = [p.strip() for p in line.split(SEP)]
        if len(parts) < len(SQUEUE_FIELDS):
            continue
        v = dict(zip(SQUEUE_FIELDS, parts, strict=False))
        rows.append(
            JobRow(
                job_id=v["JobArrayID"],
                name=v["Name"],
                state=v["State"],
                nodes=v["NumNodes"],
                elapsed=v["TimeUsed"],
                time_left=v["TimeLeft"],
                reason="" if v["Reason"] == "None" else v["Reason"],
                comment="" if v["Comment"] == "(null)" else v["Comment"],
                submit=v["SubmitTime"],
                dependency="" if v["Dependency"] == "(null)" else v["Dependency"],
                user=v["UserName"],
                uid=v["UserId"] if v["UserId"].isdigit() else "",
                requeues=int(v["RestartCnt"]) if v["RestartCnt"].isdigit() else 0,
            )
        )
    return rows


def waits_for(dependency: str) -> tuple[list[str], bool]:
    """The jobs a dependency names (an array's `123_*` as its own id, 123), and whether any one of them suffices
    (`?`: Slurm's OR) rather than each (`,`). ([], True) where an OR names something other than a job (singleton) or
    a part not judged here (aftercorr): that part may pass without any of them."""
    any_one = "?" in dependency
    jobs: list[str] = []
    for part in dependency.replace("?", ",").split(","):
        if any_one and part.endswith("(failed)"):
            continue  # an OR's failed part: the others decide
        kind, _, ids = part.partition("(")[0].partition(":")
        named = [i.split("+")[0].removesuffix("_*") for i in ids.split(":") if i]
        # aftercorr:A_* waits for the element of A with its own index, not for the whole array: not judged here.
        if not kind.startswith("after") or kind == "aftercorr" or not named or not all(_JOB_ID.fullmatch(j) for j in named):
            if any_one:
                return [], True
            continue
        jobs += named
    return jobs, any_one


_JOB_ID = re.compile(r"\d+(_\d+)?")


def squeue_job(job_id: str) -> JobRow | None:
    """The job as slurmctld knows it now (finished ones stay for MinJobAge), or None."""
    return squeue_jobs([job_id])[job_id]


def squeue_jobs(job_ids: list[str]) -> dict[str, JobRow | None]:
    """Each job as slurmctld knows it now, or None, in one squeue call (a watch of a 100-point sweep asked
    100 times a second); one id per call where the controller refuses the list for an id it no longer has."""
    try:
        rows = squeue(job_ids, all_states=True)
    except LaunchError as exc:
        if "invalid job id" not in str(exc).lower():
            raise
        if len(job_ids) == 1:
            return {job_ids[0]: None}
        return {j: squeue_job(j) for j in job_ids}
    return {j: _one(j, rows, alone=len(job_ids) == 1) for j in job_ids}


def _one(job_id: str, rows: list[JobRow], alone: bool) -> JobRow | None:
    for r in rows:
        if r.job_id == job_id:
            return r
    # An array's own id (a sweep's, as `submit` printed it): squeue lists its elements, 123_0 and 123_[1-3].
    elements = [r for r in rows if r.job_id.partition("_")[0] == job_id]
    if elements:
        first = next((r for r in elements if r.active), elements[0])
        return dataclasses.replace(first, job_id=job_id)
    # An element still pending inside its array's one row: 123_[0-2] or 123_[2-99%4] holds 123_1.
    array, _, index = job_id.partition("_")
    for r in rows:
        head, _, spec = r.job_id.partition("_")
        if head == array and index.isdigit() and spec.startswith("[") and _in_spec(int(index), spec.lstrip("[").split("%")[0].rstrip("]")):
            return dataclasses.replace(r, job_id=job_id)
    return rows[0] if alone and len(rows) == 1 else None


def _in_spec(index: int, spec: str) -> bool:
    """Whether an array index is in Slurm's task list (`0-2,5,8-20:4`)."""
    for part in spec.split(","):
        span, _, step = part.partition(":")
        first, _, last = span.partition("-")
        try:
            lo, hi, every = int(first), int(last or first), int(step or 1)
        except ValueError:
            continue
        if lo <= index <= hi and (index - lo) % max(1, every) == 0:
            return True
    return False


SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "NNodes", "Submit", "NodeList", "Comment")


def accounting_enabled() -> bool:
    require("sacct")
    require_config()
    try:
        done = subprocess.run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        said = "sacct did not answer within 30s (fix: check that slurmctld and slurmdbd are up: scontrol ping, sacctmgr ping)"
        raise LaunchError(said) from None
    return "accounting storage is disabled" not in (done.stderr + done.stdout).lower()


def sacct(
    job_ids: list[str] | None = None, since: str | None = None, all_users: bool = False, attempts: bool = False, ended_as: str = ""
) -> list[JobRow]:
    """Accounting rows; with `attempts`, one row per attempt of a requeued job (sacct -D), oldest first. `ended_as`:
    only jobs that ended in these states since `since` (sacct -s ... -E now)."""
    cmd = ["sacct", "-n", "-P", f"--delimiter={SEP}", "-X", "-o", ",".join(SACCT_FIELDS)] + (["-D"] if attempts else [])
    if job_ids:
        cmd += ["-j", ",".join(job_ids)]
    if since:
        cmd += ["-S", since]
    if ended_as:
        cmd += ["-s", ended_as, "-E", "now"]
    if all_users:
        cmd += ["-a"]
    rows = []
    for line in _run(cmd).splitlines():
        parts = line.split(SEP)
        if len(parts) < len(SACCT_FIELDS):
            continue
        v = dict(zip(SACCT_FIELDS, parts, strict=False))
        rows.append(
            JobRow(
                job_id=v["JobID"],
                name=v["JobName"],
                state=v["State"].split()[0],  # "CANCELLED by 0" -> CANCELLED
                nodes=v["NNodes"],
                elapsed=v["Elapsed"],
                exit_code=v["ExitCode"],
                comment=v["Comment"],
                submit=v["Submit"],
                nodelist=v["NodeList"],
                source="sacct",
            )
        )
    return rows


def scancel(job_id: str, signal_name: str | None = None) -> None:
    cmd = ["scancel", job_id] if signal_name is None else ["scancel", f"--signal={signal_name}", job_id]
    _run(cmd)


def test_only(script: str) -> None:
    """`sbatch --test-only`: Slurm validates partition, account, QOS, time and resources; nothing is queued."""
    import tempfile

    require("sbatch")
    require_config()  # else sbatch retries for 60 s before it says there is no configuration
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="aura-test-only-") as f:
        f.write(script)
        f.flush()
        try:
            done = subprocess.run(["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            said = "sbatch --test-only did not answer within 90 s; nothing was queued (fix: check slurmctld: scontrol ping)"
            raise LaunchError(said) from None
    if done.returncode != 0:
        lines = []
        for ln in (done.stderr + "\n" + done.stdout).splitlines():
            ln = ln.strip()
            for prefix in ("sbatch: error:", "sbatch:"):
                if ln.lower().startswith(prefix):
                    ln = ln[len(prefix) :].strip()
            if ln and ln not in lines:
                lines.append(ln)
        raise LaunchError("the job was not submitted: " + explain("sbatch", "; ".join(lines)))
