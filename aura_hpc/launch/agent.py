"""Running a LocalPlan's workers under torch's elastic agent, and the verdict on how they ended.

The agent's options changed across the torch releases we support (pyproject's range): 2.6-2.7
have no `shutdown_timeout` and no `signals_to_handle`. What a release lacks is detected, not
assumed, and replaced by the older behaviour with a one-line note.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
from typing import TYPE_CHECKING, Any

from aura_hpc.comm import rendezvous_state, stores
from aura_hpc.errors import (
    EXIT_DATA_UNAVAILABLE,
    EXIT_DIVERGED,
    EXIT_GPU_FAULT,
    EXIT_HUNG,
    EXIT_RESUMABLE,
    EXIT_SCREEN,
    EXIT_TRAIN_FAILED,
    EXIT_USER_ERROR,
    LaunchError,
    TrainingFailed,
)
from aura_hpc.launch import agent_folder, final_status, worker_logs
from aura_hpc.launch.native_stderr import native_stderr_to
from aura_hpc.launch.nccl_aborts import latest_attempts, waited_on_a_peer
from aura_hpc.launch.plan import LocalPlan
from aura_hpc.launch.spare_watch import SpareWatch

if TYPE_CHECKING:
    from aura_hpc.launch.hang_board import HangBoard
    from aura_hpc.launch.hang_watch import Hang
    from aura_hpc.launch.stop_signals import StopSignals

RDZV_RUN_ID = "aura_hpc"
# Forwarded to the workers like SIGTERM: SIGUSR2 is the pre-timeout/preemption signal.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
# What torch's agent waits for the workers after a stop signal when it cannot be told otherwise.
OLD_AGENT_SHUTDOWN_S = 30


def agent_options(shutdown_timeout: int) -> tuple[dict[str, Any], list[str]]:
    """The LaunchConfig keywords this torch accepts for graceful stops, and notes on what it lacks."""
    import torch
    from torch.distributed.launcher.api import LaunchConfig

    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    options: dict[str, Any] = {}
    notes = []
    if "shutdown_timeout" in fields:
        # On Ctrl+C/SIGTERM the agent forwards the signal and waits this long for the workers to
        # finish their step and write a checkpoint before it kills them.
        options["shutdown_timeout"] = shutdown_timeout
    else:
        notes.append(
            f"note: torch {torch.__version__}'s launcher gives workers {OLD_AGENT_SHUTDOWN_S}s (not {shutdown_timeout}s) "
            "to write their checkpoint after a stop signal"
        )
    nohup = hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # ignored it stays, not handled
    if "signals_to_handle" in fields:
        options["signals_to_handle"] = FORWARDED_SIGNALS.replace("SIGHUP,", "" if nohup else "SIGHUP,")
    elif nohup:  # older agents handle SIGHUP whatever the launcher inherited
        notes.append(f"note: torch {torch.__version__}'s launcher stops the run on a hangup even under nohup (fix: start it with setsid)")
    return options, notes


def run_workers(plan: LocalPlan) -> int:
    """Run the plan's workers through the elastic agent; returns the exit status for the CLI."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.launcher.api import LaunchConfig

    from aura_hpc import console
    from aura_hpc.launch.goodput import Launch
    from aura_hpc.launch.goodput import line as goodput_line
    from aura_hpc.launch.hang_watch import EVIDENCE_WAIT_S, HangWatch
    from aura_hpc.launch.stop_signals import StopSignals, forward_like_sigterm
    from aura_hpc.train.process.time_ledger import process_started

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):  # the verdict on failed workers is ours
        logging.getLogger(name).setLevel(logging.CRITICAL)
    stores.register_rendezvous()
    options, notes = agent_options(plan.shutdown_timeout)
    for note in notes:
        console.info(note)
    if "signals_to_handle" not in options and hasattr(signal, "SIGUSR2"):  # older agents: SIGUSR2 would orphan the workers
        signal.signal(signal.SIGUSR2, forward_like_sigterm(signal.SIGUSR2))
    watch = HangWatch.for_run(plan.cfg, _board(plan)) if plan.cfg.health.hang_watch else None
    stops = StopSignals()
    stops.install()
    launch = Launch.begin(plan.cfg.run_dir, process_started()) if plan.node_rank == 0 else None
    if watch is not None:
        watch.stops = stops
    hung_in_a_row, furthest = 0, -1
    # The agent's per-rank folders (error files our workers don't write): without ours it leaves an empty torchelastic_* in /tmp
    agent_dir = agent_folder.make()
    try:
        lc = LaunchConfig(
            min_nodes=plan.nnodes,
            max_nodes=plan.nnodes,
            nproc_per_node=plan.nproc,
            run_id=RDZV_RUN_ID,
            role="trainer",
            rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
            rdzv_backend=stores.RDZV_BACKEND,  # torch's c10d, its stores bound to one address
            rdzv_configs={"join_timeout": plan.rdzv_timeout, "is_host": plan.node_rank == 0},
            max_restarts=plan.max_restarts,
            monitor_interval=0.2,
            start_method="spawn",
            local_addr=plan.local_addr,
            logs_specs=DefaultLogsSpecs(log_dir=agent_dir),
            **options,
        )
        while True:
            seen = len(watch.hangs) if watch is not None else 0
            if watch is not None:
                watch.start()
            try:
                try:
                    return _launch_once(plan, lc, stops)
                except TrainingFailed as failed:
                    if watch is not None:
                        watch.settle(EVIDENCE_WAIT_S + 30)  # the other nodes' kill may come while this node's watchdog still waits
                    peer = watch.peer_hang() if watch is not None and len(watch.hangs) == seen else None
                    if peer is not None and launch is not None and failed.exit_code == EXIT_TRAIN_FAILED:
                        launch.hang(peer.last_progress, time.time())
                    # A hang before the agent restarted in place is not why this attempt ended (a crash after it).
                    hang = watch.hangs[-1] if watch is not None and len(watch.hangs) > seen else None
                    hang = None if hang is not None and watch is not None and hang.killed_at < watch.started else hang
                    if hang is None and watch is not None and failed.exit_code == EXIT_TRAIN_FAILED:
                        # Another node declared the hang and killed its workers: ours then failed on the broken collectives.
                        hang = watch.peer_hang()
                        if hang is not None:
                            console.error(hang.line)
                    if hang is None or failed.exit_code != EXIT_TRAIN_FAILED:
                        raise  # no hang, or the agent restarted after it and the run then ended otherwise (diverged, ...)
                    hung_in_a_row = 1 if hang.progress_step > furthest else hung_in_a_row + 1
                    furthest = max(furthest, hang.progress_step)
                    budget = plan.cfg.health.hang_restarts
                    if hung_in_a_row > budget:
                        raise _hung(plan, hang, hung_in_a_row - 1) from None
                    every = " on every node" if plan.nnodes > 1 else ""
                    console.info(
                        f"restarting the workers{every} from the newest checkpoint after the hang "
                        f"(hang restart {hung_in_a_row} of at most {budget} in a row without progress)"
                    )
                    if watch is not None and watch.board is not None and plan.node_rank > 0:
                        watch.board.wait_for_a_new_store(plan.rdzv_timeout)  # node 0 makes the rendezvous anew
                finally:
                    if watch is not None:
                        watch.stop()
                        for h in watch.hangs[seen:] if launch is not None else []:
                            launch.hang(h.last_progress, h.killed_at)
            except SignalException as exc:  # a stop between attempts (a hang settling, node 0's new store awaited)
                return _resumable(plan, exc.sigval.name, stops.poll())
    finally:
        stops.close()
        shutil.rmtree(agent_dir, ignore_errors=True)
        if launch is not None and (split := launch.finish()) is not None and split["seconds"]["start-up"] > 0:
            console.info(goodput_line(split))
        if watch is not None:
            watch.close()


def _board(plan: LocalPlan) -> HangBoard | None:
    """Where a LAN run's nodes tell each other about a hang (node 0's rendezvous store)."""
    from aura_hpc.launch.hang_board import HangBoard

    if plan.nnodes == 1:
        return None
    return HangBoard(plan.master_addr, plan.master_port, plan.node_rank, plan.nnodes, os.environ.get(stores.SECRET_ENV, ""))


def _hung(plan: LocalPlan, hang: Hang, restarts: int) -> TrainingFailed:
    """The verdict on a run the watchdog found hung and no longer restarts."""
    if plan.cfg.health.hang_restarts == 0:
        why = "no restart after a hang (health.hang_restarts=0)"
    else:
        why = f"it hung again after {restarts} restart(s) without progress (health.hang_restarts): fix the cause, then re-run"
    return TrainingFailed(f"{hang.line}; {why}; {_resume_hint(plan)}", EXIT_HUNG)


def _launch_once(plan: LocalPlan, lc: Any, stops: StopSignals | None = None) -> int:
    """One launch of the workers by the elastic agent (which restarts them up to --max-restarts)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    cmd = plan.worker_cmd
    started = time.time()
    stores.forget_tampering()
    stderr_log = plan.cfg.run_dir / "logs" / f"stderr_node{plan.node_rank}.log"
    since = stderr_log.stat().st_size if stderr_log.is_file() else 0
    logs_since = worker_logs.offsets(plan)
    guard, spare = final_status.Guard(plan, logs_since), SpareWatch(plan, f"torch.rendezvous.{RDZV_RUN_ID}")
    try:
        with native_stderr_to(stderr_log), guard, spare:
            try:
                elastic_launch(lc, cmd[0])(*cmd[1:])
            except AttributeError as exc:  # torch's launcher reads the result a spare's agent does not return (launcher/api.py)
                if not SpareWatch.ended_as_spare(exc):
                    raise
                raise LaunchError(spare.line(waiting=False)) from None
    except SignalException as exc:
        return _resumable(plan, exc.sigval.name, stops.poll() if stops is not None else None)
    except final_status.FinalStatus as final:  # a restart would have ended the same way: --max-restarts is for crashes
        guard.hold()  # node 0: the others learn why from its store
        if final.node is None:
            return _ended(plan, [final.code], {}, since, logs_since)
        if (what := _tampering(plan)) is not None:  # a stranger's hand in the store: no word read there is taken
            raise _tampered(plan, what) from None
        return _ended_elsewhere(plan, final)
    except ChildFailedError as exc:
        if (what := _tampering(plan)) is not None:
            raise _tampered(plan, what) from None  # the workers stopped because the agent (here or on another node) did
        return _ended(plan, [f.exitcode for f in exc.failures.values()], exc.failures, since, logs_since)
    except RendezvousError as exc:
        trained = worker_logs.trained_since(plan, started)  # the node's logs, read once
        if (what := _tampering(plan, ran=trained)) is not None:  # a failed join asks no one
            raise _tampered(plan, what) from None
        if spare.spare and not trained:  # it waited, a spare, until node 0 went away
            raise LaunchError(spare.line(waiting=False)) from None
        if trained:
            refused = worker_logs.refused_here(plan)
            if refused:
                # This node's worker refused its input (a setting that differs from node 0's): node 0's
                # launcher, refusing it too, may close the rendezvous before this one reads the statuses.
                raise TrainingFailed(f"{refused} (see {plan.cfg.run_dir / 'logs'})", EXIT_USER_ERROR) from None
            # The rendezvous host (node 0's launcher) went away after the nodes had joined and trained.
            raise _lost_master(plan) from None
        if "(fix:" in str(exc):  # ours (comm/stores.py): it already names the problem and the fix
            raise LaunchError(str(exc).strip().splitlines()[0]) from None
        if plan.nnodes == 1:
            raise LaunchError(
                f"this machine's workers did not join at {plan.master} within {plan.rdzv_timeout}s "
                f"({type(exc).__name__}) (fix: another --master-port, or omit it so a free one is picked)"
            ) from None
        raise LaunchError(
            f"the {plan.nnodes} nodes did not all join at {plan.master_addr}:{plan.master_port} within "
            f"{plan.rdzv_timeout}s ({type(exc).__name__}) (fix: start every node with the same --nnodes, "
            f"--master-addr and --master-port, and check the firewall; nodes started minutes apart: --rdzv-timeout "
            f"{max(600, plan.rdzv_timeout * 2)} on every node)"
        ) from None
    finally:
        guard.store = None  # node 0's next attempt (after a hang) binds the same port: no reference may keep this one open
    return 0


def _ended(plan: LocalPlan, codes: list[int], failures: dict[int, Any], since: int, logs_since: worker_logs.Offsets) -> int:
    """The verdict on workers that exited with `codes` (`failures`: torch's record of each, {} when the launch
    ended before a restart: final_status.py); a status for the CLI, or TrainingFailed."""
    from aura_hpc import console

    # Every rank stopped resumably; one still shutting down when a peer had already exited is
    # SIGTERMed by the agent, after the (collective) checkpoint: that is no failure.
    if EXIT_RESUMABLE in codes and all(c in (EXIT_RESUMABLE, -signal.SIGTERM) for c in codes):
        return _resumable(plan, "a stop signal to the workers")
    if EXIT_DATA_UNAVAILABLE in codes and all(c in (EXIT_DATA_UNAVAILABLE, -signal.SIGTERM) for c in codes):
        console.error(worker_logs.data_unavailable_line(plan))
        return EXIT_DATA_UNAVAILABLE
    if EXIT_SCREEN in codes and all(c in (EXIT_SCREEN, -signal.SIGTERM) for c in codes):  # SIGTERM alone is no screen
        console.error(
            f"pre-flight screening named a node below its figures (health.screen; see {plan.cfg.run_dir / 'screen'}): "
            "check or replace that machine, or train without it"
        )
        return EXIT_SCREEN
    if EXIT_GPU_FAULT in codes:
        console.error(
            f"the GPU circuit breaker stopped training (see {plan.cfg.run_dir / 'logs'}): take this machine's GPU out of "
            "service before training on it again; re-run the same command on healthy hardware to resume"
        )
        return EXIT_GPU_FAULT
    raise _failure(plan, failures, since, logs_since, set(codes)) from None


_MEANING = {
    EXIT_USER_ERROR: "a worker refused its input",
    EXIT_DIVERGED: "the loss stayed non-finite",
    EXIT_DATA_UNAVAILABLE: "its training data could not be read",
    EXIT_GPU_FAULT: "the GPU circuit breaker",
    EXIT_SCREEN: "the pre-flight screen named a node",
}


def _ended_elsewhere(plan: LocalPlan, final: final_status.FinalStatus) -> int:
    """Another node's workers ended the run for good: this node's are not restarted either."""
    if final.code == EXIT_RESUMABLE:
        return _resumable(plan, f"a stop signal to node {final.node}'s workers")
    raise TrainingFailed(
        f"node {final.node} ended the run with status {final.code} ({_MEANING.get(final.code, 'see its terminal')}), so "
        f"this node's workers were not restarted (see that node's terminal and {plan.cfg.run_dir / 'logs'}); {_resume_hint(plan)}",
        EXIT_TRAIN_FAILED,
    )


def _lost_master(plan: LocalPlan) -> TrainingFailed:
    return TrainingFailed(
        f"lost node 0 (the master at {plan.master}, which hosts the rendezvous) while "
        f"training: its launcher or machine stopped (see {plan.cfg.run_dir / 'logs'}); rank 0 runs there, so the "
        f"re-run resumes from node 0's newest checkpoint (fix: start node 0 again, then this command on every node)",
        EXIT_TRAIN_FAILED,
    )


def _tampering(plan: LocalPlan, ran: bool = True) -> rendezvous_state.StateTampered | None:
    return stores.tampering_at(plan.master_addr, plan.master_port, RDZV_RUN_ID, plan.nnodes, plan.node_rank, ran)


def _tampered(plan: LocalPlan, what: rendezvous_state.StateTampered) -> TrainingFailed:
    """Someone who is not one of the run's launchers deleted or rewrote the rendezvous state in node 0's store."""
    stores.hold_for_the_other_nodes(plan.nnodes)  # node 0: until the others have read it there and named it too
    port = f"port {plan.master_port}" if plan.master_port else "its port"
    return TrainingFailed(
        f"the rendezvous state in node 0's store at {plan.master} was {what} by a program that is "
        f"not one of this run's launchers (anyone who reaches that port can: docs/lan.md, Trust), so the run stopped; "
        f"{_resume_hint(plan)} on every node (fix: let only your own machines reach {port}: a firewall "
        "rule, a VPN)",
        EXIT_TRAIN_FAILED,
    )


def _master_gone(plan: LocalPlan) -> bool:
    """Node 0's rendezvous port no longer answers: its launcher (or machine) is gone."""
    import socket

    try:
        with socket.create_connection((plan.master_addr, plan.master_port), timeout=2.0):
            return False
    except OSError:
        return True


def _failure(
    plan: LocalPlan,
    failures: dict[int, Any],
    since: int = 0,
    logs_since: worker_logs.Offsets | None = None,
    said_codes: set[int] | None = None,
) -> TrainingFailed:
    """The one-line verdict on failed workers, with the exit status README.md documents (`since`: where this
    launch began in the node's stderr log; `said_codes`: the statuses, when torch's `failures` are not at hand)."""
    log_dir = plan.cfg.run_dir / "logs"
    # The agent stops the remaining workers with SIGTERM once one has failed; a worker already
    # on its way out then dies of it. Those are not what went wrong.
    codes = {f.exitcode for f in failures.values() if f.exitcode != -signal.SIGTERM} or {f.exitcode for f in failures.values()}
    codes = codes or {c for c in said_codes or () if c != -signal.SIGTERM}
    said = worker_logs.worker_error(plan, logs_since)
    if codes == {EXIT_DIVERGED}:
        return TrainingFailed(f"training stopped: {said or 'the loss stayed non-finite'} (see {log_dir})", EXIT_DIVERGED)
    if codes == {EXIT_USER_ERROR} and said:
        # A worker refused its input (e.g. a checkpoint that does not fit): nothing was trained.
        return TrainingFailed(f"{said} (see {log_dir})", EXIT_USER_ERROR)
    if EXIT_USER_ERROR in codes and codes <= {EXIT_USER_ERROR, EXIT_TRAIN_FAILED} and said and not said.startswith(worker_logs.LOST_PEER):
        # One rank refused its input mid-run (damaged data), and the others lost it: its line, the resume after the fix.
        return TrainingFailed(f"{said} (see {log_dir}); {_resume_hint(plan)}", EXIT_USER_ERROR)
    if said and said.startswith(("no space left on", "could not write checkpoint")):
        return TrainingFailed(f"training failed: {said}", EXIT_TRAIN_FAILED)  # it names what is intact and the fix
    killed = [f for f in failures.values() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    if said and said.startswith(worker_logs.LOST_PEER) and not killed:
        # A peer on another node went away (a rank of this node killed by a signal is named below instead).
        # When it was node 0 as a whole, the workers may notice before the agent does: say so
        # (checkpoints are written there), not "no checkpoint yet" from this node's point of view.
        if plan.node_rank > 0 and _master_gone(plan):
            return _lost_master(plan)
        return TrainingFailed(f"training failed: {said} (see {log_dir}); {_resume_hint(plan)}", EXIT_TRAIN_FAILED)
    # A killed rank makes its peers fail too (broken collectives): name every failed rank, the ones killed by
    # a signal first, since they are usually the cause, unless NCCL took them down for waiting on a peer.
    attempts = latest_attempts(log_dir, plan.node_rank, since)
    waited = waited_on_a_peer(attempts, failures)
    ordered = sorted(failures.items(), key=lambda kv: (kv[0] in waited, kv[1].exitcode >= 0, kv[1].timestamp))
    why = {r: f"was ended by NCCL ({waited[r]}: it waited on another rank)" for r in waited}
    name = {r: attempts.name(f, r, plan.nnodes, plan.node_rank) for r, f in failures.items()}  # its rank_N.log's N
    what = "; ".join(f"{name[r]} {why.get(r) or _exit_description(f.exitcode)}" for r, f in ordered)
    restarts = f" after {plan.max_restarts} restart(s)" if plan.max_restarts else ""
    return TrainingFailed(f"training failed{restarts}: {what} (see {log_dir}); {_resume_hint(plan)}", EXIT_TRAIN_FAILED)


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _resume_hint(plan: LocalPlan) -> str:
    from aura_hpc.train.checkpoint import files as checkpoint

    ckpts = checkpoint.list_complete(plan.cfg.run_dir / "checkpoints")
    if _checkpoints_elsewhere(plan):
        return "to resume from node 0's newest checkpoint (node 0 keeps them), fix the cause and re-run the same command on every node"
    where = f"from {ckpts[0].path.name}" if ckpts else "(no checkpoint yet: it starts from step 0)"
    return f"to resume {where}, fix the cause and re-run the same command"


def _checkpoints_elsewhere(plan: LocalPlan) -> bool:
    """A LAN node > 0 without storage shared with node 0: its run folder has no checkpoints/ at all."""
    return plan.node_rank > 0 and not (plan.cfg.run_dir / "checkpoints").is_dir()


def _resumable(plan: LocalPlan, why: str, asked: tuple[signal.Signals, float] | None = None) -> int:
    """A stop: exit 75 when a checkpoint was written after the signal (README: resumable, nothing lost);
    otherwise (the ranks were hung, or died first) 128 + the signal, saying which checkpoint a re-run
    resumes from."""
    from aura_hpc import console
    from aura_hpc.launch.run_lock import stamped_here
    from aura_hpc.train.checkpoint import files as checkpoint

    ckpts = checkpoint.list_complete(plan.cfg.run_dir / "checkpoints")
    if _checkpoints_elsewhere(plan):  # this node's ranks say whether every rank's stop was checkpointed (on node 0)
        if worker_logs.exited_with(plan, EXIT_RESUMABLE):
            console.info(f"stopped by {why}: node 0 saved the checkpoint (it keeps them); re-run the same command on every node to resume")
            return EXIT_RESUMABLE
        console.error(f"stopped by {why}; re-run the same command on every node to resume from node 0's newest checkpoint")
        return EXIT_RESUMABLE if asked is None else 128 + int(asked[0])
    if asked is None:  # the workers stopped by themselves (a signal sent to them): they say what they saved
        saved = f"checkpoint {ckpts[0].path.name} saved" if ckpts else "no checkpoint was saved"
        console.info(f"stopped by {why}: {saved}; re-run the same command to resume")
        return EXIT_RESUMABLE
    if ckpts and stamped_here(ckpts[0].path / checkpoint.MARKER, ckpts[0].path.parent) >= asked[1] - 1.0:
        console.info(f"stopped by {why}: checkpoint {ckpts[0].path.name} saved; re-run the same command to resume")
        return EXIT_RESUMABLE
    sig = asked[0]
    where = f"from {ckpts[0].path.name}, the newest" if ckpts else "from step 0: there is no checkpoint yet"
    console.error(f"stopped by {why} before a checkpoint could be written; re-run the same command to resume {where}")
    return 128 + int(sig)
