"""Which disk a path is on, and whether a write failed because that disk is full (torch, DCP and
DeepSpeed wrap the OS's ENOSPC in errors of their own)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path


def disk_of(path: Path) -> str:
    """'MOUNT POINT (DEVICE)' of the filesystem holding `path`."""
    p = path.resolve()
    while not p.exists() or not os.path.ismount(p):
        if p.parent == p:
            break
        p = p.parent
    device = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 1 and fields[1] == str(p):
                device = fields[0]
    return f"{p} ({device})" if device else str(p)


def disk_full(exc: BaseException, path: Path) -> bool:
    """A write that failed because the disk is full: ENOSPC/EDQUOT, or torch's and DCP's wrapped
    errors about it, or any write error with (almost) no free space left where it wrote."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(seen) or "unexpected pos" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    with contextlib.suppress(OSError):
        existing = path
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        return shutil.disk_usage(existing).free < 4 * 2**20
    return False
