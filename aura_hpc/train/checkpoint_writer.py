"""Rank 0's checkpoint writer thread, and the save of a sharded strategy that every rank takes part in.

A sharded checkpoint holds every rank's shard (`sharded/`), the rest as a full one does, and the
full weights (`model/model.safetensors`) only when the run's last step is saved: gathering them
at every save would stall every rank for a collective as large as the model. The others get them
on demand (`train/consolidate.py`, which `generate` uses).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.errors import CheckpointError, CheckpointWriteError
from aura_hpc.train import checkpoint

log = logging.getLogger("aura_hpc")

SHARDS = "sharded"  # a checkpoint's folder of per-rank shards (DCP or DeepSpeed) under sharded strategies


def dcp_errors() -> tuple[type[BaseException], ...]:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - every supported torch has it
        return ()
    return (CheckpointException,)


class Writer(threading.Thread):
    """Writes one checkpoint from host memory (rank 0), in the background or in place. With `shards`
    (every rank's background shard write) it commits only once they are all written."""

    def __init__(self, args: tuple[Any, ...], t0: float, paused: float, shards: Future[Any] | None = None, **kw: Any) -> None:
        super().__init__(name="aura-checkpoint-writer")
        self.args, self.kw, self.t0, self.paused, self.shards = args, kw, t0, paused, shards
        self.error: str | None = None

    def run(self) -> None:
        try:
            if self.shards is not None:
                try:
                    written = self.shards.result()
                    if isinstance(written, dict):  # the hashes of every rank's files, taken as they were written
                        self.kw["known_hashes"] = {**self.kw.get("known_hashes", {}), **written}
                except (Exception, *dcp_errors()) as exc:  # a full disk on any rank arrives here as DCP's exception
                    shutil.rmtree(self.kw["tmp"], ignore_errors=True)  # the partial shards would keep the disk full
                    raise checkpoint.write_failure(exc, self.args[0], self.args[1]) from None
            path = checkpoint.save(*self.args, **self.kw)
            log.info(
                "checkpoint %s written in %.2fs (training paused %.2fs to copy the state)",
                path,
                time.perf_counter() - self.t0,
                self.paused,
            )
        except CheckpointError as exc:
            self.error = str(exc)
        except Exception as exc:  # reported like a failed write: the previous checkpoints stay intact
            self.error = str(checkpoint.write_failure(exc, self.args[0], self.args[1]))


def save_sharded(c: Any, rngs: list[Any], full_weights: bool) -> None:
    """Checkpointer `c` saves the current step: every rank writes its shard into rank 0's temporary
    folder; rank 0 adds the rest and the commit marker. With train.async_checkpoint (and a strategy
    that can) the shards are copied to host memory and written in the background; rank 0 commits
    once every rank's are written."""
    pos, p, wrapped = c.pos, c.parts, c.wrapped
    background = c.cfg.train.async_checkpoint and getattr(wrapped, "background_shards", False)
    t0 = time.perf_counter()
    tmp: Path | None = None
    error = None
    if c.env.is_main:
        try:
            tmp = checkpoint.begin(c.root, pos.step)
        except OSError as exc:
            error = str(checkpoint.write_failure(exc, c.root, pos.step))
    # Rank 0 names its temporary folder by its PID; every rank builds the path itself (no path from a peer).
    pid, error = collectives.broadcast_json([os.getpid() if tmp else 0, error])
    if error:
        raise CheckpointWriteError(str(error))
    if not isinstance(pid, int) or pid <= 0:
        raise CheckpointWriteError("rank 0 sent no usable checkpoint folder (fix: the same aura_hpc on every node)")
    folder = c.root / f".tmp-{checkpoint.step_dir_name(pos.step)}-{pid}"
    failed: str | None = None
    mine: dict[str, str] = {}
    shards = None
    try:
        if background:
            shards = wrapped.save_sharded(folder / SHARDS, p.optimizer, background=True)  # type: ignore[attr-defined]
        else:
            wrapped.save_sharded(folder / SHARDS, p.optimizer)  # type: ignore[attr-defined]
            # Each rank hashes the files it wrote; rank 0 hashes the rest while committing.
            own = wrapped.own_shard_files(folder / SHARDS, c.env.rank)  # type: ignore[attr-defined]
            mine = {str(f.relative_to(folder)): checkpoint.sha256_of(f) for f in own}
    except (Exception, *dcp_errors()) as exc:  # DCP wraps a full disk in its CheckpointException (a BaseException)
        failed, mine = str(checkpoint.write_failure(exc, c.root, pos.step)), {}
    # Every rank learns whether any rank's shard failed, so all stop together.
    failures = [str(f) for f in collectives.gather_json(failed) if f]
    if failures:
        if c.env.is_main:
            shutil.rmtree(folder, ignore_errors=True)  # the partial shards would keep the disk full
        raise CheckpointWriteError(failures[0])
    weights = wrapped.full_weights() if full_weights else {}  # type: ignore[attr-defined]
    hashes = {str(k): str(v) for part in collectives.gather_json(mine) for k, v in dict(part).items()}
    if c.env.is_main:
        snap = checkpoint.ModelSnapshot(weights, *checkpoint.model_configs(p.model))
        state = checkpoint.host_copy(
            {"scheduler": p.scheduler.state_dict(), "scaler": p.scaler.state_dict() if p.scaler.is_enabled() else {}, "rng": rngs}
        )
        args = (c.root, pos.step, snap, state, c._meta(), p.data.tokenizer_dir, c.cfg.to_yaml(), c.cfg.train.keep_last)
        c.writer = Writer(args, t0, time.perf_counter() - t0, shards=shards, tmp=folder, known_hashes=hashes)
        if background:
            c.writer.start()
        else:
            c.writer.run()
    else:
        c.shards = shards
    if not background:
        c.wait()
