"""A call that may never return (into a mount that stopped answering), waited for a limited time."""

from __future__ import annotations

import threading
from typing import Any


def in_time(work: Any, *args: Any, limit: float) -> tuple[bool, Any]:
    """`work(*args)` on a thread of its own, waited for `limit` seconds: (True, its result or the exception it raised),
    or (False, None) while it still runs (a call into a mount that stopped answering never returns)."""
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(_attempt(work, *args)), name="aura-in-time", daemon=True)
    thread.start()
    thread.join(limit)
    return (True, done[0]) if done else (False, None)


def _attempt(work: Any, *args: Any) -> Any:
    """`work(*args)`, or the exception it raised (the evidence failed: a full disk; the run is still hung)."""
    try:
        return work(*args)
    except Exception as exc:
        return exc
