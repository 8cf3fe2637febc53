"""One trainer per run directory: RUN_DIR/run.lock names the holder's host and PID.

Two trainers in one run directory resume from each other's checkpoints and write the same steps
twice. The lock is created with link(2), atomic on local filesystems and NFS alike (O_EXCL is
not on old NFS), and refreshed by a heartbeat. A lock whose holder is gone is taken over: the
same host can ask the kernel whether the PID lives; another host's lock is stale once its
heartbeat stops; a requeued Slurm job takes over its own earlier attempt's lock at once.
Takeover renames the stale file away first, so of two processes taking over only one wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from aura_hpc.errors import LaunchError
from aura_hpc.processes import alive

LOCK_NAME = "run.lock"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 90.0  # six missed heartbeats: the holder's host is down or cut off


def workers_left(run_dir: Path, parent: int | None = None) -> list[int]:
    """This host's workers of `run_dir` (`python -m aura_hpc.train RUN_DIR/config*.yaml`) still alive: a
    launcher killed outright leaves them to finish their step and checkpoint, as a second trainer would.
    `parent`: only the children of that process (a launcher's own, not another LAN node's on this host)."""
    here = {str(run_dir), str(Path(run_dir).resolve())}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if parent is not None and f"\nPPid:\t{parent}\n" not in (proc / "status").read_text(errors="replace"):
                continue
        except OSError:
            continue
        if "aura_hpc.train" in argv and any(os.path.dirname(a) in here for a in argv) and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return sorted(found)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _started(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), "" where unknown: with the
    PID, a process no later one can be taken for (PIDs are reused; a launcher killed outright left its lock)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _pid_namespace() -> str:
    """This process's PID namespace (Linux): PIDs of another one (a container's) name other processes here."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _boot_id() -> str:
    """This boot of the machine (Linux): a PID from another boot is another process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return ""


class RunLock:
    """Held from acquire() until release(); a daemon thread refreshes its mtime meanwhile."""

    def __init__(self, run_dir: Path, pid: int | None = None) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.record = {
            "host": socket.gethostname(),
            "pid": pid or os.getpid(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "token": uuid.uuid4().hex,
            "boot_id": _boot_id(),
            "pid_started": _started(pid or os.getpid()),
            "pid_ns": _pid_namespace(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder_is_gone(self, holder: dict[str, Any], mtime: float, now: float | None = None) -> bool:
        """`now`: the lock's filesystem's time (fs_now): on NFS the heartbeat's mtime is the server's clock."""
        same_job = holder.get("slurm_job_id") and holder.get("slurm_job_id") == self.record["slurm_job_id"]
        if same_job and str(holder.get("slurm_restart", "0")) != self.record["slurm_restart"]:
            return True  # this job's earlier attempt (requeued): it ran on nodes that have let go
        # The same attempt of a job: a second `local` inside one allocation (salloc) took a live trainer's run directory.
        if holder.get("host") == self.record["host"]:
            pid = int(holder.get("pid", 0))
            # Our own PID: a launcher restarted in a container, as PID 1 again. A lock of an earlier boot (a power cut)
            # names a PID another program may hold now: not a trainer to wait for, nor to kill.
            rebooted = bool(holder.get("boot_id")) and holder.get("boot_id") != self.record["boot_id"]
            # Its PID taken by a process started since (the launcher was killed outright): `status` read it running.
            # Judged only where both start times are known (a /proc mounted hidepid hides another user's) and the PID
            # is one of our namespace's (a container's launcher, on a host sharing its name, has a PID of its own).
            then, started = holder.get("pid_started"), _started(pid)
            reused = bool(then and started) and then != started and holder.get("pid_ns") == self.record["pid_ns"] != ""
            if pid != os.getpid() and alive(pid) and not rebooted and not reused:
                return False
            left = workers_left(self.path.parent)
            if left:
                pids = " ".join(map(str, left))
                raise LaunchError(
                    f"run directory {self.path.parent}'s launcher (PID {holder.get('pid')}) is gone but its workers still run "
                    f"(PIDs {pids}): they stop at their next step, after a checkpoint (fix: wait for them, or kill {pids})"
                )
            return True
        return (time.time() if now is None else now) - mtime > STALE_AFTER_S

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LOCK_NAME}.{self.record['token']}")
        tmp.write_text(json.dumps(self.record), encoding="utf-8")
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    self._start_heartbeat()
                    return self
                except FileExistsError:
                    pass
                holder = read_json(self.path)
                try:
                    mtime = self.path.stat().st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile
                if holder is not None and not self.holder_is_gone(holder, mtime, fs_now(self.path.parent, tmp)):
                    raise LaunchError(describe_holder(self.path, holder))
                # Stale (or unreadable, left half-written by a crash): move it aside; a concurrent
                # taker finds it gone and loses the race for the link above.
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.path, self.path.with_name(f".{LOCK_NAME}.stale.{self.record['token']}"))
                    for old in self.path.parent.glob(f".{LOCK_NAME}.stale.*"):
                        old.unlink(missing_ok=True)
            raise LaunchError(f"could not take the run lock {self.path} (fix: remove the file if no trainer runs there)")
        finally:
            tmp.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=beat, name="aura-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        holder = read_json(self.path)
        if holder is not None and holder.get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe_holder(path: Path, holder: dict[str, Any]) -> str:
    job = holder.get("slurm_job_id")
    who = (
        f"Slurm job {job} (PID {holder.get('pid')} on {holder.get('host')})" if job else f"PID {holder.get('pid')} on {holder.get('host')}"
    )
    stop = f"scancel {job}" if job else f"stop it (kill {holder.get('pid')} on {holder.get('host')})"
    return (
        f"run directory {path.parent} is in use by {who} since {holder.get('since')}: one trainer per run directory "
        f"(fix: wait for it to finish or {stop}, or use another --run-name)"
    )


def fs_now(folder: Path, fresh: Path | None = None) -> float:
    """The time by the clock that stamps `folder`'s files: a file written now (`fresh`, or a probe of our own,
    removed at once). On NFS the server stamps the heartbeat's mtime: a login node whose clock ran 90 s ahead
    of it took a live trainer's lock for a stale one and wrote over its run directory."""
    probe = fresh or folder / f".aura-clock.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        if fresh is None:
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return probe.stat().st_mtime
    except OSError:  # a read-only place: this machine's clock, as before
        return time.time()
    finally:
        if fresh is None:
            with contextlib.suppress(OSError):
                probe.unlink()


def stamped_here(path: Path, folder: Path) -> float:
    """`path`'s mtime by this machine's clock, from how far the clock that stamps `folder`'s files (an NFS server's)
    runs from it; 0.0 where it cannot be read. A checkpoint written after a stop, stamped by a server 2 s behind,
    read as one written before it (exit 130, not 75)."""
    try:
        stamped = path.stat().st_mtime
    except OSError:
        return 0.0
    return stamped - (fs_now(folder) - time.time())


def check_free(run_dir: Path) -> None:
    """Refuse when a live trainer holds the run directory (used before writing anything into it)."""
    path = Path(run_dir) / LOCK_NAME
    holder = read_json(path)
    if holder is None:
        return
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return
    if not RunLock(Path(run_dir)).holder_is_gone(holder, mtime, fs_now(path.parent)):
        raise LaunchError(describe_holder(path, holder))
