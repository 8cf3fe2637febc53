"""Graceful stop on SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 (Slurm's pre-timeout signal).

The handler only records the signal; the trainer acts at the next step boundary, where all
ranks agree in one collective, write one checkpoint and exit with EXIT_RESUMABLE.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

# SIGQUIT (Ctrl+\) too: the launcher forwards it as a stop (torch < 2.8 whatever it is told), and its default dumps core.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)

# The signal that stopped the last trainer in this process: the Slurm job wrapper requeues
# only for the pre-timeout signal, never for a cancel (SIGTERM).
last_signal: str | None = None


# A stop signal that came before the trainer's StopRequest was installed (a Slurm task's start-up: rendezvous, build,
# resume): the first StopRequest installed takes it over and stops at its first step boundary, with a checkpoint.
early_signal: str | None = None


def record_early() -> None:
    """Until a StopRequest is installed, a stop signal is recorded, not acted on. Under submitit, its own handlers
    ruled until then: a pre-timeout USR2 failed the job ("not checkpointable") or requeued it outside
    slurm.max_requeues, and a cancel's SIGTERM was only logged."""
    _handle_stop_signals(_record)


def _handle_stop_signals(handler: Callable[[int, FrameType | None], None]) -> None:
    for sig in STOP_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue  # started under nohup: a logout must not stop the run
        signal.signal(sig, handler)


def _record(signum: int, _frame: FrameType | None) -> None:
    global early_signal, last_signal
    if early_signal is None:
        early_signal = last_signal = signal.Signals(signum).name


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> None:
        _handle_stop_signals(self._handle)
        global early_signal
        if early_signal is not None and self.signal_name is None:
            self.signal_name, early_signal = early_signal, None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Only a flag: raising here (KeyboardInterrupt) could tear a checkpoint write in half.
        global last_signal
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            last_signal = self.signal_name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
