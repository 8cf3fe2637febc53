"""Rank 0's commit of a checkpoint, and the save of a sharded strategy that every rank takes part in.

A sharded checkpoint holds every rank's shard (`sharded/`), the rest as a full one does, and the
full weights (`model/model.safetensors`) only when the run's last step is saved: gathering them
at every save would stall every rank for a collective as large as the model. The others get them
on demand (`train/checkpoint/consolidate.py`, which `generate` uses).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.errors import CheckpointError, CheckpointWriteError, ConfigError
from aura_hpc.train.checkpoint import background
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.parts.state import Parts
from aura_hpc.train.process.dist_env import DistEnv
from aura_hpc.train.strategies.base import ShardedCheckpoints

log = logging.getLogger("aura_hpc")

SHARDS = "sharded"  # a checkpoint's folder of per-rank shards (DCP or DeepSpeed) under sharded strategies


def dcp_errors() -> tuple[type[BaseException], ...]:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - every supported torch has it
        return ()
    return (CheckpointException,)


class Commit:
    """Rank 0's part of a save, from host memory: the checkpoint's files and its commit marker. With
    `shards` (every rank's background shard write) it commits only once they are all written. Called
    on the checkpoint thread (background.py) or in place; returns the error that stopped it, or None."""

    def __init__(self, args: tuple[Any, ...], t0: float, paused: float, shards: Future[Any] | None = None, **kw: Any) -> None:
        self.args, self.kw, self.t0, self.paused, self.shards = args, kw, t0, paused, shards

    def __call__(self) -> str | None:
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
            return None
        except CheckpointError as exc:
            return str(exc)
        except Exception as exc:  # reported like a failed write: the previous checkpoints stay intact
            return str(checkpoint.write_failure(exc, self.args[0], self.args[1]))


# Where and what a sharded save writes: (checkpoints folder, step, the run's parts, this rank's
# environment, the config as YAML, how many checkpoints to keep).
ShardArgs = tuple[Path, int, Parts, DistEnv, str, int]


def save_sharded(
    wrapped: ShardedCheckpoints, where: ShardArgs, meta: dict[str, Any], rngs: list[Any], full_weights: bool, in_background: bool
) -> tuple[Future[str | None] | None, Future[Any] | None]:
    """Saves the current step: every rank writes its shard into rank 0's temporary folder; rank 0 adds
    the rest and the commit marker. With `in_background`, the shards are copied to host memory and
    written behind the loop; rank 0 commits once every rank's are written. Returns rank 0's commit
    (None elsewhere) and this rank's background shard write (None on rank 0, whose commit waits for
    it, and without `in_background`); the caller waits for both before the next save."""
    root, step, p, env, config_yaml, keep_last = where
    t0 = time.perf_counter()
    tmp: Path | None = None
    error = None
    if env.is_main:
        try:
            tmp = checkpoint.begin(root, step)
        except OSError as exc:
            error = str(checkpoint.write_failure(exc, root, step))
    # Rank 0 names its temporary folder by its PID; every rank builds the path itself (no path from a peer).
    pid, error = collectives.broadcast_json([os.getpid() if tmp else 0, error])
    if error:
        raise CheckpointWriteError(str(error))
    if not isinstance(pid, int) or pid <= 0:
        raise CheckpointWriteError("rank 0 sent no usable checkpoint folder (fix: the same aura_hpc on every node)")
    folder = root / f".tmp-{checkpoint.step_dir_name(step)}-{pid}"
    failed: str | None = None
    mine: dict[str, str] = {}
    shards = None
    try:
        if in_background:
            shards = wrapped.save_sharded(folder / SHARDS, p.optimizer, background=True)
        else:
            wrapped.save_sharded(folder / SHARDS, p.optimizer)
            # Each rank hashes the files it wrote; rank 0 hashes the rest while committing.
            own = wrapped.own_shard_files(folder / SHARDS, env.rank)
            mine = {str(f.relative_to(folder)): checkpoint.sha256_of(f) for f in own}
    except (Exception, *dcp_errors()) as exc:  # DCP wraps a full disk in its CheckpointException (a BaseException)
        failed, mine = str(checkpoint.write_failure(exc, root, step)), {}
    # Every rank learns whether any rank's shard failed, so all stop together.
    failures = [str(f) for f in collectives.gather_json(failed) if f]
    if failures:
        if env.is_main:
            shutil.rmtree(folder, ignore_errors=True)  # the partial shards would keep the disk full
        raise CheckpointWriteError(failures[0])
    weights = wrapped.full_weights() if full_weights else {}
    hashes = {str(k): str(v) for part in collectives.gather_json(mine) for k, v in dict(part).items()}
    if not env.is_main:
        # DCP's own thread writes this rank's shards, and its last step agrees with every rank: waited for on ours, so an
        # error exit (background.close, then the groups go) lets it finish. Unwaited, the groups went first and rank
        # 0's commit failed ("Connection closed by peer") and threw the checkpoint away unsaid (tried: torch 2.13, 2.6).
        return None, (background.submit(shards.result) if shards is not None else None)
    snap = checkpoint.ModelSnapshot(weights, *checkpoint.model_configs(p.model))
    state = checkpoint.host_copy(
        {"scheduler": p.scheduler.state_dict(), "scaler": p.scaler.state_dict() if p.scaler.is_enabled() else {}, "rng": rngs}
    )
    args = (root, step, snap, state, meta, p.data.tokenizer_dir, config_yaml, keep_last)
    commit = Commit(args, t0, time.perf_counter() - t0, shards=shards, tmp=folder, known_hashes=hashes)
    return (background.submit(commit) if in_background else background.run_here(commit)), None


def check_one_folder(root: Path, env: DistEnv, strategy: str) -> None:
    """Under a sharded strategy every rank writes its shards into rank 0's checkpoint folder: every node must
    see it. LAN nodes without shared storage wrote theirs into folders of their own, and rank 0 committed
    checkpoints that verified and lacked them (found only at the resume, hours later)."""
    if env.nnodes <= 1:
        return
    token, error = None, None
    if env.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            token = uuid.uuid4().hex  # not a PID: one that repeats (a container) could find an old probe on a node's own disk
            (root / f".shared-probe-{token}").touch()
        except OSError as exc:
            token, error = (
                None,
                f"rank 0 cannot write in {root} ({exc.strerror or exc}) (fix: check output_dir's permissions and space)",
            )
    # Every rank reaches each collective, whatever failed where (a rank that raised first left the others waiting).
    token, error = collectives.broadcast_json([token, error])
    if error:
        raise CheckpointWriteError(str(error))
    ours = isinstance(token, str) and re.fullmatch(r"[0-9a-f]{32}", token) is not None  # rank 0's token: 32 hex digits
    try:
        mine = ours and (root / f".shared-probe-{token}").exists()
    except OSError:
        mine = False
    seen = collectives.flags(mine)
    if env.is_main:
        with contextlib.suppress(OSError):
            (root / f".shared-probe-{token}").unlink(missing_ok=True)
    blind = [r for r, saw in enumerate(seen) if not saw]
    if blind:
        raise ConfigError(
            f"rank(s) {', '.join(map(str, blind[:8]))} do not see rank 0's {root}: under dist.strategy={strategy} every rank "
            "writes its shards of a checkpoint there (fix: an output_dir on storage every node shares, as docs/lan.md sets up "
            "with NFS, or --set dist.strategy=ddp)"
        )
