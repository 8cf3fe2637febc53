"""Where the nodes of a LAN run tell each other about a hang: keys in node 0's rendezvous store.

Each node's watchdog sees only its own ranks. When a rank of node 1 stops, node 0's ranks all wait
in a collective and node 0's watchdog can only say "the rank holding them up is on another node";
when node 1 then kills its workers, node 0's see a broken connection, not a hang. So a watchdog that
declares a hang publishes its verdict here before it kills anything, and the others read it: every
node names the same culprit, and every launcher knows its run hung (and restarts it) rather than
reading the peers' broken collectives as a crash.

The store is reachable by anyone who reaches the rendezvous port, so a verdict is signed with the
run's secret (an HMAC, as the ranks' proofs in comm/stores.py), bounded in size, and read as
hostile input: fields typed, text stripped of control characters before it reaches a terminal. It
names the store it was published in (the round mark node 0's launcher sets in each store it makes):
a verdict copied from an earlier attempt's store is refused whatever the nodes' clocks say.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from aura_hpc.comm import stores

PREFIX = "aura-hang/node"
MAX_VALUE = 16384
CONNECT_S = 10.0


@dataclass
class Verdict:
    node: int
    host: str
    line: str
    culprits: list[int]
    declared_at: float
    step: int
    round: str = ""  # the store's round mark where it was published (stores.ROUND_KEY)

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "host": self.host,
            "line": self.line,
            "culprits": self.culprits,
            "declared_at": self.declared_at,
            "step": self.step,
            "round": self.round,
        }


@dataclass
class HangBoard:
    addr: str
    port: int
    node_rank: int
    nnodes: int
    secret: str
    round_seen: str | None = None
    _stale_round: str | None = None  # the last attempt's: never this attempt's, even while its store lingers
    _store: Any = field(default=None, repr=False)
    _before: dict[str, bytes] = field(default_factory=dict, repr=False)  # the peers' keys when this attempt's workers started

    def _connect(self) -> Any:
        # A connection of our own (never the agent's store object: holding it would keep node 0's
        # rendezvous port bound after the agent is done, and a relaunch could not bind it again).
        if self._store is None:
            self._store = stores.client(self.addr, self.port, timedelta(seconds=CONNECT_S))
        return self._store

    def close(self) -> None:
        self._store = None

    def publish(self, verdict: Verdict) -> bool:
        self.note_round()
        verdict.round = self.round_seen or ""
        body = json.dumps(verdict.as_dict(), sort_keys=True)
        signed = json.dumps({"v": body, "mac": _mac(self.secret, body)})
        try:
            self._connect().set(f"{PREFIX}{self.node_rank}", signed)
        except Exception:  # node 0 gone: nobody is left to tell
            self.close()
            return False
        return True

    def _keys(self) -> list[str]:
        return [f"{PREFIX}{n}" for n in range(self.nnodes) if n != self.node_rank]

    def mark_seen(self) -> None:
        """The workers started again in place (the same store): a peer's verdict counts from here on only once its
        key changes. The peers' clocks are never compared with this one's: a laptop minutes behind hid its
        verdict, and this node read the broken collectives its kill left as a crash instead of a hang."""
        self._before = {}
        with contextlib.suppress(Exception):
            store = self._connect()
            self._before = {key: store.get(key) for key in self._keys() if store.check([key])}

    def others(self) -> list[Verdict]:
        """The other nodes' verdicts of this attempt (this store's round, published since mark_seen), valid ones only."""
        out = []
        self.note_round()
        try:
            store = self._connect()
            for key in self._keys():
                if store.check([key]) and (raw := store.get(key)) != self._before.get(key):
                    v = _parse(raw, self.secret, int(key.removeprefix(PREFIX)))
                    if v is not None and v.round == (self.round_seen or ""):
                        out.append(v)
        except Exception:
            self.close()
        return sorted(out, key=lambda v: (not v.culprits, v.declared_at))

    def wait_for_others(self, wait_s: float) -> list[Verdict]:
        """The other nodes' verdicts, waiting up to `wait_s` for one that names a culprit."""
        return self._wait(wait_s, lambda found: any(v.culprits for v in found))

    def wait_for_all(self, wait_s: float) -> list[Verdict]:
        """The other nodes' verdicts, waiting up to `wait_s` for every other node's."""
        return self._wait(wait_s, lambda found: len(found) >= self.nnodes - 1)

    def _wait(self, wait_s: float, enough: Any) -> list[Verdict]:
        deadline = time.monotonic() + wait_s
        while True:
            found = self.others()
            if enough(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def new_attempt(self) -> None:
        """The launcher starts its workers again: node 0 makes its rendezvous store anew, with a new round mark."""
        if self.round_seen is not None:
            self._stale_round = self.round_seen
        self.round_seen, self._before = None, {}
        self.close()

    def note_round(self) -> None:
        """The mark node 0's launcher left in this attempt's rendezvous store (comm/stores.py: ROUND_KEY)."""
        if self.round_seen is None:
            with contextlib.suppress(Exception):
                store = self._connect()
                if store.check([stores.ROUND_KEY]):
                    mark = store.get(stores.ROUND_KEY)[:128].decode("ascii", "replace")
                    self.round_seen = mark if mark != self._stale_round else None

    def wait_for_a_new_store(self, wait_s: float) -> None:
        """A node other than 0 relaunching after a hang: until node 0's launcher has made its rendezvous
        store anew, so that this node does not join the closed round of the old one."""
        deadline = time.monotonic() + wait_s
        self.close()
        while time.monotonic() < deadline:
            try:
                store = stores.client(self.addr, self.port, timedelta(seconds=2))
                mark = store.get(stores.ROUND_KEY)[:128].decode("ascii", "replace") if store.check([stores.ROUND_KEY]) else None
                if mark is not None and mark != self.round_seen:
                    break
            except Exception:  # not up again yet
                pass
            time.sleep(0.5)
        self.new_attempt()


def _mac(secret: str, body: str) -> str:
    return hmac.new(stores.key_of(secret), b"hang|" + body.encode(), hashlib.sha256).hexdigest()


def _clean(text: Any, limit: int) -> str:
    """A peer's text as it may reach a terminal: printable characters only, bounded."""
    if not isinstance(text, str):
        return ""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _parse(raw: bytes, secret: str, node: int) -> Verdict | None:
    if len(raw) > MAX_VALUE:
        return None
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        outer = json.loads(raw.decode("utf-8"))
        body = outer["v"]
        if not isinstance(body, str) or not hmac.compare_digest(str(outer["mac"]), _mac(secret, body)):
            return None
        d = json.loads(body)
        culprits = d["culprits"]
        if not (isinstance(culprits, list) and all(isinstance(c, int) and 0 <= c < 1 << 20 for c in culprits[:64])):
            return None
        if d["node"] != node or not isinstance(d["declared_at"], (int, float)) or not isinstance(d["step"], int):
            return None
        if not isinstance(d["round"], str):
            return None
        host, line = _clean(d["host"], 255), _clean(d["line"], 4000)
        return Verdict(node, host, line, culprits[:64], float(d["declared_at"]), d["step"], d["round"][:128])
    return None
