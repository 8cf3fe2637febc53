"""Which disk a path is on, and whether a write failed because that disk is full (torch, DCP and
DeepSpeed wrap the OS's ENOSPC in errors of their own)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

# Filesystems other machines share: SQLite and file locks are unsafe there, and every node sees the same files.
NETWORK_FS = {
    *("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "cephfs", "glusterfs", "panfs", "wekafs", "9p", "virtiofs"),
    *("dvs", "gfs2", "ocfs2", "afs", "orangefs"),  # Cray's DVS, the shared-disk cluster filesystems, AFS
}
NETWORK_FS_PREFIXES = ("fuse.", "nfs")


def filesystem_type(path: Path) -> str:
    best, fstype = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return fstype
    target = str(path)
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3:
            mnt = parts[1].replace("\\040", " ")
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[2]
    return fstype


def is_network_fs(path: Path) -> bool:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fs = filesystem_type(existing.resolve())
    return fs in NETWORK_FS or fs.startswith(NETWORK_FS_PREFIXES)


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
