"""User-facing errors, each carrying one line that names the problem and the fix, and exit statuses.

The statuses are what README.md documents for `local` (and what a Slurm job's exit code shows).
"""

from __future__ import annotations

import contextlib
import unicodedata
from typing import NoReturn

EXIT_OK = 0
EXIT_TRAIN_FAILED = 1  # a process crashed or was killed, or training failed after it started
EXIT_USER_ERROR = 2  # bad input: a config, data, checkpoint or launch problem, refused before training
EXIT_DIVERGED = 3  # the loss stayed non-finite after every rollback
# Stopped on a signal (SIGTERM, SIGINT, SIGUSR2) after writing a checkpoint: re-run to resume.
# 75 is EX_TEMPFAIL in sysexits.h: "temporary failure, try again".
EXIT_RESUMABLE = 75
# Data in object storage could not be read after its retries: every rank stopped together after a
# checkpoint; re-run once the storage answers. 74 is EX_IOERR in sysexits.h.
EXIT_DATA_UNAVAILABLE = 74
# The GPU circuit breaker opened: a hardware fault; orchestrators should drain the node, not retry on it.
EXIT_GPU_FAULT = 76
# The run hung again and again without progress (launch/hang_watch.py named the rank each time): do not
# requeue it as it is; look at RUN_DIR/hangs/ first. 77 is EX_NOPERM in sysexits.h, unused by torch.
EXIT_HUNG = 77
# Pre-flight screening named a node below its figures (health.screen=only; or, on Slurm, the job is requeued without it).
EXIT_SCREEN = 78
# What a worker writes to its log file as it leaves (train/worker.py), for its launcher to read.
EXITING_LINE = "exiting with status "
# Statuses a restart would end the same way (or that a stop asked for): `--max-restarts` restarts crashes only.
NOT_RESTARTED = (EXIT_GPU_FAULT, EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_SCREEN, EXIT_DATA_UNAVAILABLE, EXIT_RESUMABLE)
# What a worker writes as it leaves with one of those (a line of its own: EXITING_LINE's 75 says a checkpoint was written).
FINAL_LINE = "ending for good with status "


# Control, format and line/paragraph-separator characters: they can start a line (in a terminal, a
# log, a generated script) or hide text. Config values are refused when they hold one.
BREAKING_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters shown as escapes (a value quoted in a
    message must not add lines to a terminal or a log, nor hide text)."""
    if all(unicodedata.category(c) not in BREAKING_CATEGORIES for c in text):
        return text
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in BREAKING_CATEGORIES else c for c in text)


def first_line(exc: BaseException) -> str:
    """What an exception says, in one line a message can quote (its type where it says nothing)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def shown(value: object, limit: int = 40) -> str:
    """A value as quoted in a message: repr, on one line, cut to about `limit` characters (a value
    from a file can be megabytes; the message must stay one readable line)."""
    text = one_line(repr(value))
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


class AuraError(Exception):
    """An error whose message is meant for the user as-is (no traceback), always one line."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(one_line(str(message)), *args)


class ConfigError(AuraError):
    pass


class DataError(AuraError):
    pass


class LaunchError(AuraError):
    pass


class CheckpointError(AuraError):
    pass


class CheckpointWriteError(CheckpointError):
    """Saving failed (disk full, permissions): training itself failed, the input was fine."""

    exit_code = EXIT_TRAIN_FAILED


class TrainingError(AuraError):
    """Training cannot go on (e.g. the loss stays non-finite after every rollback)."""

    exit_code = EXIT_DIVERGED


class TrainingFailed(AuraError):
    """Workers started and failed (crashed, killed, or stopped on an error); the launcher's verdict."""

    def __init__(self, message: str, exit_code: int = EXIT_TRAIN_FAILED) -> None:
        super().__init__(message)  # made one line by AuraError
        self.exit_code = exit_code


EXIT_HANDLERS_S = 20.0  # the longest a process's exit handlers may take once its work is done


def exit_process(status: int) -> NoReturn:
    """End the process with `status` once its own work is done. The exit handlers run and the streams are
    flushed as on a normal exit, but the interpreter does not then tear torch's modules down one by one:
    0.5 s of CPU per process with torch loaded, 0.8 s with its compiler (which DDP imports), measured here;
    a `local` run waits for its workers' and then its own. Where a thread that is not a daemon still runs,
    the normal exit (which waits for it) is taken."""
    import atexit
    import os
    import signal
    import sys
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if "torch" not in sys.modules or others:
        sys.exit(status)
    with contextlib.suppress(SystemExit):
        sys.exit(status)  # what wraps sys.exit learns the status (wandb's exit hook reports it to its run)
    # logging's shutdown (it flushes and closes every handler) among them. On a thread, joined for a bounded time:
    # W&B's hook waits for its service process with no limit, and online with no server answering that held every
    # worker's exit 60-90 s past tracking.finish_wait_s (measured), a `local` run and a Slurm step with it.
    handlers = threading.Thread(target=atexit._run_exitfuncs, name="aura-exit-handlers", daemon=True)
    with contextlib.suppress(ValueError):  # a Ctrl+C now would raise here and run the handlers a second time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    handlers.start()
    handlers.join(EXIT_HANDLERS_S)
    if handlers.is_alive():
        import logging

        with contextlib.suppress(Exception):
            logging.shutdown()  # the hooks run last to first: logging's, registered early, had not run yet
        with contextlib.suppress(OSError, ValueError):
            print(f"[aura_hpc] exit handlers still running after {EXIT_HANDLERS_S:g} s (a tracker's?): not waited for", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C's buffered output (a native library's printf), which os._exit does not flush
    os._exit(status)
