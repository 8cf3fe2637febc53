"""The one worker entry point: `python -m aura_hpc.train RUN_DIR/config.yaml`.

Every launcher starts it the same way (`local` through torch's elastic agent, `submit` under
Slurm, where aura_hpc.slurm.job calls `main` directly); it reads rank and world size from the
environment through DistEnv alone.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import torch._dynamo  # noqa: F401  (every optimizer imports it on its first parameter group: here, where the entry points import unscanned)

from aura_hpc.config import load_run_file
from aura_hpc.errors import EXIT_TRAIN_FAILED, EXITING_LINE, FINAL_LINE, NOT_RESTARTED, AuraError, LaunchError
from aura_hpc.ops.disk import disk_full, disk_of
from aura_hpc.train.checkpoint import background
from aura_hpc.train.process import distributed, progress, worker_log
from aura_hpc.train.process.dist_env import DistEnv

log = logging.getLogger("aura_hpc")


@contextlib.contextmanager
def _process_group_cleanup() -> Iterator[dict[str, bool]]:
    exit_state = {"peer_lost": False}
    try:
        yield exit_state
    finally:
        # A save still being written (a ZeRO rank's shards, which agree over their own group, a DCP save's, waited for
        # on the checkpoint thread, and rank 0's commit)
        # ends before the groups go: an error exit (a run that diverged) shut them first, the agreement failed,
        # and the checkpoint in flight, the last good one, was thrown away unsaid. Not where a peer is gone: its
        # agreement would wait for it as long as the host group's timeout (30 min) for a machine that vanished.
        if not exit_state["peer_lost"]:
            with contextlib.suppress(Exception):
                background.close()
        with contextlib.suppress(Exception):
            distributed.shutdown()


def _stop_when_launcher_dies() -> None:
    """Workers run in their own sessions; if `local` is killed (even with SIGKILL) they are re-parented
    and would keep training unseen. A watchdog sends this worker SIGTERM then: every rank stops at
    the next step boundary with a checkpoint, as on Ctrl-C."""
    launcher = int(os.environ.get("AURA_LAUNCHER_PID", "0") or 0)
    if not launcher or os.getppid() != launcher:
        return  # not started by `local` (Slurm: slurmstepd owns the tasks)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        log.warning("the launcher (PID %d) is gone: stopping at the next step with a checkpoint", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="aura-launcher-watch", daemon=True).start()


def main(argv: list[str] | None = None, why_not_leave_out: Callable[[list[str]], str] | None = None) -> int:
    """`why_not_leave_out`: under Slurm, why the nodes the pre-flight screen names cannot be left out of a requeue
    ("" when they can)."""
    parser = argparse.ArgumentParser(prog="python -m aura_hpc.train", description=__doc__)
    parser.add_argument("config", help="a resolved run config (RUN_DIR/config.yaml)")
    args = parser.parse_args(argv)
    _stop_when_launcher_dies()
    env = DistEnv.from_environ()
    worker_log.mark_stderr(f"[aura_hpc] {worker_log.STARTED}{env.local_rank}")
    from aura_hpc.console import ProgressAwareHandler

    try:
        cfg = load_run_file(args.config)
    except AuraError as exc:
        worker_log.setup(None, env.rank)
        log.error("%s", exc)
        return _for_good(_exiting(exc.exit_code), exc)
    # Deprecation notices that DeepSpeed's calls into torch.distributed raise on every rank, every run:
    # nothing the user can act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # Library progress bars (tqdm) and download chatter do not belong in per-rank log files. Set for
    # whatever imports transformers later (the trainer itself does not: importing it, and DeepSpeed
    # with it under transformers 4, costs every worker seconds; ZeRO imports DeepSpeed quietly itself).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        # Before anything is logged: the rank (and so the log file) is final once the ranks have met.
        env = distributed.join(env, cfg.run_dir, cfg.dist.init_timeout_s)
        if env.is_main:  # under Slurm nothing checked this node's packages before: refused before the model is built
            from aura_hpc.config.tracking import require_installed

            require_installed(cfg)
    except AuraError as exc:
        worker_log.setup(cfg.run_dir / "logs", env.rank)
        log.error("%s", exc)
        return _for_good(_exiting(exc.exit_code), exc)
    worker_log.mark_stderr(f"[rank{env.rank}]: {worker_log.JOINED}{env.local_rank}")  # before any NCCL group
    stream = ProgressAwareHandler(sys.stdout) if env.is_main else None
    worker_log.setup(cfg.run_dir / "logs", env.rank, stream)
    if env.is_main and (stranger_welcome := distributed.unproven(env, distributed.run_secret(cfg.run_dir))):
        log.warning("%s", stranger_welcome)
    worker_log.dump_stacks_on(progress.STACK_SIGNAL)
    page = progress.start(env.rank, cfg.run_dir)
    from aura_hpc.train.loop import endings
    from aura_hpc.train.loop.trainer import Trainer

    trainer = Trainer(cfg, env, why_not_leave_out)
    status = EXIT_TRAIN_FAILED
    with _process_group_cleanup() as exit_state:
        try:
            status = trainer.run()
            page.enter("finished")
            return _for_good(status)
        except AuraError as exc:
            log.error("%s", exc)
            return _for_good(_exiting(exc.exit_code), exc)
        except Exception as exc:
            peer = lost_peer(exc) if isinstance(exc, RuntimeError) else None
            if peer is None:
                if disk_full(exc, cfg.run_dir):
                    # The native stderr log sits on that disk too: the reason goes out as one line.
                    worker_log.to_file_only("the failure, in full:")
                    log.error(
                        "no space left on %s during step %d (fix: free space there, then re-run the same command)",
                        disk_of(cfg.run_dir),
                        trainer.pos.step + 1,
                    )
                    return EXIT_TRAIN_FAILED
                raise
            # A peer's process or machine went away mid-collective: one line saying so (the launcher
            # repeats it); the C++ detail stays in this rank's log.
            exit_state["peer_lost"] = True
            worker_log.to_file_only("the failed collective, in full:")
            log.error("%s", PEER_LOST.format(peer=peer, step=trainer.pos.step + 1))
            return EXIT_TRAIN_FAILED
        finally:
            # On every way out (a failure's last rows and status included), never instead of the run's own line.
            endings.close_outputs(trainer, failed=status != 0)


def _exiting(code: int) -> int:
    """`code`, noted in the rank's log file: a launcher that loses node 0 at the same moment still tells
    a worker's own refusal (status 2, its reason logged just before) from a lost master."""
    worker_log.to_file_only(f"{EXITING_LINE}{code}", exc_info=False)
    return code


def _for_good(code: int, exc: BaseException | None = None) -> int:
    """`code`; one no restart changes (the breaker, the screen, a refused input, unreachable data, a stop) is said
    in the log for the launcher, which then restarts none (launch/final_status.py). Not a LaunchError: a rank
    that did not report in time or could not connect may well join on a restart."""
    if code in NOT_RESTARTED and not isinstance(exc, LaunchError):
        worker_log.to_file_only(f"{FINAL_LINE}{code}", exc_info=False)
    return code


PEER_LOST = "lost the connection to the rank(s) at {peer} during step {step}: their process or machine stopped"
_PEER_ERRORS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused", "socket closed")


def lost_peer(exc: BaseException) -> str | None:
    """The peer's address when `exc` is a collective that failed because a peer went away, else None."""
    text = str(exc)
    if not any(e in text.lower() for e in _PEER_ERRORS):
        return None
    m = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", text)
    return m.group(1) if m else "another node"
