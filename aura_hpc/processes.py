"""Whether a process named by its PID is still there, and where a PID names one process at all: asked by the run
lock, the launcher's temporary folders, the hang watchdog, a prepare's build folder and a consolidation's parts
(each had its own answer; some took a zombie, which a PID 1 that does not reap keeps for ever, for a live process)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie. Stopped counts as alive (that is a hang); so does one this process
    may not signal (another user's), or a number no process could have: what cannot be told dead is kept."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1] != ["Z"]
    except (OSError, IndexError):
        return True


def pid_namespace() -> str:
    """This process's PID namespace (its inode), or "" where unknown: a PID of another namespace (a container's, seen
    through a folder shared with `-v /tmp:/tmp`) names another process here, or none."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def pid_space() -> str:
    """Where a PID names one process: the host, its boot and its PID namespace. A host name alone is not that: two
    laptops called `ubuntu` share a folder, and containers with the host's network see the host's name."""
    space = socket.gethostname().replace(".", "_")
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        space += f"-{boot}-{os.stat('/proc/self/ns/pid').st_ino}"
    return space
