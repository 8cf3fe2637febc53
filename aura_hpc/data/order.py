"""The deterministic global order of training sequences (the same batches for the same seed at any world size,
so that a resume sees exactly what the run would have seen), and where each rank's batch starts in it."""

from __future__ import annotations

from typing import Any

import numpy as np

from aura_hpc.errors import DataError


class NeedWindow(Exception):
    """A position read in a window whose shards are not encoded yet: a stream's window is made ready
    (train/loop/data_feed.py, asking `windows_ahead`) before any of its positions is read."""

    def __init__(self, window: tuple[int, int]) -> None:
        super().__init__(f"window {window} is not known yet")
        self.window = window


class GlobalOrder:
    """Sample order: global sample position p maps to one training sequence, the same for the same
    (seed, p) at any world size, so a resumed run sees exactly the batches it would have seen.

    Each epoch shuffles the sequences of `window` shards at a time: the shards in a seeded order,
    cut into windows, and the sequences of each window in a seeded permutation. With one window
    (window 0, or at least as many as there are shards) it is a permutation of all sequences; with
    smaller windows a node needs only the current window's shards (data in object storage), and the
    position is a window and an offset in it. A stream learns its shards' sizes as it encodes them
    (count -1 until then): `windows_ahead` names the first window to make before reading positions.
    """

    def __init__(self, counts: list[int] | int, seed: int, window: int = 0) -> None:
        counts = [counts] if isinstance(counts, int) else list(counts)
        self.seed = seed
        self.window = window if 0 < window < len(counts) else len(counts)
        self.learn(counts)

    def refresh(self) -> None:
        """Take the sizes the data learned since (a stream's encoding); every size is known here."""

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the order (a stream's sizes learned so far); None: nothing."""
        return None

    def learn(self, counts: list[int]) -> None:
        """Shard sizes (sequences; -1 = not known yet); what was computed from them is dropped."""
        self.counts = np.asarray(counts, dtype=np.int64)
        self.complete = bool((self.counts >= 0).all())
        self.n = int(self.counts.sum()) if self.complete else -1
        if self.complete and self.n <= 0:  # a stream learns it once its last piece is encoded
            raise DataError("the training split has no complete sequence (fix: more data or a smaller data.seq_len)")
        self.starts = np.concatenate([[0], np.cumsum(np.maximum(self.counts, 0))]).astype(np.int64)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def single(self) -> bool:
        return self.window >= len(self.counts)

    @property
    def windows_per_epoch(self) -> int:
        return -(-len(self.counts) // self.window)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard order and the first position of each of its windows (as far as known)."""
        got = self._epochs.get(epoch)
        if got is None:
            if len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
            n = len(self.counts)
            order = np.arange(n) if self.single else np.random.default_rng([self.seed, epoch, 0]).permutation(n)
            sizes = []
            for w in range(0, n, self.window):
                part = self.counts[order[w : w + self.window]]
                if (part < 0).any():
                    break  # this window and those after it: not known yet
                sizes.append(int(part.sum()))
            got = self._epochs[epoch] = (order, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        return got

    def window_shards(self, epoch: int, w: int) -> list[int]:
        order, _ = self._epoch(epoch)
        return [int(s) for s in order[w * self.window : (w + 1) * self.window]]

    def shard_ids(self, shard: int) -> np.ndarray:
        """The global ids of a shard's sequences (what `PackedTokens.locate` reads back)."""
        return np.arange(self.starts[shard], self.starts[shard + 1])

    def _ids_are_positions(self) -> bool:
        """One window whose sequence ids are 0..n-1: its order is the plain permutation of n."""
        return self.single and self.complete

    def _perm(self, epoch: int, w: int) -> np.ndarray:
        """Window w of the epoch, as the global sequence ids in their shuffled order."""
        got = self._perms.get((epoch, w))
        if got is None:
            if len(self._perms) > 3:
                self._perms.pop(min(self._perms))
            if self._ids_are_positions():  # the order of format-1 data and of runs before windows: kept exactly
                got = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                ids = np.concatenate([self.shard_ids(s) for s in self.window_shards(epoch, w)])
                got = ids[np.random.default_rng([self.seed, epoch, w + 1]).permutation(len(ids))]
            self._perms[epoch, w] = got
        return got

    def where(self, position: int) -> tuple[int, int, int]:
        """(epoch, window, offset in the window) of a global sample position."""
        epoch, off = divmod(position, self.n) if self.complete else (0, position)
        _, bounds = self._epoch(epoch)
        if off >= bounds[-1]:
            raise NeedWindow((epoch, len(bounds) - 1))
        w = int(np.searchsorted(bounds, off, side="right")) - 1
        return epoch, w, off - int(bounds[w])

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for p in range(start, start + count):
            epoch, w, off = self.where(p)
            out.append(int(self._perm(epoch, w)[off]))
        return out

    def windows_ahead(self, start: int, count: int) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
        """The (epoch, window) pairs positions [start, start+count) fall in, in order, as far as their shard sizes
        are known; and the first window whose sizes are not (a stream learns them by encoding it), None when
        every one is known."""
        known: list[tuple[int, int]] = []
        p = start
        while p < start + count:
            epoch, off = divmod(p, self.n) if self.complete else (0, p)
            _, bounds = self._epoch(epoch)
            if off >= bounds[-1]:
                return known, (epoch, len(bounds) - 1)
            w = int(np.searchsorted(bounds, off, side="right")) - 1
            known.append((epoch, w))
            p += int(bounds[w + 1]) - off
        return known, None

    def unknown_window(self, start: int, count: int) -> tuple[int, int] | None:
        """The first (epoch, window) of positions [start, start+count) whose shard sizes are not known yet."""
        return self.windows_ahead(start, count)[1]

    def windows_for(self, start: int, count: int) -> list[tuple[int, int]]:
        """The (epoch, window) pairs positions [start, start+count) fall in, in order (every one known)."""
        out: list[tuple[int, int]] = []
        p = start
        while p < start + count:
            epoch, w, off = self.where(p)
            out.append((epoch, w))
            _, bounds = self._epoch(epoch)
            p += int(bounds[w + 1] - bounds[w]) - off
        return out

    def next_window(self, epoch: int, w: int) -> tuple[int, int]:
        return (epoch, w + 1) if w + 1 < self.windows_per_epoch else (epoch + 1, 0)


def batch_start(step: int, micro: int, rank: int, world: int, batch: int, accum: int) -> int:
    """First global sample position of (step, micro-step, rank).

    Within a step, slot = micro * world + rank: 2 ranks x accum 1 and 1 rank x accum 2 read the
    same samples, which is what makes DDP and gradient accumulation equivalent.
    """
    per_step = batch * world * accum
    return step * per_step + (micro * world + rank) * batch
