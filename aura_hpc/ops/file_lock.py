"""An exclusive POSIX lock on a file on shared storage, waited for a few seconds at most.

POSIX locks (lockf) reach the server on NFS (NLM, NFSv4), so writers on different nodes are ordered. Never blocking
the caller: an NFS lock daemon that does not answer holds even a LOCK_NB request (its RPC retries), so the lock is
asked on a thread and the caller goes on unlocked past the limit, as where the server has no locking at all (ENOLCK,
Lustre without flock) and on Windows.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any


def lock_briefly(f: Any, seconds: float) -> None:
    """Lock `f` (a file object or descriptor, open for writing) until it is closed; `seconds` at most."""
    locking = threading.Thread(target=_lock, args=(f, seconds), daemon=True)
    locking.start()
    locking.join(seconds)


def _lock(f: Any, seconds: float) -> None:
    try:
        import fcntl
    except ImportError:  # Windows
        return
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                return  # no locking there (ENOLCK): unlocked
            time.sleep(0.1)
