"""The checkpoint writer's durable file operations: fsync, a write that is synced and hashed in one pass, a file
that hashes what torch.save streams into it, and the hash of an unchanged file taken once per process."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from aura_hpc.data.prepare import sha256_file as _sha256


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> str:
    """Write, fsync, and return the sha256 of what was written (no second read)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


class HashingFile:
    """A write-only file that hashes what passes through it (torch.save streams into it)."""

    def __init__(self, f: Any) -> None:
        self.f, self.h = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.h.update(data)
        return int(self.f.write(data))

    def flush(self) -> None:
        self.f.flush()


# Unchanged files (the tokenizer) are hashed once per process, not at every save.
_HASHES: dict[tuple[str, int, int], str] = {}


def sha256_cached(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = _sha256(path)
    return _HASHES[key]
