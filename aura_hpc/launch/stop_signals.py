"""When the launcher was asked to stop (Ctrl+C, SIGTERM, Slurm's SIGUSR2), seen from any thread.

torch's elastic agent owns the stop signals: its handler raises inside the agent, which forwards the
signal to the workers and waits `shutdown_timeout` for them. Meanwhile nothing of ours runs in the
main thread. A wake-up descriptor (`signal.set_wakeup_fd`) gets one byte per signal at C level,
whatever Python handler is installed, so the hang watchdog's thread learns at once that a stop was
asked (and cuts the wait short when the ranks are hung), and the verdict knows when it was asked
(was a checkpoint written after it?).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

STOPS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, getattr(signal, "SIGUSR2", signal.SIGTERM)}


@dataclass
class StopSignals:
    first: tuple[signal.Signals, float] | None = None  # the first stop signal and when (unix s)
    _read: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        """From the main thread, before the agent starts."""
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return
        self._read = r
        # The signal's time is when it came, not when something next asks: the agent may poll only once its
        # workers have exited, seconds after they checkpointed for it (read as "stopped before a checkpoint").
        threading.Thread(target=self._watch, args=(r,), name="aura-stop-signals", daemon=True).start()

    def _watch(self, r: int) -> None:
        import select

        while self.first is None and self._read == r:
            try:
                ready, _, _ = select.select([r], [], [], 1.0)
            except (OSError, ValueError):  # closed
                return
            if ready:
                self.poll()

    def poll(self) -> tuple[signal.Signals, float] | None:
        """The first stop signal so far (read from the descriptor without blocking)."""
        with self._lock:
            if self._read >= 0 and self.first is None:
                with contextlib.suppress(BlockingIOError, OSError):
                    for num in os.read(self._read, 512):
                        with contextlib.suppress(ValueError):
                            sig = signal.Signals(num)
                            if sig in STOPS and self.first is None:
                                self.first = (sig, time.time())
            return self.first

    def close(self) -> None:
        if threading.current_thread() is threading.main_thread() and self._read >= 0:
            w = signal.set_wakeup_fd(-1)
            with self._lock:  # the watching thread reads no descriptor that closes (or is reused) meanwhile
                r, self._read = self._read, -1
            for fd in (w, r):
                with contextlib.suppress(OSError):
                    os.close(fd)


def forward_like_sigterm(sigval: signal.Signals) -> Callable[[int, FrameType | None], None]:
    """What torch >= 2.8 does for the signals in `signals_to_handle`: the agent stops its workers with it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)

    return handler
