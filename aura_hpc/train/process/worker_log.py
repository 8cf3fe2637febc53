"""Plain, rank-prefixed log lines to stdout and to logs/rank_<R>.log in the run directory."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
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
    """On `sig`, every thread's Python stack into the rank's log file, while the main thread waits inside a
    collective too; and on a fatal signal (NCCL's watchdog aborts a rank whose collective timed out), through
    faulthandler. Through a duplicate of the log's descriptor, which stays open after logging closes the file.

    Not faulthandler.register for `sig`: its C handler walks the other threads' frames without the GIL, and a
    thread that starts or ends meanwhile crashes the process being asked (SIGSEGV, seen on the parameter
    server, whose link threads come and go). Python's own C handler only writes the signal's number into a
    wake-up pipe, from whichever thread receives it; a daemon thread reads it and dumps holding the GIL, which
    it gets while the main thread waits in torch's collectives, store waits and device synchronisations (each
    releases the GIL). A rank stuck in native code that holds the GIL does not answer: the watchdog names it
    silent and takes its native stack with py-spy instead."""
    import faulthandler

    for h in log.handlers:
        if isinstance(h, logging.FileHandler) and h.stream is not None:
            fd = os.dup(h.stream.fileno())
            faulthandler.enable(file=fd, all_threads=True)
            _answer_stack_requests(sig, fd)
            return


_stack_file: list[int] = []  # where the dump thread writes: the latest log's descriptor


def _answer_stack_requests(sig: int, fd: int) -> None:
    if _stack_file:
        _stack_file[0] = fd  # a second set-up in one process (tests): one thread, the newest log
        return
    if threading.current_thread() is not threading.main_thread():
        log.warning("no stack dumps on signal %d: set up outside the main thread", sig)
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:  # the descriptor is someone else's (one per process): leave it to them
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        log.warning("no stack dumps on signal %d: this process's signal wake-up descriptor is already in use", sig)
        return
    _stack_file.append(fd)
    signal.signal(sig, lambda _num, _frame: None)  # the dump thread answers; the main thread has nothing to do
    signal.siginterrupt(sig, False)  # as faulthandler did: system calls interrupted by it are restarted
    threading.Thread(target=_dump_when_asked, args=(r, sig), name="aura-stack-dump", daemon=True).start()


def _dump_when_asked(r: int, sig: int) -> None:
    import faulthandler

    while True:
        try:
            got = os.read(r, 512)  # one byte per signal with a Python handler; several requests, one dump
        except OSError:  # (an interrupted read is retried by Python itself)
            return
        if not got:
            return
        if sig in got:
            with contextlib.suppress(OSError, ValueError):
                faulthandler.dump_traceback(file=_stack_file[0], all_threads=True)


def to_file_only(message: str, exc_info: bool = True) -> None:
    """A record (with the current traceback) for the rank's log file only: detail the terminal does not need."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), sys.exc_info() if exc_info else None)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)
