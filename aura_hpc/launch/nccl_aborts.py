"""Which failed ranks NCCL itself took down because they waited on a peer: victims, not the cause.

On NCCL a collective that waits past dist.timeout_s, or whose peer went away, is ended by torch's
watchdog thread, which takes the whole process down with SIGABRT ("To avoid data inconsistency, we
are taking the entire process down"). The healthy ranks then die of a signal, and a verdict that
names the ranks killed by a signal first (usually the cause: the OOM killer, a segfault) would
blame them. Their C++ lines, in the node's stderr log (launch/native_stderr.py, each line of torch's
log prefixed `[rankN]:` with the global rank), say why. A CUDA error leaves the same way, and there
the rank is the cause: only the two waits are matched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

# torch's ProcessGroupNCCL (a timeout), torch's and NCCL's words for ncclRemoteError (a peer gone).
WAITED = {
    "Watchdog caught collective operation timeout": "a collective timed out (dist.timeout_s)",
    "ncclRemoteError": "a peer went away",
    "remote process exited or there was a network error": "a peer went away",
}
_PREFIX = re.compile(r"^\[rank(\d+)\]:")
TAIL_BYTES = 1 << 20


def waited_on_a_peer(log: Path, ranks: Iterable[int]) -> dict[int, str]:
    """rank -> why NCCL ended it, for those of `ranks` whose lines in `log` (its last MiB) show a wait."""
    wanted = set(ranks)
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return {}
    found: dict[int, str] = {}
    rank = None
    for line in text.splitlines():
        if m := _PREFIX.match(line):
            rank = int(m.group(1))  # a line without the prefix continues the last one that had it
        if rank in wanted and rank not in found:
            for words, why in WAITED.items():
                if words in line:
                    found[rank] = why
                    break
    return found
