"""What this node's workers said in its stderr log: which rank each became, and which of them NCCL itself
took down because they waited on a peer (victims, not the cause).

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

The same lines name a failed worker by our rank, the one in its `rank_N.log`: torchrun numbers nodes by
address, then by the launcher's pid, so on a LAN its rank can be another node's (node 1 started first
holds torchrun's ranks 0..).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
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


@dataclass(frozen=True)
class LatestAttempts:
    """What the latest attempt of each local rank wrote in this launch's part of the node's stderr log."""

    ranks: dict[int, int]  # local rank -> its rank (ours, numbered node by node), once the ranks met
    aborts: dict[int, str]  # local rank -> torch's abort line

    def name(self, failure: Any, launcher_rank: int, nnodes: int, node_rank: int) -> str:
        """How the failure line calls a failed worker (torch's ProcessFailure: local_rank)."""
        if (rank := self.ranks.get(failure.local_rank)) is not None:
            return f"rank {rank}"
        if nnodes == 1:
            return f"rank {launcher_rank}"  # one node: torchrun's numbering is ours
        return f"local rank {failure.local_rank} of node {node_rank}"  # it died before learning its rank


def latest_attempts(log_dir: Path, node_rank: int, since: int = 0) -> LatestAttempts:
    """Read from this node's stderr log past byte `since` (this launch's part; its last TAIL_BYTES)."""
    try:
        with open(log_dir / f"stderr_node{node_rank}.log", "rb") as f:
            end = f.seek(0, 2)
            f.seek(max(since, end - TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return LatestAttempts({}, {})
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
    return LatestAttempts({local: r for r, local in local_of.items()}, aborts)


def waited_on_a_peer(attempts: LatestAttempts, failures: dict[int, Any]) -> dict[int, str]:
    """The launcher's rank -> why NCCL ended it, for the failures (torch's ProcessFailure: exitcode,
    local_rank) that died of SIGABRT after a wait, in their latest attempt."""
    out = {}
    for r, f in failures.items():
        line = attempts.aborts.get(f.local_rank, "") if f.exitcode == -signal.SIGABRT else ""
        why = next((why for words, why in WAITED.items() if words in line), None)
        if why is not None:
            out[r] = why
    return out
