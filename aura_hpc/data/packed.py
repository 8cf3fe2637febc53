"""Reading a prepared directory (a local folder or `s3://bucket/prefix`), and the deterministic
global order of training sequences."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.data import storage
from aura_hpc.data.manifest import check_manifest
from aura_hpc.data.prepare import prepare_hint, read_manifest
from aura_hpc.errors import DataError

_TOKENIZER_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class Shard:
    split: str
    file: str
    tokens: int
    sha256: str

    def sequences(self, seq_len: int) -> int:
        return max(0, (self.tokens - 1) // seq_len)


def eval_set(n_val: int, wanted: int) -> list[int]:
    """The validation sequences an evaluation reads: `wanted` of the split's `n_val`, evenly spaced over it.
    The split is numbered shard after shard, in the inputs' order: its first N were the first input file's
    alone (of news, Wikipedia and forums, eval_loss measured the news)."""
    n = min(n_val, wanted)
    return [k * n_val // n for k in range(n)] if n else []


class TokenReader:
    """What the trainer reads, whatever holds the tokens (a prepared directory, local or in object
    storage; a stream encoded as it trains): sequences by global index (via `locate` and `_map`,
    which a subclass provides), the tokenizer's facts from the manifest, and what the data feed
    (train/loop/data_feed.py) asks of a source whose shards must be made local before use."""

    seq_len: int
    manifest: dict[str, Any]
    remote = False  # shards are fetched (or encoded) before use: the data feed makes each window local first

    def locate(self, split: str, index: int) -> tuple[int, int]:
        raise NotImplementedError

    def num_sequences(self, split: str = "train") -> int:
        raise NotImplementedError

    def fetch(self, split: str, shard_ids: list[int]) -> None:
        """Make these shards local (a no-op for local data)."""

    def fetch_validation(self, eval_sequences: int, first_window: list[int]) -> None:
        """Make the validation set evaluation reads local: `eval_set` of `eval_sequences` (a stream's
        validation text comes from the shards of its first window)."""
        picked = eval_set(self.num_sequences("val"), eval_sequences)
        self.fetch("val", sorted({self.locate("val", i)[0] for i in picked}))

    def pin(self, split: str, keep: set[int]) -> None:
        """Only these shards of `split` are needed now (the others may leave the cache)."""

    def learn_counts(self, counts: list[int]) -> None:
        """Sequences per shard that a checkpoint learned (a stream's sizes); known already otherwise."""

    def close(self) -> None:
        """Stop background work (a stream's encoders)."""

    def _map(self, split: str, shard: int) -> np.ndarray:
        raise NotImplementedError

    def sequences(self, split: str, indices: list[int]) -> np.ndarray:
        """A (len(indices), seq_len+1) int64 array: inputs are [:, :-1], targets [:, 1:]."""
        t = self.seq_len
        out = np.empty((len(indices), t + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            shard, local = self.locate(split, i)
            out[row] = self._map(split, shard)[local * t : local * t + t + 1]
        # A token id past the vocabulary (a damaged shard; a bucket's shard and manifest that agree with each other
        # only) stopped a GPU with a device-side assert in the embedding, the batch unnamed. A host read of
        # a few thousand ids, next to the copy this batch makes anyway.
        if out.size and (int(out.max()) >= self.vocab_size or int(out.min()) < 0):
            bad = int(out.max()) if int(out.max()) >= self.vocab_size else int(out.min())
            raise DataError(
                f"the {split} data holds token id {bad}, outside the tokenizer's {self.vocab_size} (a damaged or foreign shard "
                f"of {self.describe_shard(split, indices)}) (fix: prepare the data again with --force)"
            )
        return out

    def describe_shard(self, split: str, indices: list[int]) -> str:
        shards = sorted({self.locate(split, i)[0] for i in indices})
        return f"{split} shard(s) {', '.join(map(str, shards[:3]))}"

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])


class PackedTokens(TokenReader):
    """Train/val token streams cut into sequences of seq_len+1 tokens.

    A prepared directory holds shards (format 2: `shards/train-00000.bin`, ... listed in the
    manifest) or one file per split (format 1: `train.bin`, `val.bin`). Each shard is cut into
    sequences on its own (the few tokens at a shard's end that do not fill one are left out), and a
    split's sequences are numbered shard after shard. A local shard is memory-mapped where it lies;
    a shard in object storage is first fetched into the node's cache (`cache`), when first read.
    """

    def __init__(self, path: str | Path, seq_len: int, cache: Any = None) -> None:
        self.location = str(path)
        self.remote = storage.is_remote(self.location)
        self.path = Path(path) if not self.remote else Path(storage.strip(self.location))
        self.cache = cache
        policy = cache.policy if cache is not None else storage.Policy()
        if self.remote:
            storage.check_url(self.location)
            if cache is None:
                raise DataError("reading s3:// data needs a cache (internal: pass a ShardCache)")
            manifest = storage.read_manifest(self.location, policy)
            hint = f"python -m aura_hpc prepare YOUR_TEXT --out {self.location}"
        else:
            manifest = read_manifest(self.path)
            hint = prepare_hint(self.path)
        if manifest is None:
            if self.remote and not storage.listing(self.location.rstrip("/") + "/", policy):
                raise DataError(f"data.path {self.location!r} does not exist: nothing is stored there (fix: {hint}, or correct it)")
            raise DataError(f"data.path {self.location!r} is not a prepared directory (no manifest.json) (fix: {hint})")
        self.manifest: dict[str, Any] = check_manifest(manifest, storage.join(self.location, "manifest.json"))
        self.seq_len = seq_len
        self.dtype = np.dtype(manifest["dtype"])
        if self.remote and not manifest.get("shards"):
            # The one-file format of older releases names no sha256 to fetch by: it set up, then stopped at the first
            # window as storage that does not answer (exit 74, "run again once it answers"), which never helps.
            raise DataError(f"data.path {self.location!r} is in an older release's format, read locally only (fix: {hint} --force)")
        listed = manifest.get("shards") or [
            {"split": split, "file": f"{split}.bin", "tokens": manifest[f"{split}_tokens"], "sha256": ""} for split in ("train", "val")
        ]
        self.shards: dict[str, list[Shard]] = {"train": [], "val": []}
        for entry in listed:
            shard = Shard(entry["split"], entry["file"], entry["tokens"], entry["sha256"])
            if shard.tokens:
                self.shards[shard.split].append(shard)
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        if not self.remote:
            _check_tokenizer(self.path / "tokenizer" / "tokenizer.json", self.manifest["tokenizer"]["sha256"])
            for split, entries in self.shards.items():
                for i, s in enumerate(entries):
                    f = self.path / s.file
                    size = f.stat().st_size if f.exists() else -1
                    if size != s.tokens * self.dtype.itemsize:
                        raise DataError(
                            f"{f} holds {max(size, 0) // self.dtype.itemsize} tokens but the manifest says {s.tokens} "
                            "(fix: re-run prepare with --force)"
                        )
                    self._maps[split, i] = np.memmap(f, dtype=self.dtype, mode="r")
        self._starts = {split: np.concatenate([[0], np.cumsum(self.counts(split))]).astype(np.int64) for split in self.shards}
        self._tokenizer_dir: Path | None = None
        self._pinned: set[str] = set()

    def counts(self, split: str) -> list[int]:
        """Sequences per shard of `split`."""
        return [s.sequences(self.seq_len) for s in self.shards[split]]

    def url(self, shard: Shard) -> str:
        return storage.join(self.location, shard.file)

    def _map(self, split: str, i: int) -> np.ndarray:
        m = self._maps.get((split, i))
        if m is None:
            s = self.shards[split][i]
            local = self.cache.fetch(self.url(s), s.sha256, s.tokens * self.dtype.itemsize, keep=self._pinned)
            m = self._maps[split, i] = np.memmap(local, dtype=self.dtype, mode="r")
        return m

    def fetch(self, split: str, shard_ids: list[int]) -> None:
        """Make these shards local (a no-op for a local directory): the prefetch of what comes next."""
        if self.remote:
            for i in shard_ids:
                self._map(split, i)

    def pin(self, split: str, keep: set[int]) -> None:
        """Only these shards of `split` are needed now: the others' mappings go, and the cache may
        evict their files (never these) to make room."""
        if self.remote:
            self._pinned = {self.shards[split][i].sha256 for i in keep}
            for key in [k for k in self._maps if k[0] == split and k[1] not in keep]:
                del self._maps[key]

    @property
    def splits(self) -> dict[str, np.ndarray]:
        """Each split's tokens as one array (a copy when there are several shards: for small data and tests)."""
        out = {}
        for s, entries in self.shards.items():
            parts = [self._map(s, i) for i in range(len(entries))]
            out[s] = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        return out

    @property
    def tokenizer_dir(self) -> Path:
        if not self.remote:
            return self.path / "tokenizer"
        if self._tokenizer_dir is None:
            self._tokenizer_dir = self._fetch_tokenizer()
        return self._tokenizer_dir

    def _fetch_tokenizer(self) -> Path:
        """The tokenizer folder, downloaded once into the cache (checked against the manifest's hash)."""
        import os
        import shutil

        sha = self.manifest["tokenizer"]["sha256"]  # 64 hex digits (check_manifest): a name inside the cache
        folder = self.cache.root / f"tokenizer-{sha[:16]}"
        if (folder / "tokenizer.json").is_file():
            return folder
        policy = self.cache.policy
        prefix = storage.join(self.location, "tokenizer")
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            for url in storage.listing(prefix, policy):
                name = url.rsplit("/", 1)[1]
                if _TOKENIZER_FILE.fullmatch(name) and url == storage.join(prefix, name):
                    storage.download(url, tmp / name, policy)
            from aura_hpc.data.prepare import sha256_file

            if not (tmp / "tokenizer.json").is_file() or sha256_file(tmp / "tokenizer.json") != sha:
                raise DataError(
                    f"{prefix}/tokenizer.json is missing or does not match the manifest (fix: prepare the data again with --force)"
                )
            try:
                tmp.rename(folder)
            except OSError:  # another rank of this node put it there first
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return folder

    def num_sequences(self, split: str = "train") -> int:
        return int(self._starts[split][-1])

    def locate(self, split: str, index: int) -> tuple[int, int]:
        """(shard, sequence within the shard) of a split's sequence `index`."""
        starts = self._starts[split]
        shard = int(np.searchsorted(starts, index, side="right")) - 1
        return shard, index - int(starts[shard])


def _check_tokenizer(path: Path, sha: str) -> None:
    """A prepared folder copied in part (an rsync cut short) trained a whole run, then stopped at its last
    sample without a summary, and its checkpoints held no tokenizer: the one the manifest hashes, or nothing."""
    from aura_hpc.data.prepare import sha256_file

    try:
        ours = sha256_file(path)
    except OSError as exc:
        raise DataError(
            f"{path} cannot be read ({exc.strerror}): the prepared directory is incomplete (fix: copy the whole prepared "
            "directory again, or prepare the data again with --force)"
        ) from None
    if ours != sha:
        raise DataError(
            f"{path} does not match the manifest (fix: copy the whole prepared directory again, or prepare the data again with --force)"
        )


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
