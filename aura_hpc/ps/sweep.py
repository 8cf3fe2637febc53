"""The server's store kept to what the protocol writes.

Anyone who reaches the port can write keys (torch's TCPStore has no access control), up to 8 MiB
each, as many as they like: the store's memory is the server's. Every couple of seconds the server
lists the keys and deletes what no part of the protocol wrote: unknown names at once; requests,
replies, stats of no current worker and a pair's keys once they are older than a pair takes to be
made (a worker that waits announces again; a seat's stats are its own).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Any

log = logging.getLogger("aura_hpc")

EVERY_S = 2.0
# The serve loop's time one sweep may take: a flood of keys (30,000 in 20 ms with one multi_set) took a sweep
# 4.4 s, one round trip a key, and a stop signal waited behind it past a supervisor's kill.
BUDGET_S = 0.1
# join/epoch, join/queue, join/req|reply/<nonce>, stats/<nonce>[/final], and a pair's keys while it is made.
_KNOWN = re.compile(r"^(join/(epoch|queue)|join/(req|reply)/[0-9a-f]{32}|stats/[0-9a-f]{32}(/final)?|pair/[0-9a-f]{32}/.+)$")
_NONCE = re.compile(r"[0-9a-f]{32}")


class StoreSweeper:
    def __init__(self, store: Any, stale_s: float) -> None:
        self.store, self.stale_s = store, stale_s
        self.first_seen: dict[str, float] = {}
        self.last = 0.0
        self.removed = 0

    def sweep(self, live_nonces: set[str]) -> None:
        """Delete what the protocol did not write, and what it wrote for nobody current (every EVERY_S)."""
        now = time.monotonic()
        list_keys = getattr(self.store, "list_keys", None)
        if list_keys is None:
            if not self.last:
                log.warning(
                    "this torch cannot list its store's keys: keys a stranger writes at the port stay until the server stops "
                    "(torch 2.10 or newer sweeps them)"
                )
                self.last = now
            return
        if now - self.last < EVERY_S:
            return
        self.last = now
        try:
            keys = [k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k) for k in list_keys()]
        except (RuntimeError, ValueError):
            return
        began = time.monotonic()  # after the listing: each sweep deletes for its budget, so a flood always shrinks
        present = set(keys)
        self.first_seen = {k: t for k, t in self.first_seen.items() if k in present}
        for key in keys:
            if time.monotonic() - began > BUDGET_S:
                self.last = 0.0  # the rest at the loop's next turn, after it has looked at a stop
                return
            if not _KNOWN.match(key):
                self._delete(key)
                continue
            if key.startswith(("join/epoch", "join/queue")):
                continue
            nonce = _NONCE.search(key)
            if nonce is not None and nonce.group(0) in live_nonces:
                continue
            if now - self.first_seen.setdefault(key, now) > self.stale_s:
                self._delete(key)

    def _delete(self, key: str) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            self.store.delete_key(key)
            self.removed += 1
        self.first_seen.pop(key, None)
