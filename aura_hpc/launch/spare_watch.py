"""A node that arrives when the run already has every node it counts waits in torch's rendezvous, unseen.

torch's c10d rendezvous keeps a node that finds the round full (min = max = --nnodes, all of them training) in
its redundancy list, with no timeout: a spare, which takes the place of the first node to leave. A second
machine started with a --node-rank that is already training (or an --nnodes one short) waited there, silent,
until the run ended, and then said that the nodes "did not all join". The watch says it once the node has been
a spare for SURE_S, and when the launch ends with the node never used, that is the verdict (exit 2).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from typing import Any

from aura_hpc.comm import rendezvous_state, stores

POLL_S = 2.0
# torch drops a participant whose heartbeats stopped after 3 x 5 s: a node relaunched at once (Ctrl+C, then the same
# command) is a spare until its old self is dropped, then joins. Said only of a node still a spare after this long.
SURE_S = 20.0


class SpareWatch:
    """While one launch of a node other than 0 runs: whether the rendezvous keeps it as a spare."""

    def __init__(self, plan: Any, state_key: str) -> None:
        self.plan, self.state_key = plan, state_key
        self.spare = False  # in the redundancy list at the last look (or since, and never a participant after it)
        self.said = False
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

    def wrap(self, handler: Any, store: Any) -> None:
        node = getattr(handler, "_this_node", None)  # torch's description of this launcher in the state
        if node is None or self._thread is not None:
            return
        me = (node.addr, node.pid, node.local_id)
        # The handler's own client (its operations take one lock each): no store object made or dropped on this
        # thread while the main one makes torch's (pybind11's race: ps/wire.py).
        self._thread = threading.Thread(target=self._watch, args=(me, store), name="aura-spare-watch", daemon=True)
        self._thread.start()

    def _watch(self, me: tuple[str, int, int], store: Any) -> None:
        since: float | None = None
        while not self._done.wait(POLL_S):
            try:
                # Not `get`: on a key a stranger deleted it waits the store's whole timeout holding the client's lock,
                # and the agent's own reads, which name the deletion, waited behind it until node 0 had gone.
                held = stores.read_now(store, self.state_key)
                if held is None:
                    continue
                state = rendezvous_state.read(base64.b64decode(held), self.plan.nnodes)
            except Exception:  # torch's sentinel before the first round, a store gone, a state a stranger rewrote
                continue
            nodes = lambda group: {(n.addr, n.pid, n.local_id) for n in group}  # noqa: E731
            if me in nodes(state.redundancy_list) and not state.closed:
                since = since if since is not None else time.monotonic()
                self.spare = True
                if not self.said and time.monotonic() - since >= SURE_S:
                    self.said = True
                    from aura_hpc import console

                    console.warn(self.line(waiting=True))
            elif me in nodes(state.participants):  # joined (also after a restart round took it in)
                since, self.spare = None, False
            else:
                since = None

    @staticmethod
    def ended_as_spare(exc: AttributeError) -> bool:
        """torch's agent swallows a spare's graceful exit (the rendezvous closed while it waited) and returns no
        result, which its launcher then reads: only a node in the redundancy list gets that exit."""
        return getattr(exc, "name", None) == "is_failed" and getattr(exc, "obj", False) is None

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
