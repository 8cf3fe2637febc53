"""Plain, rank-prefixed log lines to stdout and to logs/rank_<R>.log in the run directory."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("aura_hpc")
# Lines each `local` worker writes to file descriptor 2 (the node's stderr log, beside torch's C++ lines, which
# carry `[rankN]:`): where an attempt of local rank L begins, and once the ranks have met, which rank it is.
# launch/nccl_aborts.py reads an abort of torch's by them.
STARTED = "aura_hpc worker started: local rank "
JOINED = "aura_hpc worker joined: local rank "


def mark_stderr(line: str) -> None:
    """One line to file descriptor 2, under `local` only (Slurm's logs have no reader for it)."""
    if os.environ.get("AURA_LAUNCHER_PID"):
        with contextlib.suppress(OSError):
            os.write(2, line.encode() + b"\n")


def setup(log_dir: Path | None, rank: int, stream_handler: logging.Handler | None = None, label: str = "") -> logging.Logger:
    """`label` replaces "rank<R>" in the prefix and the file name (the parameter server's `ps`, `worker2`)."""
    fmt = logging.Formatter(f"[{label or f'rank{rank}'}] %(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = stream_handler or logging.StreamHandler(sys.stdout)
    handler.setFormatter(fmt)
    log.addHandler(handler)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        # Appended, not truncated: a resumed run's log shows every attempt.
        fh = logging.FileHandler(log_dir / (f"{label}.log" if label else f"rank_{rank}.log"), mode="a", encoding="utf-8")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    return log


def dump_stacks_on(sig: int) -> None:
    """On `sig`, every thread's Python stack into the rank's log file: faulthandler answers from its C
    handler, so a rank blocked inside a collective (in C++, holding no GIL to give) answers too. The same
    on a fatal signal (NCCL's watchdog aborts a rank whose collective timed out). Through a duplicate of
    the log's descriptor, which stays open after logging closes the file at exit."""
    import faulthandler
    import os

    for h in log.handlers:
        if isinstance(h, logging.FileHandler) and h.stream is not None:
            fd = os.dup(h.stream.fileno())
            faulthandler.register(sig, file=fd, all_threads=True)
            faulthandler.enable(file=fd, all_threads=True)
            return


def to_file_only(message: str, exc_info: bool = True) -> None:
    """A record (with the current traceback) for the rank's log file only: detail the terminal does not need."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), sys.exc_info() if exc_info else None)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)
