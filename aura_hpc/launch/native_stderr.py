"""Where torch's C++ output goes while a launcher runs its workers or its server: a log file, not the terminal.

Slurm log files and terminals get our one-line verdicts; the C++ warnings and stack traces of the
rendezvous and the collectives stay in the run's logs for whoever looks into a failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_OURS = 1 << 20  # past this, whatever was added is kept as it is


@contextlib.contextmanager
def native_stderr_to(path: Path) -> Iterator[None]:
    """While the workers run, what writes to file descriptor 2 directly (torch's C++ warnings and stack
    traces from the rendezvous and the collectives, the workers' own stderr, faulthandler dumps) goes
    to `path`; Python's sys.stderr (our one-line messages) stays on the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.stat().st_size if path.is_file() else 0
    sys.stderr.flush()
    terminal = os.dup(2)
    with open(path, "ab") as sink:
        os.dup2(sink.fileno(), 2)
    saved = sys.stderr
    sys.stderr = os.fdopen(os.dup(terminal), "w", buffering=1, encoding=saved.encoding, errors="replace")
    failed = True
    try:
        yield
        failed = False
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = saved
        os.dup2(terminal, 2)
        os.close(terminal)
        with contextlib.suppress(OSError):
            _drop_if_only_ours(path, existed, keep_ours=failed)


def _drop_if_only_ours(path: Path, existed: int, keep_ours: bool = False) -> None:
    """Nothing said past byte `existed` but the lines `local`'s workers write to place their attempts (a clean
    launch): those go, and the file with them when this launch made it. No empty file in the logs. After a
    failure (`keep_ours`) they stay: they tell which rank each failed worker was (launch/nccl_aborts.py)."""
    from aura_hpc.train.process.worker_log import JOINED, STARTED

    with open(path, "rb") as f:
        f.seek(existed)
        added = f.read(MAX_OURS + 1)
    lines = added.decode("utf-8", "replace").splitlines()
    if len(added) > MAX_OURS or (keep_ours and lines) or not all(STARTED in line or JOINED in line for line in lines):
        return
    if existed == 0:
        path.unlink()
    else:
        os.truncate(path, existed)
