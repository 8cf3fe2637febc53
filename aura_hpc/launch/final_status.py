"""`--max-restarts` restarts crashed workers, never workers that ended for good.

torch's elastic agent restarts its workers after any failure while restarts remain: a loss that stayed
non-finite, an input a worker refused, the GPU circuit breaker, the pre-flight screen, data that cannot be
read, a stop asked of the workers. Each was restarted up to N times: the breaker's GPU trained on, a diverged
run diverged again from its checkpoint. The agent's one seam between two attempts is the rendezvous, and
its handler is ours (comm/stores.py): before every rendezvous after a launch's first, the handler asks
whether this node's workers logged such a status in this launch (errors.NOT_RESTARTED). If so it tells the
other nodes through node 0's store, signed with the run secret, and ends the launch; the agent then closes
the rendezvous, so the other nodes, waiting in it to restart, stop as well and say which node ended the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import time
import weakref
from typing import Any

from aura_hpc.comm import stores
from aura_hpc.errors import NOT_RESTARTED
from aura_hpc.launch import worker_logs

KEY = "aura-final-status"
READ_WAIT_S = 15.0  # node 0 keeps its store up this long for the others to read why the run ended


class FinalStatus(Exception):
    """The launch ended with a status no restart changes; `node` None: this node's workers, else the node that said so."""

    def __init__(self, code: int, node: int | None) -> None:
        super().__init__(f"status {code}" + (f" on node {node}" if node is not None else ""))
        self.code, self.node = code, node


class Guard:
    """While one launch runs: the handlers it makes stop a restart that would end the same way."""

    def __init__(self, plan: Any, since: worker_logs.Offsets) -> None:
        self.plan, self.since = plan, since
        secret = os.environ.get(stores.SECRET_ENV, "")
        self.key = stores.key_of(secret) if secret else b""
        self.store: Any = None
        self.round = ""  # node 0's stamp on the store, read once the nodes have met: a later write of it counts for nothing

    def __enter__(self) -> Guard:
        stores.HANDLER_HOOKS.append(self.wrap)
        return self

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(ValueError):
            stores.HANDLER_HOOKS.remove(self.wrap)

    def wrap(self, handler: Any, store: Any) -> None:
        from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

        self.store = store
        # By weak reference: a handler holding a function that holds the handler is a cycle, freed only when the
        # collector runs, and its store with it (node 0's next attempt after a hang binds the same port).
        first, real, handler_ref = [True], type(handler).next_rendezvous, weakref.ref(handler)

        def next_rendezvous() -> Any:
            if not first[0] and (code := worker_logs.not_restarted(self.plan, self.since)) is not None:
                self._tell(code)
                raise FinalStatus(code, None)
            try:
                met = real(handler_ref())
                if first[0]:
                    self.round = self._round()
                first[0] = False
                return met
            except RendezvousClosedError:
                told = self._told()
                if told is not None:
                    raise FinalStatus(*told) from None
                raise

        handler.next_rendezvous = next_rendezvous

    def _mac(self, round_id: str, code: int, node: int) -> str:
        return hmac.new(self.key, f"final|{round_id}|{code}|{node}".encode(), hashlib.sha256).hexdigest()

    def _round(self) -> str:
        # Node 0's launcher stamps each store it makes: a value from an earlier store does not verify in this one.
        return (stores.read_now(self.store, stores.ROUND_KEY) or b"")[:64].decode("ascii", "replace")

    def _tell(self, code: int) -> None:
        if self.plan.nnodes == 1 or self.store is None:
            return
        node = self.plan.node_rank
        with contextlib.suppress(Exception):  # the others then stop on a closed rendezvous, said less precisely
            value = {"code": code, "node": node, "mac": self._mac(self.round, code, node)}
            self.store.set(KEY, json.dumps(value))
            self._knows()

    def _knows(self) -> None:
        """This node knows why the run ended (its own workers said, or another node did): node 0 need not wait for it."""
        self.store.set(f"{KEY}/read/{self.plan.node_rank}", "1")

    def _told(self) -> tuple[int, int] | None:
        """(status, node) another node wrote, when it verifies: anyone who reaches the store can write the key."""
        if self.plan.nnodes == 1 or self.store is None:
            return None
        try:
            held = stores.read_now(self.store, KEY)
            if held is None:
                return None
            value = json.loads(held[:256])
            code, node = value["code"], value["node"]
            ok = type(code) is int and code in NOT_RESTARTED and type(node) is int and 0 <= node < self.plan.nnodes
            if not ok or not self.round or not hmac.compare_digest(str(value["mac"]), self._mac(self.round, code, node)):
                return None
            self._knows()
            return code, node
        except Exception:  # a store gone, a value that is not ours
            return None

    def hold(self) -> None:
        """Node 0, the store's host: it stays up until every other node knows why the run ended (or READ_WAIT_S)."""
        if self.plan.node_rank != 0 or self.plan.nnodes == 1 or self.store is None:
            return
        keys = [f"{KEY}/read/{n}" for n in range(1, self.plan.nnodes)]
        deadline = time.monotonic() + READ_WAIT_S
        with contextlib.suppress(Exception):
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.2)
