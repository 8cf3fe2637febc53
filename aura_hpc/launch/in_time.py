"""A call that may never return (into a mount that stopped answering), waited for a limited time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def in_time(work: Any, *args: Any, limit: float, until: Callable[[], bool] | None = None) -> tuple[bool, Any]:
    """`work(*args)` on a thread of its own, waited for `limit` seconds: (True, its result or the exception it raised),
    or (False, None) while it still runs (a call into a mount that stopped answering never returns). `until`: waited
    no longer once it says so (read every quarter second; a signal handler's flag)."""
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(_attempt(work, *args)), name="aura-in-time", daemon=True)
    thread.start()
    if until is None:
        thread.join(limit)
    else:
        deadline = time.monotonic() + limit
        while thread.is_alive() and not until() and (left := deadline - time.monotonic()) > 0:
            thread.join(min(0.25, left))
    return (True, done[0]) if done else (False, None)


def _attempt(work: Any, *args: Any) -> Any:
    """`work(*args)`, or the exception it raised (the evidence failed: a full disk; the run is still hung)."""
    try:
        return work(*args)
    except Exception as exc:
        return exc
