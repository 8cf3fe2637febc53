"""What every Slurm task runs: the same trainer entry point as `local`, plus requeue.

Task layout: one task per GPU (one per node for a CPU job), started by `srun` in the batch
script that submitit generates. Slurm itself then starts, signals, accounts and kills every
rank, so a pre-timeout signal reaches all ranks at once and no second launcher (torchrun)
sits between Slurm and the trainer. Ranks come from SLURM_PROCID/SLURM_LOCALID through
aura_hpc.train.process.dist_env, exactly as under `local` they come from torchrun's variables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aura_hpc.errors import EXIT_RESUMABLE, EXIT_SCREEN

if TYPE_CHECKING:
    from aura_hpc.slurm.exclude import Stopped

log = logging.getLogger("aura_hpc")

SIGNAL_LAG_S = 15.0  # rank 0 waits this long for its own copy of a stop signal another rank acted on
PORT_BASE = 11000  # below Linux's ephemeral range (32768+), so a client socket never holds it
PORT_SPAN = 20000
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK")


def rendezvous_port(job_id: int, restart_count: int) -> int:
    """A port derived from the job id; a new one for each requeue so no old socket is in the way. Never torchrun's
    and c10d's defaults (29500, 29400), where other jobs' rendezvous on a shared node listen."""
    port = PORT_BASE + (job_id + 1009 * restart_count) % PORT_SPAN
    return port + 200 if 29400 <= port < 29600 else port


def first_node(nodelist: str) -> str:
    """The allocation's first hostname: where task 0 runs (never localhost, never the submit host).
    Slurm's own expansion where scontrol exists; inside a container image (Pyxis, Apptainer) there is
    usually no Slurm client, and the first host of the list is read from the expression itself."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True).stdout
        return out.split()[0]
    except (FileNotFoundError, subprocess.CalledProcessError):
        return first_host_of(nodelist)


def rendezvous_host(nodelist: str) -> str:
    """Where the ranks reach rank 0's store: the address srun was started from (SLURM_LAUNCH_NODE_IPADDR), else
    the allocation's first node's name.

    srun runs in the batch script, on the batch host: the allocation's first node in Slurm's own order, where
    task 0 runs. Each node's slurmstepd has already connected back to srun at the address its tasks are given
    (their output goes there), so every node reaches it. A node name need not be reached: on a site whose node
    names are in no DNS only NodeAddr reaches a node, and a Debian or Ubuntu node maps its own name to
    127.0.1.1. Asking nothing of the controller, it costs a job of a thousand ranks nothing either."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "").strip())
    except ValueError:  # unset: a task not started by srun
        return first_node(nodelist)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # srun's socket was an IPv6 one
        ip = ip.ipv4_mapped
    # An IPv6 address the stores do not take; loopback is this node's view alone (train/process/master_address.py).
    return str(ip) if ip.version == 4 and not ip.is_unspecified else first_node(nodelist)


def first_host_of(nodelist: str) -> str:
    """'gpu[007-012,020],cpu3' -> 'gpu007': the first name of a Slurm hostlist expression."""
    from aura_hpc.train.process.dist_env import hostnames

    return (hostnames(nodelist, 1) or [nodelist])[0]


class TrainJob:
    """The picklable callable submitit runs on every task."""

    launch: Any = None  # rank 0's goodput ledger of the job (launch/goodput.py), set when the task starts

    def __init__(self, config_path: str, requeue_signal: str = "USR2", max_requeues: int = 10) -> None:
        self.config_path = config_path
        self.requeue_signal = requeue_signal
        self.max_requeues = max_requeues

    def __call__(self) -> int:
        from aura_hpc.train.process import stop

        stop.record_early()
        e = os.environ
        # sbatch passes the submitting shell's environment on: a torchrun variable left there (RANK, WORLD_SIZE)
        # would be read before Slurm's own, and every task would take the same rank.
        for name in _TORCHRUN_VARIABLES:
            e.pop(name, None)
        job_id = int(e["SLURM_JOB_ID"])
        restarts = int(e.get("SLURM_RESTART_COUNT", "0"))
        rank = int(e.get("SLURM_PROCID", "0"))
        os.environ["MASTER_ADDR"] = rendezvous_host(e["SLURM_JOB_NODELIST"])
        os.environ["MASTER_PORT"] = str(rendezvous_port(job_id, restarts))
        from aura_hpc.train.process.startup_gc import imports_unscanned

        with imports_unscanned():
            from aura_hpc.train import worker

        watcher = _start_watchdog(self.config_path, job_id, restarts)
        lock = None
        if rank == 0:
            from pathlib import Path

            from aura_hpc.errors import AuraError
            from aura_hpc.launch.goodput import Launch
            from aura_hpc.launch.run_lock import RunLock
            from aura_hpc.train.process.time_ledger import process_started

            try:  # one trainer per run directory; a requeued attempt takes over its own lock
                lock = RunLock(Path(self.config_path).parent).acquire()
            except AuraError as exc:
                print(f"[rank0] {exc}", flush=True)
                raise SystemExit(exc.exit_code) from None
            # The goodput ledger of the whole job, across its requeues (launch/goodput.py).
            started = float(e.get("SLURM_JOB_START_TIME") or 0) or process_started()
            self.launch = Launch.of_slurm_job(Path(self.config_path).parent, job_id, started)
        from aura_hpc.slurm import exclude

        def why_not_leave_out(nodes: list[str]) -> str:  # the screen's named nodes, asked by rank 0
            if restarts >= self.max_requeues:
                return f"this job was already requeued {restarts} times (slurm.max_requeues={self.max_requeues})"
            return exclude.why_not_leave_out(job_id, nodes, Path(self.config_path).parent)

        try:
            status = worker.main([self.config_path], why_not_leave_out)
        finally:
            if lock is not None:
                lock.release()
            if watcher is not None and watcher.poll() is None:
                # This node's ranks are done: the watchdog leaves now (SIGTERM, through its cleanup), not at its next
                # look at the pages up to a second later, which the requeue and the goodput ledger would wait for.
                # One that handles a hang ignores SIGTERM: this task waits for its requeue (the step's processes are
                # killed once its last task has exited, the watchdog with them).
                watcher.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    watcher.wait(timeout=25)
        if status == EXIT_SCREEN:  # the screen named nodes the allocation can spare: requeued without them
            if rank != 0:
                print(f"[rank{rank}] this attempt stops here: rank 0 requeues the job without the nodes the screen named", flush=True)
                sys.stderr.flush()
                os._exit(0)
            if self._requeue(job_id, restarts):
                return 0
            raise SystemExit(EXIT_SCREEN)  # not requeued: the job did not train, and must not end COMPLETED
        if status == EXIT_RESUMABLE:
            if rank != 0:
                # Rank 0 carries the job's outcome; exiting 0 here keeps srun --kill-on-bad-exit from
                # killing rank 0 before it has requeued the job. Exiting directly also keeps submitit
                # from logging "Job completed successfully" for an attempt that was interrupted.
                print(f"[rank{rank}] this attempt stops here: rank 0 checkpoints and requeues the job", flush=True)
                sys.stderr.flush()
                os._exit(0)
            # The stop may have been another rank's signal (at the step boundary every rank learns it): Slurm
            # signals every task, but this one's can come seconds later on a loaded node, and the requeue is
            # decided here by what this task received.
            deadline = time.monotonic() + SIGNAL_LAG_S
            while stop.last_signal is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if stop.last_signal == f"SIG{self.requeue_signal}":
                self._requeue(job_id, restarts)
        if status != 0:
            # SystemExit (not an exception) so the job's exit code is the trainer's own status.
            raise SystemExit(status)
        if rank == 0 and (split := self.launch.finish()) is not None:
            from aura_hpc.launch.goodput import line

            print(f"[rank0] {line(split)}", flush=True)
        return 0

    def _requeue(self, job_id: int, restarts: int) -> bool:
        from aura_hpc.slurm import exclude

        def say(msg: str) -> None:
            print(f"[rank0] {msg}", flush=True)

        if stopped := exclude.why_stopped(job_id, restarts):
            return self._not_requeued(job_id, stopped, say)
        if restarts >= self.max_requeues:
            say(
                f"not requeued: this job was already requeued {restarts} times (slurm.max_requeues={self.max_requeues}) "
                "(fix: submit the same command again to resume from its newest checkpoint, or raise slurm.max_requeues)"
            )
            return False
        # Said before asking: a requeue signals the job's processes, scontrol and this one included.
        say(f"requeuing job {job_id} (requeue {restarts + 1} of at most {self.max_requeues}); it resumes from its newest checkpoint if any")
        sys.stdout.flush()
        from pathlib import Path

        judged, stopped = exclude.judge_unless_stopped(job_id, Path(self.config_path).parent, say, restarts)
        if stopped:
            return self._not_requeued(job_id, stopped, say)
        exclude.outlive_the_requeue()
        self.launch.requeued(time.time())
        failed = exclude.requeue(job_id)
        if failed:
            say(f"scontrol requeue {job_id} failed: {failed} (fix: resubmit the same command to resume)")
            return False
        exclude.apply_after_requeue(job_id, Path(self.config_path).parent, say, judged)
        return True

    def _not_requeued(self, job_id: int, stopped: Stopped, say: Callable[[str], None]) -> bool:
        """Said, and whether the job is back in the queue all the same (another hand requeued it)."""
        from pathlib import Path

        from aura_hpc.slurm import exclude

        say(stopped.line)
        if not stopped.requeued_anyway:
            return False
        if self.launch is not None:
            self.launch.requeued(time.time())
        exclude.after_another_hands_requeue(job_id, Path(self.config_path).parent, say)
        return True


def _start_watchdog(config_path: str, job_id: int, restarts: int) -> subprocess.Popen[bytes] | None:
    """This node's hang watchdog (slurm/watch.py), started by its first task, outside every rank's
    process: a stopped rank cannot watch itself. Every task of the node writes its progress page into
    one node-local folder for this attempt."""
    from pathlib import Path

    from aura_hpc.config import load_config
    from aura_hpc.train.process import progress

    if not load_config(config_path).health.hang_watch:
        return None
    from aura_hpc.train.process.dist_env import node_name

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    # The node's name in it: several slurmd on one host (the test cluster, a multi-slurmd setup) share /dev/shm.
    folder = base / f"aura-progress-slurm-{job_id}-{restarts}-{node_name()}"
    untrusted = progress.shared_folder(folder)
    if untrusted:
        rank = os.environ.get("SLURM_PROCID", "?")
        print(f"[rank{rank}] no hang watchdog on this node for this attempt: {untrusted} (fix: remove it; see who made it)", flush=True)
        return None
    os.environ[progress.ENV] = str(folder)
    from aura_hpc.launch.hang_evidence import prepare_flight_recorder

    prepare_flight_recorder(folder, Path(config_path).parent)
    if os.environ.get("SLURM_LOCALID", "0") != "0":
        return None
    # A page left by a task Slurm killed outright, under a job id a restarted controller handed out again:
    # our own file (a rank's page, by name), and no rank of this attempt writes before this task has joined.
    progress.remove_pages(folder)
    cmd = [sys.executable, "-m", "aura_hpc.slurm.watch", config_path, str(folder), str(job_id), str(restarts), str(os.getpid())]
    return subprocess.Popen(cmd, start_new_session=True)


class CheckJob:
    """`submit --check`: `python -m aura_hpc check` on every node of the allocation (one task per node)."""

    def __init__(self, backend: str, shared_dir: str, timeout: float = 60.0) -> None:
        self.backend = backend
        self.shared_dir = shared_dir
        self.timeout = timeout

    def __call__(self) -> int:
        e = os.environ
        job_id, restarts = int(e["SLURM_JOB_ID"]), int(e.get("SLURM_RESTART_COUNT", "0"))
        from aura_hpc.ops import check
        from aura_hpc.train.process import master_address
        from aura_hpc.train.process.dist_env import DistEnv

        # Where training's ranks meet, node 0 included: its store listens where the other nodes reach it, not at a
        # loopback address srun reached its own slurmd at (check must not fail where training works, nor pass where it fails).
        e["MASTER_ADDR"] = rendezvous_host(e["SLURM_JOB_NODELIST"])
        if gloo := master_address.gloo_interface(DistEnv.from_environ()):  # as training's join() sets it; NCCL's left to NCCL
            e["GLOO_SOCKET_IFNAME"] = gloo[0]
        cluster = check.cluster_args(
            int(e.get("SLURM_NNODES", "1")),
            int(e.get("SLURM_NODEID", "0")),
            master_address.dialled(DistEnv.from_environ()),
            rendezvous_port(job_id, restarts),
            backend=self.backend,
            shared_dir=self.shared_dir,
            timeout=self.timeout,
            typed_master=False,
        )
        status = check.run_and_show(self.shared_dir, cluster)
        if status != 0:
            raise SystemExit(status)
        return 0
