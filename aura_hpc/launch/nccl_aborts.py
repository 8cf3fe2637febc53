"""Which failed ranks NCCL itself took down because they waited on a peer: victims, not the cause.

On NCCL a collective that waits past dist.timeout_s, or whose peer went away, is ended by torch's
watchdog thread, which takes the whole process down with SIGABRT ("To avoid data inconsistency, we
are taking the entire process down"). The healthy ranks then die of a signal, and a verdict that
names the ranks killed by a signal first (usually the cause: the OOM killer, a segfault) would
blame them. Each abort is one line of torch's log in the node's stderr log (launch/native_stderr.py),
"Process group watchdog thread terminated with exception: <why>", prefixed `[rankN]:` with the rank
of the default group (ours, numbered node by node; the launcher counts in its own order). Each worker
writes where its attempt began and, once the ranks met, which rank it is (train/process/worker_log.py),
so an abort is matched to the attempt and the local rank the launcher reports. Only prefixed lines
count: the workers share the file, and an unprefixed line (a traceback) may be any process's. A CUDA
error leaves the same way, and there the rank is the cause: only the two waits demote it.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

from aura_hpc.train.process.worker_log import JOINED, STARTED

ABORTED = "Process group watchdog thread terminated with exception"
# Where <why> is a wait: torch's ProcessGroupNCCL (a timeout); NCCL's ncclGetErrorString (a peer gone).
WAITED = {
    "Watchdog caught collective operation timeout": "a collective timed out (dist.timeout_s)",
    "remote process exited or there was a network error": "a peer went away",
}
_PREFIX = re.compile(r"^\[rank(\d+)\]:")
_STARTED = re.compile(re.escape(STARTED) + r"(\d+)$")
_JOINED = re.compile(r"^\[rank(\d+)\]: " + re.escape(JOINED) + r"(\d+)$")
TAIL_BYTES = 4 << 20


def waited_on_a_peer(log_dir: Path, node_rank: int, failures: dict[int, Any], since: int = 0) -> dict[int, str]:
    """The launcher's rank -> why NCCL ended it, for the failures (torch's ProcessFailure: exitcode,
    local_rank) that died of SIGABRT after a wait, in their latest attempt in this node's stderr log past
    byte `since` (this launch's part)."""
    aborted = {r: f.local_rank for r, f in failures.items() if f.exitcode == -signal.SIGABRT}
    if not aborted:
        return {}
    aborts = _aborts_by_local_rank(log_dir / f"stderr_node{node_rank}.log", since)
    out = {}
    for r, local in aborted.items():
        line = aborts.get(local, "")
        why = next((why for words, why in WAITED.items() if words in line), None)
        if why is not None:
            out[r] = why
    return out


def _aborts_by_local_rank(log: Path, since: int) -> dict[int, str]:
    """local rank -> torch's abort line in its latest attempt (none if that attempt did not abort so)."""
    try:
        with open(log, "rb") as f:
            end = f.seek(0, 2)
            f.seek(max(since, end - TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return {}
    local_of: dict[int, int] = {}  # rank -> local rank, in the attempts running
    aborts: dict[int, str] = {}
    for line in lines:
        if m := _STARTED.search(line):
            local = int(m.group(1))
            aborts.pop(local, None)  # a new attempt of that local rank: the earlier one's lines are not its
            local_of = {r: lr for r, lr in local_of.items() if lr != local}
        elif m := _JOINED.match(line):
            local_of[int(m.group(1))] = int(m.group(2))
        elif (m := _PREFIX.match(line)) and ABORTED in line and int(m.group(1)) in local_of:
            aborts[local_of[int(m.group(1))]] = line
    return aborts
