"""The elastic agent's per-launch folder in the temporary folder (its per-rank error files, which our
workers do not write): named after the launcher's PID, so that one left by a launcher killed with SIGKILL
(no `finally` ran) is removed by the next launch on this machine."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from aura_hpc.processes import alive, pid_namespace

PREFIX = "aura_agent_"
_OURS = re.compile(rf"{PREFIX}(\d+)(?:n(\d+))?_[A-Za-z0-9_]+")


def gone(pid: str, namespace: str | None) -> bool:
    """Whether the launcher that named a folder is gone: never said of another PID namespace's (a temporary folder
    shared between containers, `-v /tmp:/tmp`, holds other namespaces' launchers, whose PIDs look dead here)."""
    if namespace and namespace != pid_namespace():
        return False
    return pid.isdigit() and not alive(int(pid))


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
