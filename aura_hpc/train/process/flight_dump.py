"""gloo's flight record, on the watchdog's request, as NCCL's monitor thread gives NCCL's.

On NCCL torch's own monitor thread makes each rank's pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe)
and dumps its flight record when anything is written into it. gloo records its collectives too (torch
>= 2.13) but has no such thread: this one plays its part on the same pipe, so that the watchdog asks
and reads both alike (launch/hang_evidence.py, launch/flight_records.py). It blocks in a read, not in
Python code, and the training thread waits in gloo with the interpreter released: it answers while
that thread is stuck in a collective.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

log = logging.getLogger("aura_hpc")

PIPE_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch 2.13 reads the first set; 2.6 the second
_serving = False


def serve(rank: int) -> bool:
    """Answer the watchdog's requests for this rank's gloo flight record; False where there is nothing to
    answer with (no pipe asked for, or a torch that records nothing for gloo)."""
    import torch

    global _serving
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    stem = os.environ.get(PIPE_VAR, "")
    prefix = next((os.environ[v] for v in DUMP_VARS if os.environ.get(v)), "")
    if dump is None or not stem or not prefix or _serving:
        return _serving
    pipe = Path(f"{stem}{rank}.pipe")
    try:
        if not pipe.exists():
            os.mkfifo(pipe, 0o600)
        if not stat.S_ISFIFO(pipe.lstat().st_mode):
            return False
        requests = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        # A writer of our own: between requests a read then waits instead of seeing the end of the file.
        os.open(pipe, os.O_WRONLY)
        os.set_blocking(requests, True)
    except OSError as exc:
        log.warning("the flight record of rank %d cannot be asked for (%s): a hang's evidence will have its stacks only", rank, exc)
        return False
    out = Path(f"{prefix}{rank}")

    def answer() -> None:
        while True:
            try:
                if not os.read(requests, 64):
                    return
            except OSError:
                return
            try:
                data = dump()
                # Whole or absent: the watchdog copies it as soon as it changes.
                tmp = out.with_name(f".{out.name}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, out)
            except Exception as exc:  # a full disk, say: the next hang asks again
                log.warning("the flight record of rank %d could not be written (%s)", rank, exc)

    threading.Thread(target=answer, name="aura-flight-record", daemon=True).start()
    _serving = True
    return True
