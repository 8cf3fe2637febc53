"""The elastic agent's per-launch folder in the temporary folder (its per-rank error files, which our
workers do not write): named after the launcher's PID, so that one left by a launcher killed with SIGKILL
(no `finally` ran) is removed by the next launch on this machine."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "aura_agent_"
_OURS = re.compile(rf"{PREFIX}(\d+)(?:n(\d+))?_[A-Za-z0-9_]+")


def pid_namespace() -> str:
    """This process's PID namespace (its inode), or "" where unknown. A temporary folder shared between
    containers (`-v /tmp:/tmp`, `--ipc=host`) holds other namespaces' launchers, whose PIDs look dead here."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def gone(pid: str, namespace: str | None) -> bool:
    """Whether the launcher that named a folder is gone: never said of another PID namespace's."""
    if namespace and namespace != pid_namespace():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):
        return False  # alive under another user (PermissionError), or unreadable: kept
    return False


def make() -> str:
    remove_stale()
    ns = pid_namespace()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}{'n' + ns if ns else ''}_")


def remove_stale() -> None:
    """Folders of ours (our name, our user) whose launcher is gone. A PID that is alive keeps its folder, whoever
    holds that PID now: never a live launcher's."""
    try:
        entries = list(Path(tempfile.gettempdir()).iterdir())
    except OSError:
        return
    for path in entries:
        m = _OURS.fullmatch(path.name)
        if m is None or path.is_symlink() or not path.is_dir():
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if gone(m.group(1), m.group(2)):
            shutil.rmtree(path, ignore_errors=True)
