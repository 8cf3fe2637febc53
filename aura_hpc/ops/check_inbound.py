"""`check` across machines: can node 0 open a connection to every other node?

A check that met at node 0's port alone passed where training then waited: the workers' store is on the node torch's
rendezvous ranks first (the address that sorts first as text, not always node 0), and gloo connects both ways, so every
node's firewall must let the others in. Each other node listens on the address it reaches the master from; node 0
connects, and says in the check's store whether it got in.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from datetime import timedelta
from typing import Any

from aura_hpc.ops.check_report import Failed, Report

_MAX_SAID = 200


def inbound(report: Report, node_rank: int, nnodes: int, store: Any, nodes: list[dict[str, Any]], deadline: float) -> None:
    if nnodes < 2:
        return
    if node_rank > 0:
        _listen(report, node_rank, store, nodes, deadline)
        return
    failed = []
    for r in range(1, nnodes):
        why = _connect(store, r, nodes[r]["ip"], deadline)
        store.set(f"inbound{r}", why or "ok")
        if why:
            failed.append(f"node {r} at {nodes[r]['ip']}: {why}")
    if failed:
        report.add("inbound", False, f"node 0 cannot open a connection to {'; '.join(failed)}", _fix(nodes))
        raise Failed
    report.add("inbound", True, f"node 0 opened a connection to each of the {nnodes - 1} other node(s)")


def _listen(report: Report, node_rank: int, store: Any, nodes: list[dict[str, Any]], deadline: float) -> None:
    # On the address this node reaches the master from: the one the others are given for it.
    with socket.create_server((nodes[node_rank]["ip"], 0)) as listener:
        store.set(f"inbound-port{node_rank}", str(listener.getsockname()[1]))
        try:
            store.wait([f"inbound{node_rank}"], _left(deadline))
            said = store.get(f"inbound{node_rank}").decode("utf-8", "replace")[:_MAX_SAID]
        except Exception:
            said = "node 0 never said whether it got in"
    if said != "ok":
        shown = "".join(c if c.isprintable() else "?" for c in said)  # from the network: shown, never trusted
        report.add("inbound", False, f"node 0 cannot open a connection to this machine ({shown})", _fix(nodes))
        raise Failed
    report.add("inbound", True, "node 0 opened a connection to this machine")


def _connect(store: Any, r: int, ip: str, deadline: float) -> str:
    """Why node 0 could not open a connection to node r ("" when it could)."""
    try:
        store.wait([f"inbound-port{r}"], _left(deadline))
        port = int(store.get(f"inbound-port{r}")[:8])
        address = ipaddress.ip_address(ip)  # a node's facts come from the network: an address, never a name to look up
    except Exception:
        return "it never said where it listens"
    if not 0 < port < 65536:
        return "it never said where it listens"
    try:
        with socket.create_connection((str(address), port), timeout=max(1.0, min(5.0, deadline - time.monotonic() - 1.0))):
            return ""
    except TimeoutError:
        return "no answer (a firewall that drops it)"
    except OSError as exc:
        return f"{(exc.strerror or type(exc).__name__).lower()} (a firewall that refuses it)"


def _fix(nodes: list[dict[str, Any]]) -> str:
    node0 = nodes[0]["ip"]
    return (
        f"on every other node, let node 0 in: the workers' store may be there and gloo connects both ways "
        f"(e.g. sudo ufw allow from {node0}; an inbound rule for python.exe on Windows); docs/lan.md, Firewall"
    )


def _left(deadline: float) -> timedelta:
    """What is left of the check's time for one wait on the store, a second kept for the report."""
    return timedelta(seconds=max(0.5, deadline - time.monotonic() - 1.0))
