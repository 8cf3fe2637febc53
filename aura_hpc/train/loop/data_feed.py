"""Keeping the shards a rank reads on local disk, for data in object storage: the current shuffle
window before its first step, the next one in the background while this one trains.

Before the first step of each window every rank says whether it has the window's shards, and the
ranks decide together (through the rendezvous store, not a collective): a read that is slow makes
all ranks wait for it, and a read that failed after its retries makes all ranks stop together,
with a checkpoint, instead of one rank leaving the others in a collective until it times out.
For local data this is all a no-op.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from aura_hpc.data.cache import CacheFull
from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.packed import TokenReader
from aura_hpc.errors import DataError
from aura_hpc.train.process import distributed, progress

log = logging.getLogger("aura_hpc")


class DataUnavailable(DataError):
    """The ranks agreed that the data of the next steps cannot be read: checkpoint and stop."""


class DataFeed:
    def __init__(self, data: TokenReader, order: GlobalOrder, patience_s: float) -> None:
        self.data, self.order = data, order
        self.active = data.remote
        self.patience_s = patience_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="aura-fetch") if self.active else None
        self._fetching: dict[tuple[int, int], Future[None]] = {}
        self._agreed: set[tuple[int, int]] = set()
        self._kept: list[tuple[int, int]] = []  # the windows pinned last

    def _fetch(self, window: tuple[int, int]) -> Future[None]:
        f = self._fetching.get(window)
        if f is not None and f.done() and isinstance(f.exception(), CacheFull):  # fetched ahead of room: room made since
            f = None
        if f is None:
            assert self._pool is not None
            shards = self.order.window_shards(*window)
            f = self._fetching[window] = self._pool.submit(self.data.fetch, "train", shards)
        return f

    def setup(self, eval_sequences: int) -> None:
        """Before training: the validation shards evaluation reads, agreed like a window."""
        if not self.active:
            return
        problem = ""
        try:
            self.data.fetch_validation(eval_sequences, self.order.window_shards(0, 0))
        except DataError as exc:
            problem = str(exc)
        self._decide("validation", problem)

    def ensure(self, start: int, count: int) -> None:
        """The shards of positions [start, start+count) are local on every rank, or every rank stops."""
        if not self.active:
            return
        # Window by window in position order, the same questions in the same order on every rank: a node whose
        # stream cache knew a window's sizes asked about the next unknown window first, one whose cache did not
        # about this one, and each waited for an answer to a question the other never asked. A window not
        # encoded yet: making it ready teaches the order its sizes.
        while True:
            known, unknown = self.order.windows_ahead(start, count)
            todo = next((w for w in known if w not in self._agreed), unknown)
            if todo is None:
                self._keep([*known, self.order.next_window(*known[-1])] if known else [])
                if known:
                    self._fetch(self._kept[-1])  # downloads (or encodes) while this step trains
                return
            self._keep([*known, *([todo] if todo not in known else [])])  # room for it: what this step reads alone
            self._make_ready(todo)

    def _keep(self, windows: list[tuple[int, int]]) -> None:
        """Keep on disk the windows the step reads (and the next one, fetched behind it). A step across a window's
        boundary reads the one before too: unpinned, its shards were evicted by the next window's prefetch while
        the step read them, then fetched again on one rank, outside the ranks' agreement."""
        if not windows or windows == self._kept:
            return
        self._kept = windows
        with progress.current().section("data"):  # a stream's eviction waits for the pieces its encoders hold
            self.data.pin("train", {s for w in windows for s in self.order.window_shards(*w)})
        for old in [w for w in self._fetching if w not in windows]:
            del self._fetching[old]

    def _make_ready(self, window: tuple[int, int]) -> None:
        with progress.current().section("data"):  # the hang watchdog allows the ranks' patience here
            self._prepare(window)

    def _prepare(self, window: tuple[int, int]) -> None:
        problem = ""
        try:
            self._fetch(window).result()
        except DataError as exc:
            problem = str(exc)
        self._decide(f"window {window[0]}.{window[1]}", problem)
        self._agreed.add(window)
        self.order.refresh()  # the sizes the encoding learned (here, not in the background thread: the order is not shared)

    def _decide(self, topic: str, problem: str) -> None:
        problems = distributed.agree(
            topic.replace(" ", "-"), problem, self.patience_s, waiting=f"waiting for every rank to have the shards of {topic}"
        )
        if problems:
            raise DataUnavailable(problems[0].split(": ", 1)[-1] if len(problems) == 1 else "; ".join(problems))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.data.close()
