"""How a run stops before its end step, every rank together: on a signal, or when the data cannot
be read. Each writes one checkpoint (collective: every rank is here), says why on rank 0, closes the
run's outputs (metrics, TensorBoard, trackers) and returns the exit status.

The outputs close after the checkpoint and before the last barrier. After: a tracker slow to finish
(a server that does not answer: up to its 30 s) must not spend a preempted job's grace window, or
the launcher's wait for its workers, before the save. Before the barrier: the launcher stops a rank
still closing once its peers have exited."""

from __future__ import annotations

import logging
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.errors import EXIT_DATA_UNAVAILABLE, EXIT_RESUMABLE, EXITING_LINE
from aura_hpc.train.process import worker_log
from aura_hpc.train.process.stop import StopRequest

log = logging.getLogger("aura_hpc")


def close_outputs(trainer: Any, failed: bool) -> None:
    """Rank 0's metrics, TensorBoard and trackers, once (later calls do nothing); the resource monitor first,
    whose rows go to them. `failed`: the trackers mark the run so. Never raises: an output that cannot close
    costs a warning, not the run's own status, nor the barrier its peers wait in."""
    try:
        trainer.health.stop()
        if trainer.metrics is not None:
            trainer.metrics.close(failed)
    except Exception as exc:
        log.warning("the run's outputs could not be closed (%s)", type(exc).__name__)


def stop_on_signal(trainer: Any, stop: StopRequest) -> int:
    ckpt, pos, env = trainer.ckpt, trainer.pos, trainer.env
    # A stop that lands on the last step is the run's end: its checkpoint is the last, with the full weights in
    # model/ under sharded strategies (the re-run finds nothing to do and would never write them).
    path = ckpt.save(last=pos.step >= trainer.layout.end_step)
    ckpt.wait()
    if env.is_main:
        what = f"checkpoint {path.name} written" if path else "no checkpoint written (weights not finite)"
        log.warning(
            "stop requested (%s) at step %d: %s; exiting with status %d (resumable: re-run the same command, or Slurm requeues)",
            stop.signal_name or "signal on another rank",
            pos.step,
            what,
            EXIT_RESUMABLE,
        )
    close_outputs(trainer, failed=False)  # resumable: the trackers' run goes on when the run does, not a failure
    collectives.barrier()
    if path is not None:  # every rank's log says the stop was checkpointed: a LAN node > 0 keeps none to show it
        worker_log.to_file_only(f"{EXITING_LINE}{EXIT_RESUMABLE}", exc_info=False)
    return EXIT_RESUMABLE


def data_unavailable(trainer: Any, exc: Exception) -> int:
    """Every rank agreed the next steps' data cannot be read (train/loop/data_feed.py): one checkpoint, then stop.
    It may come before the progress bar exists (the data's first read, at setup)."""
    ckpt, pos, env = trainer.ckpt, trainer.pos, trainer.env
    progress = getattr(trainer, "progress", None)
    if progress is not None:
        progress.stop()
    path = ckpt.save() if pos.step > max(pos.saved_step, 0) else None
    ckpt.wait()
    if env.is_main:
        saved = f"checkpoint {path.name} written at step {pos.step}" if path else f"nothing new to save at step {pos.step}"
        log.error("data unavailable: %s; %s; re-run the same command to resume once it can be read", exc, saved)
    close_outputs(trainer, failed=True)
    collectives.barrier()
    return EXIT_DATA_UNAVAILABLE
