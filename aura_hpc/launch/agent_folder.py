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
_OURS = re.compile(rf"{PREFIX}(\d+)_[A-Za-z0-9_]+")


def make() -> str:
    remove_stale()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_")


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
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, OverflowError, ValueError):
            continue  # alive under another user (PermissionError), or unreadable: kept
