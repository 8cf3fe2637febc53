"""Where the ranks of a job reach rank 0's store, and where gloo listens, when node names cannot be trusted.

Under Slurm the master address is where srun was started (slurm/job.py). A node whose own name maps
to loopback (Debian and Ubuntu write `127.0.1.1 <hostname>` in /etc/hosts) sees itself there: srun
reached its own node's slurmd over loopback, so that node's tasks alone were given 127.0.0.1, and
gloo, which listens at the machine name's address, would tell every peer to dial their own loopback.
"""

from __future__ import annotations

import os

from aura_hpc.ops.network import resolve, route_to
from aura_hpc.train.process.dist_env import DistEnv


def reached_at(env: DistEnv) -> str:
    """The master's address as the other nodes reach it: MASTER_ADDR's address, unless that is loopback while
    peers on other machines must reach it; then the address this machine reaches them from. Rank 0's store
    listens there alone, and the other ranks of its node dial it there too (they were given loopback)."""
    addr = resolve(env.master_addr, patient=True) or env.master_addr
    if not addr.startswith("127.") or not env.peer_host:
        return addr
    # Each rank of the node looks the peer up itself: a lookup that failed on one alone would send it to loopback.
    peer = resolve(env.peer_host, patient=True)
    if peer is None or peer.startswith("127."):
        return addr  # every node on this machine (a test cluster)
    return route_to(peer)[0] or addr


def dialled(env: DistEnv) -> str:
    """Where this rank dials rank 0's store: MASTER_ADDR, but on the master's own node under Slurm, where that may be
    loopback while rank 0 listens at the address the other nodes reach, that address."""
    return reached_at(env) if env.launcher == "slurm" and env.node_rank == 0 else env.master_addr


def gloo_interface(env: DistEnv) -> tuple[str, str] | None:
    """(interface, why) for GLOO_SOCKET_IFNAME where gloo would listen where no other node reaches it, else None.
    Unset, gloo listens at this machine's name's address, and falls back to loopback where the name does not
    resolve. `local` sets it from the route to the master address; a Slurm job the same way, only where gloo's
    own choice is loopback, and never over a value of the site's or the profile's. The route is to where the other
    nodes reach the master: on the master's own node, the address it reaches them from."""
    import socket

    if not env.peer_host or os.environ.get("GLOO_SOCKET_IFNAME"):  # one node, or a choice of the site's
        return None
    name = socket.gethostname()
    own = resolve(name)
    if own is not None and not own.startswith("127."):
        return None
    target = reached_at(env)
    _, iface = route_to(target)
    if iface is None:
        return None
    return iface, f"this node's name {name} resolves to {own or 'nothing'}, where gloo would listen instead of on the route to {target}"
