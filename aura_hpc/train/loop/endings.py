"""How a run stops before its end step, every rank together: on a signal, or when the data cannot
be read. Each writes one checkpoint (collective: every rank is here), says why on rank 0 and
returns the exit status."""

from __future__ import annotations

import logging
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.errors import EXIT_DATA_UNAVAILABLE, EXIT_RESUMABLE
from aura_hpc.train.parts.state import Position
from aura_hpc.train.process.dist_env import DistEnv
from aura_hpc.train.process.stop import StopRequest

log = logging.getLogger("aura_hpc")


def stop_on_signal(stop: StopRequest, ckpt: Any, pos: Position, env: DistEnv) -> int:
    path = ckpt.save()
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
    collectives.barrier()
    return EXIT_RESUMABLE


def data_unavailable(exc: Exception, ckpt: Any, pos: Position, env: DistEnv, progress: Any) -> int:
    """Every rank agreed the next steps' data cannot be read (train/loop/data_feed.py): one checkpoint, then stop."""
    if progress is not None:
        progress.stop()
    path = ckpt.save() if pos.step > max(pos.saved_step, 0) else None
    ckpt.wait()
    if env.is_main:
        saved = f"checkpoint {path.name} written at step {pos.step}" if path else f"nothing new to save at step {pos.step}"
        log.error("data unavailable: %s; %s; re-run the same command to resume once it can be read", exc, saved)
    collectives.barrier()
    return EXIT_DATA_UNAVAILABLE
