"""The server's side of a worker's pair group: set up on its own store connection (a peer that never
completes it holds only that one, never the joins of the others), then both ends prove the run's
secret over it. Threads still setting up a pair are known, so a stopping server does not wait for
peers that never came. The group is constructed under REGISTRY_LOCK alone (wire.py), never under the
server's lock: the serve loop, the joins, a stop signal and its checkpoint never wait for a pair.
Once the pair has proved the secret, its keys leave the store."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from aura_hpc.ops.network import route_to
from aura_hpc.ps import wire
from aura_hpc.ps.probe import echo

log = logging.getLogger("aura_hpc")


def forget_pair_keys(store: Any, prefix: str) -> None:
    """The pair's keys (its members' gloo addresses) out of the store once the pair is up."""
    with contextlib.suppress(RuntimeError, ValueError):
        for rank in (0, 1):  # the pair's own keys (wire.pair_group); gloo's need a listing (torch >= 2.10)
            store.delete_key(f"{prefix}/aura/here/{rank}")
    list_keys = getattr(store, "list_keys", None)
    if list_keys is None:
        return
    with contextlib.suppress(RuntimeError, ValueError):
        for k in list_keys():
            name = k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)
            if name.startswith(prefix + "/"):
                store.delete_key(name)


class Pairing:
    def __init__(self, store: object, port: int, key: bytes, timeout_s: float) -> None:
        self.store, self.port, self.key, self.timeout_s = store, port, key, timeout_s
        self.setting_up: set[threading.Thread] = set()

    def link(self, prefix: str, peer_addr: str, nonce: str) -> wire.Link:
        own, _ = route_to(peer_addr)
        me = threading.current_thread()
        self.setting_up.add(me)
        client = group = link = None
        try:
            client = wire.another_client(self.store, "127.0.0.1", self.port, self.timeout_s)  # type: ignore[arg-type]
            group = wire.pair_group(client, prefix, 0, own or "127.0.0.1", self.timeout_s)
            link = wire.Link(group, 0, self.timeout_s)
            wire.handshake(link, self.key, nonce)
            forget_pair_keys(self.store, prefix)
            return link  # evaluated before `finally` clears the name
        except BaseException as exc:
            wire.drop_frames(exc)
            raise
        finally:
            self.setting_up.discard(me)
            with wire.REGISTRY_LOCK:
                client = group = link = None

    def echo(self, prefix: str, addr: str, nonce: str) -> None:
        """`check --server`'s round trip, through the same path as gradients."""
        link = None
        try:
            link = self.link(prefix, addr, nonce)
            echo(link)
        except RuntimeError as exc:
            log.warning("a connectivity check from %s did not complete (%s)", addr, wire.failure(exc))
        finally:
            with wire.REGISTRY_LOCK:
                link = None
