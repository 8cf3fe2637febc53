"""Reading a prepared directory (a local folder or `s3://bucket/prefix`); the order the sequences are read in
is data/order.py's."""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.data import storage
from aura_hpc.data.manifest import check_manifest
from aura_hpc.data.prepare import prepare_hint, read_manifest
from aura_hpc.errors import DataError

OPEN_FILES_SPARE = 512  # descriptors left to everything else a rank opens (sockets, logs, checkpoints)
MAP_COUNT_CAP = 32768  # under the kernel's vm.max_map_count (65,530 by default), which every map also counts against
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
        # Each map holds a file descriptor: a directory of 1,100 shards stopped every rank at start-up with 'Too many
        # open files' under the common limit of 1,024. The limit is raised to what the system allows; local shards are
        # mapped at the start where they fit in it, else when read, the least recently read let go past it.
        self._maps: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._files: dict[tuple[str, int], tuple[int, ...]] = {}  # each local shard's file as checked at the start
        self._lock = threading.Lock()  # the data feed's fetch thread maps (object storage) beside the training thread
        self.max_mapped = open_files_allowed()
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
                    self._files[split, i] = _identity(f.stat())
            if sum(map(len, self.shards.values())) <= self.max_mapped:  # as before: every shard mapped where it lies
                for split, entries in self.shards.items():
                    for i in range(len(entries)):
                        self._map(split, i)
        self._starts = {split: np.concatenate([[0], np.cumsum(self.counts(split))]).astype(np.int64) for split in self.shards}
        self._tokenizer_dir: Path | None = None
        self._pinned: set[str] = set()

    def counts(self, split: str) -> list[int]:
        """Sequences per shard of `split`."""
        return [s.sequences(self.seq_len) for s in self.shards[split]]

    def url(self, shard: Shard) -> str:
        return storage.join(self.location, shard.file)

    def _map(self, split: str, i: int) -> np.ndarray:
        with self._lock:
            m = self._maps.get((split, i))
            if m is not None:
                self._maps.move_to_end((split, i))
                return m
        s = self.shards[split][i]
        if self.remote:  # held until `pin` lets it go: mapped again, its file could have left the cache (a download)
            local = self.cache.fetch(self.url(s), s.sha256, s.tokens * self.dtype.itemsize, keep=self._pinned)
            m = np.memmap(local, dtype=self.dtype, mode="r")
        else:
            m = self._map_local(split, i, s)
        with self._lock:
            self._maps[split, i] = m
            if not self.remote and len(self._maps) > self.max_mapped:
                self._maps.popitem(last=False)  # the least recently read: mapped again (a page-cache hit) when next read
        return m

    def _map_local(self, split: str, i: int, s: Shard) -> np.ndarray:
        """A shard of this directory, the file checked at the start or one of the same tokens: mapped when read, a
        prepare --force since then would have put other tokens under the manifest this run read."""
        f = self.path / s.file
        try:
            with open(f, "rb") as handle:
                now, then = _identity(os.fstat(handle.fileno())), self._files[split, i]
                # A chmod or chown changes the file's ctime alone; the same tokens written again (prepare --force of the same
                # inputs) are known by their hash, and hashed once. The older format has no hash: its file as it was.
                changed = now[:4] != then[:4] if not s.sha256 else now != then and _sha256(handle) != s.sha256
                if changed:
                    raise DataError(
                        f"{f} was replaced by other tokens while this run read {self.location} (a prepare --force?) "
                        "(fix: train on the new data as a new run, or prepare into another --out while a run reads it)"
                    )
                self._files[split, i] = now
                return np.memmap(handle, dtype=self.dtype, mode="r", shape=(s.tokens,))
        except OSError as exc:
            raise DataError(f"cannot read {f} ({exc.strerror or exc}) (fix: check that data.path is still there)") from None

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
            with self._lock:
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


def _sha256(handle: Any) -> str:
    import hashlib

    handle.seek(0)
    return hashlib.file_digest(handle, "sha256").hexdigest()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # An inode number alone is reused at once for the next file written (the replaced shard's own, often).
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def open_files_allowed() -> int:
    """How many shards a reader may keep mapped: the soft limit on open files raised to the hard one (as the system
    allows any process to), less what a rank needs besides, at least 256."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    except (ImportError, ValueError, OSError):  # Windows; a limit this process may not change
        return 256
    return max(256, min(MAP_COUNT_CAP, (1 << 20 if soft == resource.RLIM_INFINITY else soft) - OPEN_FILES_SPARE))
