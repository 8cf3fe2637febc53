"""What `check` across machines reads from node 0's store: anyone who reaches that port can write
there, so each value is checked before it is used, and none becomes a path."""

from __future__ import annotations

import json
import re
from typing import Any

from aura_hpc.ops.check_report import Failed, Report

_MAX_INFO_BYTES = 64 * 1024
_NONE = type(None)
# What check_cluster._node_info publishes, by type: the report and the address findings read each.
_FIELDS: dict[str, tuple[type, ...]] = {
    "node_rank": (int,),
    "hostname": (str,),
    "hostname_ip": (str, _NONE),
    "ip": (str, _NONE),
    "interface": (str, _NONE),
    "uid": (int, _NONE),
    "gid": (int, _NONE),
    "user": (str,),
    "pid": (int,),
}


def node_from_store(report: Report, store: Any, r: int) -> dict[str, Any]:
    """Node r's facts as it published them; anyone who reaches the port can write there, so a value
    that is not a node's own (too big, not JSON, another rank's) stops the check with its line."""
    raw = store.get(f"info{r}")
    try:
        if len(raw) > _MAX_INFO_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        node = json.loads(raw)
        if not isinstance(node, dict) or any(not isinstance(node.get(k, ...), t) for k, t in _FIELDS.items()):
            raise ValueError("not a node's facts")
        if node["node_rank"] != r:
            raise ValueError(f"it says node rank {node['node_rank']}")
        if any(isinstance(v, str) and (len(v) > 255 or not v.isprintable()) for v in node.values()):
            raise ValueError("a name with control characters or over 255 characters")  # shown in the user's terminal
    except (ValueError, RecursionError) as exc:
        report.add(
            "rendezvous",
            False,
            f"node rank {r}'s facts in the master's store are not what `check` writes ({exc})",
            "another program wrote into the check's port: run it again on a port only your machines reach (--master-port)",
        )
        raise Failed from None
    return node


def peer_token(store: Any) -> str | None:
    """The name node 0 chose for this check's folder, or None: it comes from the network, and only a
    name `check` makes (32 hex digits) may become a path, never one that leaves the shared folder."""
    raw = store.get("shared-token")
    return raw.decode("ascii") if re.fullmatch(rb"[0-9a-f]{32}", raw) else None
