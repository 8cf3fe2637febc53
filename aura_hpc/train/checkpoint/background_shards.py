"""A sharded save that a library writes with `torch.save` (DeepSpeed's), moved out of the loop.

The library's own save runs as usual, but its checkpoint engine is swapped for one that only
copies each file's state to host memory (pinned buffers kept from save to save on a GPU: one
synchronisation per save). The checkpoint thread (background.py) then writes those files, hashing them as they go, and the
ranks agree over a gloo group of their own (never interleaved with training's collectives) that
every rank's files are on disk. Rank 0 commits the checkpoint only after that; a rank whose write
failed fails the save on every rank, at the next save or `wait()`, with the previous checkpoint kept.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.train.checkpoint import background
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.checkpoint.host_mirror import HostMirror
from aura_hpc.train.instruments import faults


class CapturingEngine:
    """Stands in for DeepSpeed's checkpoint engine during one save: `save` keeps a host copy of what
    would have been written; everything else (directories, commit, loading) is the real engine's."""

    def __init__(self, inner: Any, mirror: HostMirror | None, run_dir: Path) -> None:
        self.inner, self.mirror, self.run_dir = inner, mirror, run_dir
        self.files: list[tuple[Path, Any, bool]] = []
        self.failure: Exception | None = None
        # The format DeepSpeed's own engine was configured to write (its `checkpoint.serialization`).
        self.zipfile = bool(getattr(inner, "zipfile_serialization", True))

    def save(self, state_dict: Any, path: str) -> None:
        # A copy that fails (host memory to pin) is kept, not raised, as FailureKept does: raised here, this rank
        # left DeepSpeed's save for the shards' agreement while the others waited in its closing barrier (a hang).
        # The agreement (_write_and_agree) then tells every rank.
        if self.failure is not None:
            return
        name = Path(path).name
        try:
            faults.checkpoint_stage("capture", self.run_dir)
            state = self.mirror.copy(state_dict, name) if self.mirror is not None else checkpoint.host_copy(state_dict)
        except Exception as exc:
            self.failure = exc
            return
        self.files.append((Path(path), state, self.zipfile))

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed then hands over its tensors without cloning them on the device first; the
        # host copy above is compact already (a view's whole storage is never written).
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FailureKept:
    """DeepSpeed's checkpoint engine for a save written in the loop: a file this rank fails to write
    (a full disk) is kept, not raised, so the rank still reaches the barrier that ends DeepSpeed's
    save with the others (raised there, it skipped it and every rank hung); raised once the save returns."""

    def __init__(self, inner: Any, run_dir: Path) -> None:
        self.inner, self.run_dir = inner, run_dir
        self.failure: Exception | None = None

    def save(self, state_dict: Any, path: str) -> None:
        if self.failure is not None:
            return
        try:
            self.inner.save(state_dict, path)
            faults.checkpoint_stage("shards", self.run_dir)
        except Exception as exc:
            self.failure = exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ShardWriter:
    """One rank's background writer of captured shard files (one save at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.mirror = HostMirror() if device.type == "cuda" else None
        self._group: Any = None

    def capture(self, inner: Any, run_dir: Path) -> CapturingEngine:
        if self._group is None:  # collective: every rank is here at the same save
            self._group = collectives.new_group("checkpoint-io", host_only=True)
        return CapturingEngine(inner, self.mirror, run_dir)

    def write(self, captured: CapturingEngine, checkpoint_dir: Path) -> Future[dict[str, str]]:
        """Start writing what `captured` holds; the future gives every rank's file hashes (relative to
        `checkpoint_dir`) once all ranks' files are written, or raises the first rank's failure."""
        if self.mirror is not None:
            self.mirror.ready()
        files, group, failed = captured.files, self._group, captured.failure
        return background.submit(lambda: _write_and_agree(files, checkpoint_dir, group, failed))


def _write_and_agree(
    files: list[tuple[Path, Any, bool]], checkpoint_dir: Path, group: Any, failed: Exception | None = None
) -> dict[str, str]:
    hashes: dict[str, str] = {}
    failure: list[Any] | None = None
    try:
        if failed is not None:  # this rank's copy to host memory failed: nothing of it to write
            raise failed
        for path, state, zipfile in files:
            with open(path, "wb") as f:
                hashing = checkpoint.HashingFile(f)
                torch.save(state, hashing, _use_new_zipfile_serialization=zipfile)
                f.flush()
                os.fsync(f.fileno())
            hashes[str(path.relative_to(checkpoint_dir))] = hashing.h.hexdigest()
        # The run directory holds the checkpoints folder, which holds this temporary checkpoint.
        faults.checkpoint_stage("shards", checkpoint_dir.parent.parent)
    except Exception as exc:  # a full disk on one rank: every rank learns it below, none hangs
        failure = [getattr(exc, "errno", None) or 0, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__]
    everyone = collectives.gather_json([hashes, failure], group)
    for _, failed in everyone:
        if failed is not None:
            code, text = int(failed[0]), str(failed[1])
            raise OSError(code, text) if code else RuntimeError(text)
    return {str(k): str(v) for part, _ in everyone for k, v in dict(part).items()}
