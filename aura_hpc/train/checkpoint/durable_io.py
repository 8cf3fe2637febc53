"""The checkpoint writer's durable file operations: fsync, a write that is synced and hashed in one pass, a file
that hashes what torch.save streams into it, and a copy hashed as it is written."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any


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


def copy_hashed(src: Path, dst: Path) -> str:
    """Copy `src` and return the hash of the bytes written: a hash of the source taken apart (it was cached by size
    and mtime) named other bytes where the file changed meanwhile, and every later checkpoint failed its check."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        hashing = HashingFile(fout)
        shutil.copyfileobj(fin, hashing)
    return hashing.h.hexdigest()
