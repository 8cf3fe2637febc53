"""A node that arrives when the run already has every node it counts waits in torch's rendezvous, unseen.

torch's c10d rendezvous keeps a node that finds the round full (min = max = --nnodes, all of them training) in
its redundancy list, with no timeout: a spare, which takes the place of the first node to leave. A second
machine started with a --node-rank that is already training (or an --nnodes one short) waited there, silent,
until the run ended, and then said that the nodes "did not all join". The watch says it within seconds of the
node becoming a spare, and when the launch ends with the node never used, that is the verdict (exit 2).
"""

from __future__ import annotations

import base64
import contextlib
import threading
from datetime import timedelta
from typing import Any

from aura_hpc.comm import rendezvous_state, stores

POLL_S = 2.0


class SpareWatch:
    """While one launch of a node other than 0 runs: whether, and since when, the rendezvous keeps it as a spare."""

    def __init__(self, plan: Any, state_key: str) -> None:
        self.plan, self.state_key = plan, state_key
        self.spare = False  # seen in the redundancy list and never yet a participant
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SpareWatch:
        if self.plan.node_rank > 0:  # node 0 hosts the round: the first to join it, never a spare
            stores.HANDLER_HOOKS.append(self.wrap)
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        with contextlib.suppress(ValueError):
            stores.HANDLER_HOOKS.remove(self.wrap)

    def wrap(self, handler: Any, _store: Any) -> None:
        node = getattr(handler, "_this_node", None)  # torch's description of this launcher in the state
        if node is None or self._thread is not None:
            return
        me = (node.addr, node.pid, node.local_id)
        self._thread = threading.Thread(target=self._watch, args=(me,), name="aura-spare-watch", daemon=True)
        self._thread.start()

    def _watch(self, me: tuple[str, int, int]) -> None:
        try:
            store = stores.client(self.plan.master_addr, self.plan.master_port, timedelta(seconds=10), give_up_s=5.0)
        except Exception:  # node 0 not there (yet): the join itself says what is wrong
            return
        while not self._done.wait(POLL_S):
            try:
                state = rendezvous_state.read(base64.b64decode(store.get(self.state_key)), self.plan.nnodes)
            except Exception:  # torch's sentinel before the first round, a store gone, a state a stranger rewrote
                if not store.check([self.state_key]):
                    return
                continue
            nodes = lambda group: {(n.addr, n.pid, n.local_id) for n in group}  # noqa: E731
            if me in nodes(state.participants):
                self.spare = False
                return  # joined: the run's own checks take over
            if me in nodes(state.redundancy_list) and not state.closed and not self.spare:
                self.spare = True
                from aura_hpc import console

                console.warn(self.line(waiting=True))

    def line(self, waiting: bool) -> str:
        n, rank, at = self.plan.nnodes, self.plan.node_rank, self.plan.master
        if waiting:
            return (
                f"node 0's run at {at} already has its {n} nodes training: this node waits as a spare, to take the place of the "
                f"first one to leave (fix: if this machine was meant to train beside them, stop it: another machine was started "
                f"with --node-rank {rank}, or --nnodes is one short; give every machine its own --node-rank, or restart every "
                f"node with --nnodes {n + 1})"
            )
        return (
            f"the run at {at} ended while this node waited as a spare (its {n} nodes were all training), so it trained nothing "
            f"(fix: give every machine its own --node-rank, and --nnodes counting them all, on every node)"
        )
