"""A node's stream builds (CACHE/stream/KEY/): one for each stream key, kept while a run uses it.

An edited text, another tokenizer or another shard size each makes a new build, and none was ever
removed: data.cache_gb bounded the pieces of the build in use, and the node's disk filled with old
ones. Now the builds no run holds go, the one used longest ago first, while all of them together
are past data.cache_gb. A run holds its build with a shared lock on its in-use file (the ranks of a
node share it); a build is removed only under that file's exclusive lock, moved aside first, so a
run that starts on it meanwhile makes it anew.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from pathlib import Path

IN_USE = "in-use.lock"
ASIDE = ".removing-"  # a build being removed (what a removal cut short left is removed by the next)
OURS = re.compile(r"[0-9a-f]{16}")  # a build's name (the key's first 16 hex digits): nothing else here is removed


def hold(build: Path) -> int:
    """A shared lock on `build`'s in-use file, made if needed; held until release(). Its time is the build's last use."""
    while True:
        build.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(build / IN_USE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # moved aside between the two: made anew
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.fstat(fd).st_ino == os.stat(build / IN_USE).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.utime(fd)
            return fd
        os.close(fd)  # it was removed while this waited for the lock


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def touch(fd: int) -> None:
    """The build's last use is now (the oldest unused go first)."""
    with contextlib.suppress(OSError):
        os.utime(fd)


def forget_unused(streams: Path, keep: Path, max_bytes: int) -> list[str]:
    """The builds in `streams` no run holds, used longest ago first, removed while all the builds (`keep`'s
    included) are past `max_bytes`; the names removed."""
    for aside in streams.glob(f"{ASIDE}*"):
        if OURS.fullmatch(aside.name[len(ASIDE) :].split("-")[0]):
            shutil.rmtree(aside, ignore_errors=True)
    builds: list[tuple[float, Path]] = []
    for build in streams.iterdir():
        if build != keep and OURS.fullmatch(build.name) and build.is_dir():
            with contextlib.suppress(OSError):
                builds.append(((build / IN_USE).stat().st_mtime if (build / IN_USE).exists() else build.stat().st_mtime, build))
    sizes = {build: _bytes(build) for _, build in builds}
    total = _bytes(keep) + sum(sizes.values())
    removed = []
    for _, build in sorted(builds, key=lambda pair: pair[0]):
        if total <= max_bytes:
            break
        if _remove_unless_held(streams, build):
            total -= sizes[build]
            removed.append(build.name)
    return removed


def _remove_unless_held(streams: Path, build: Path) -> bool:
    try:
        fd = os.open(build / IN_USE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # another run removed it first
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a run holds it
        try:  # still the build's use file: another remover may have moved that build aside, and a run made it anew
            if os.fstat(fd).st_ino != os.stat(build / IN_USE).st_ino:
                return False
        except FileNotFoundError:
            return False
        aside = streams / f"{ASIDE}{build.name}-{os.getpid()}"
        try:
            build.rename(aside)
        except OSError:
            return False
    finally:
        os.close(fd)  # a run waiting for it now finds the file gone, and makes the build anew
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _bytes(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if f.is_file():
                total += f.stat().st_size
    return total
