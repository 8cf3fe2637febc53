"""Which failed ranks NCCL itself took down because they waited on a peer: victims, not the cause.

On NCCL a collective that waits past dist.timeout_s, or whose peer went away, is ended by torch's
watchdog thread, which takes the whole process down with SIGABRT ("To avoid data inconsistency, we
are taking the entire process down"). The healthy ranks then die of a signal, and a verdict that
names the ranks killed by a signal first (usually the cause: the OOM killer, a segfault) would
blame them. Each abort is one line of torch's log in the node's stderr log (launch/native_stderr.py),
"Process group watchdog thread terminated with exception: <why>", prefixed `[rankN]:` with the rank
of the default group (ours, numbered node by node; the launcher's failures count in its own order,
so a rank is matched by its local rank through its `start` line). Only prefixed lines count: the
workers share the file, and an unprefixed line (a traceback) may be any process's. A CUDA error leaves
the same way, and there the rank is the cause: only the two waits demote it.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

ABORTED = "Process group watchdog thread terminated with exception"
# Where <why> is a wait: torch's ProcessGroupNCCL (a timeout); NCCL's ncclGetErrorString (a peer gone).
WAITED = {
    "Watchdog caught collective operation timeout": "a collective timed out (dist.timeout_s)",
    "remote process exited or there was a network error": "a peer went away",
}
_PREFIX = re.compile(r"^\[rank(\d+)\]:")
_START = re.compile(r" start rank=(\d+) local_rank=(\d+) .* node_rank=(\d+) ")
TAIL_BYTES = 1 << 20


def waited_on_a_peer(log_dir: Path, node_rank: int, failures: dict[int, Any], since: int = 0) -> dict[int, str]:
    """The launcher's rank -> why NCCL ended it, for the failures (torch's ProcessFailure: exitcode,
    local_rank) that died of SIGABRT after a wait, by their last abort in this node's stderr log past
    byte `since` (this launch's)."""
    aborted = {r: f.local_rank for r, f in failures.items() if f.exitcode == -signal.SIGABRT}
    if not aborted:
        return {}
    final = _ranks_by_local_rank(log_dir, node_rank)
    last = _last_aborts(log_dir / f"stderr_node{node_rank}.log", since)
    out = {}
    for r, local in aborted.items():
        line = last.get(final.get(local, -1), "")
        why = next((why for words, why in WAITED.items() if words in line), None)
        if why is not None:
            out[r] = why
    return out


def _tail(path: Path, since: int = 0) -> list[str]:
    try:
        with open(path, "rb") as f:
            end = f.seek(0, 2)
            f.seek(max(since, end - TAIL_BYTES))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _last_aborts(log: Path, since: int) -> dict[int, str]:
    """rank -> its last abort line (a restart's attempt aborts again, or not at all)."""
    last = {}
    for line in _tail(log, since):
        if (m := _PREFIX.match(line)) and ABORTED in line:
            last[int(m.group(1))] = line
    return last


def _ranks_by_local_rank(log_dir: Path, node_rank: int) -> dict[int, int]:
    """local rank -> rank, from the newest `start` line of each rank's log on this node."""
    out = {}
    for path in log_dir.glob("rank_*.log"):
        starts = [m for line in _tail(path) if (m := _START.search(line)) and int(m.group(3)) == node_rank]
        if starts:
            out[int(starts[-1].group(2))] = int(starts[-1].group(1))
    return out
