"""DiLoCo's per-rank files: each rank's own weights and AdamW moments, written by that rank into its
own run directory (LAN machines need no shared storage), checked on resume against the checksums
rank 0 recorded in the checkpoint's meta.json."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.errors import CheckpointWriteError
from aura_hpc.train.checkpoint.files import HashingFile, fsync, host_copy, sha256_of, step_dir_name, write_failure
from aura_hpc.train.strategies.base import OuterLoop, PerRankState, Wrapped, capability

log = logging.getLogger("aura_hpc")

REPLICAS = "replicas"  # DiLoCo: each rank's own state, beside the step folders of its run directory


def write_replica(root: Path, step: int, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's replica state, atomically: {file, size, sha256} for rank 0's meta.json."""
    folder = root / REPLICAS
    folder.mkdir(parents=True, exist_ok=True)
    name = replica_name(step, rank, time.time_ns())
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            hashing = HashingFile(f)
            torch.save(state, hashing)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(folder / name)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write's part: on a full disk it kept the disk full
    fsync(folder)  # the rename itself: rank 0's meta.json records this file
    return {"file": name, "size": (folder / name).stat().st_size, "sha256": hashing.h.hexdigest()}


def replica_name(step: int, rank: int, written_ns: int) -> str:
    """A name of its own for each save: a rollback's save of the same step replaced the committed checkpoint's file
    before its own commit, and a commit that then failed left that checkpoint's replicas unreadable."""
    return f"{step_dir_name(step)}.rank{rank}.{written_ns:020d}.pt"


_NAME = re.compile(r"^step_\d{8,}\.rank\d+(\.\d{20})?\.pt$")  # without the time: an older release's


def read_replica(root: Path, info: dict[str, Any]) -> dict[str, Any] | None:
    """A replica file that matches what rank 0 recorded, loaded; None when absent or different. The
    record may have come from rank 0 over the network: only a name of the form this module writes is opened."""
    name = str(info.get("file", ""))
    path = root / REPLICAS / name
    if not _NAME.match(name) or not path.is_file() or path.stat().st_size != info.get("size") or sha256_of(path) != info.get("sha256"):
        return None
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception:
        return None


def prune_replicas(root: Path, rank: int, keep: int, step: int) -> None:
    """This rank's files of all but the newest `keep` steps up to `step`. Steps, not files: each rollback's save of a
    step adds a file, and counting files deleted the replicas of checkpoints still kept. A newer step's files (a
    future a rollback left) count for nothing and stay, as files.prune does with newer checkpoints."""
    files = [*(root / REPLICAS).glob(f"step_*.rank{rank}.pt"), *(root / REPLICAS).glob(f"step_*.rank{rank}.*.pt")]
    steps = {f: int(f.name.split(".")[0].removeprefix("step_")) for f in files if _NAME.match(f.name)}
    kept = sorted({s for s in steps.values() if s <= step})[-keep:] if keep else []
    for f, s in steps.items():
        if s <= step and s not in kept:
            f.unlink(missing_ok=True)


def save_all(wrapped: Wrapped, optimizer: Any, root: Path, step: int, rank: int, keep_last: int) -> dict[str, Any] | None:
    """The ranks' own state, each written once (by the rank the strategy names: a DiLoCo replica's
    leader for all its ranks); None when the strategy has none. The files' checksums, gathered for
    rank 0's meta.json. Collective."""
    own = capability(wrapped, PerRankState)
    if own is None or own.replica_writer(rank) is None:
        return None
    info: dict[str, Any] | str | None = None
    if own.replica_writer(rank) == rank:
        try:
            info = write_replica(root, step, rank, host_copy(own.replica_state(optimizer)))
        except Exception as exc:  # said on every rank at the gather below: one raising alone left the others in it
            info = str(write_failure(exc, root, step))
        prune_replicas(root, rank, keep_last + 2, step)
    infos = collectives.gather_json(info)
    failed = [i for i in infos if isinstance(i, str)]
    if failed:
        raise CheckpointWriteError(failed[0])
    return {str(r): i for r, i in enumerate(infos) if isinstance(i, dict)}


def load_all(
    wrapped: Wrapped, optimizer: Any, root: Path, chosen: str, meta: dict[str, Any], state: dict[str, Any], rank: int, world: int
) -> None:
    """DiLoCo's anchor and momentum (rank 0's, the same everywhere), then this rank's own state
    (DiLoCo: weights and AdamW moments; PowerSGD: error feedback); if any rank lacks its file
    (another world size, a node's disk lost), every rank starts it afresh (said so). Collective."""
    outer = capability(wrapped, OuterLoop)
    if outer is not None and "outer" in state:
        outer.load_outer_state(state["outer"])
    elif outer is not None:
        outer.start_from_model()
        if rank == 0:
            log.info("checkpoint %s holds no outer state (saved under another strategy): the replicas meet from its weights", chosen)
    files = meta.get("replica_files")
    own_state = capability(wrapped, PerRankState)
    writer = own_state.replica_writer(rank) if own_state is not None else None
    if own_state is None or writer is None or not files:
        return
    # Files another strategy wrote (PowerSGD's error feedback for DiLoCo's replica, or the reverse) are not this one's
    # state: loading them failed on a missing key. (A checkpoint without the name: an older release's, as before.)
    same_kind = meta.get("strategy") in (None, wrapped.name)
    mine = files.get(str(writer)) if int(meta.get("world_size", world)) == world and same_kind else None
    own = read_replica(root, mine) if isinstance(mine, dict) else None
    have = collectives.flags(own is not None)
    if all(have) and own is not None:
        own_state.load_replica_state(own, optimizer)
        return
    if rank == 0:
        missing = [r for r, ok in enumerate(have) if not ok]
        log.warning(
            "checkpoint %s: the per-rank state of rank(s) %s is missing or does not match (another world size or strategy?): every "
            "rank starts it afresh (DiLoCo: from the last meeting's weights; PowerSGD: no error feedback) (not bit-identical)",
            chosen,
            missing,
        )
    own_state.restart_replica()
