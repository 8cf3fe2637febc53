"""A word from rank 0 to every rank through the store the ranks met in, for waits longer than a collective's.

Rank 0 writes a checkpoint for as long as a shared disk takes (a big model: tens of minutes), and the others wait for
its outcome. On the world's group (NCCL) that wait timed out at dist.timeout_s; a gloo group of its own connects every
pair of ranks (a thousand sockets each at 1,024 ranks) to carry one line. Here rank 0 sets one key, signed under the
run's secret, and the others look for it once a second.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aura_hpc.train.process import distributed

POLL_S = 1.0


def said_by_rank_0(topic: str, text: str | None, patience_s: float) -> tuple[bool, str | None]:
    """(True, rank 0's `text`) on every rank; (False, None) where it said nothing within `patience_s`. Every rank
    calls it with the same `topic` once (a new topic each time: keys are never read twice)."""
    agree = distributed._AGREE
    if agree is None or agree[3] == 1:
        return True, text
    store, prefix, rank, _, key = agree
    name = f"{prefix}/{topic}"
    if rank == 0:
        # Cut to what a reader opens (1,200 bytes with the signature): a longer one would read as a stranger's.
        cut = text
        while cut is not None and len(json.dumps(cut)) > 1000:
            cut = cut[: len(cut) * 3 // 4]
        store.set(name, distributed._signed(key, name, json.dumps(cut)))
        return True, text
    deadline, pause = time.monotonic() + patience_s, 0.01
    # Looked for, not waited on: a wait holds the store client (shared with this process's other threads) throughout.
    # Soon at first (most saves have nothing left to write), then once a second.
    while not store.check([name]):
        if time.monotonic() > deadline:
            return False, None
        time.sleep(pause)
        pause = min(POLL_S, pause * 2)
    said = distributed._opened(key, name, store.get(name))
    try:
        value: Any = json.loads(said)
    except ValueError:
        return True, said  # not JSON: what _opened says of an answer no rank of this run signed
    return True, value if value is None else str(value)
