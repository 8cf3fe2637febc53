"""`data.stream: true`: training straight from a source nobody prepared (a Hub dataset through
`datasets`' streaming, or raw .txt/.jsonl/.parquet files, local or in s3://), tokenized on the fly.

The source is cut into pieces exactly as `prepare` cuts it (a text file's byte ranges, a dataset's
data files), and each piece is encoded, when a shuffle window first needs it, into the same shard
format `prepare` writes, in the node's cache: by a background process of one of the node's ranks
(the ranks take a window's pieces in turn; a lock makes one of them encode each piece and the
others wait for it). The order is `GlobalOrder` over the pieces, whose sizes are learned as they
are encoded and saved in every checkpoint, so the data position is a window and an offset in it:
resuming, at any world size, encodes the current window again (or finds it in the cache), never
the stream from its start, and never a shuffle buffer's guess.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import shutil
import signal
import threading
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.data import shards, storage, stream_builds
from aura_hpc.data.cache import default_dir, file_lock
from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.packed import TokenReader
from aura_hpc.errors import DataError

log = logging.getLogger("aura_hpc")

STRIDE = 1 << 32  # a stream's sequence id: piece * STRIDE + sequence in the piece (stable before all sizes are known)


def tokenizer_folder(name: str) -> Path:
    """data.tokenizer: a tokenizer folder, or a prepared directory (its tokenizer/)."""
    p = Path(name).expanduser()
    for folder in (p, p / "tokenizer"):
        if (folder / "tokenizer.json").is_file():
            return folder.resolve()
    raise DataError(
        f"data.tokenizer {name!r} is not a tokenizer folder (no tokenizer.json) (fix: a prepared directory's tokenizer/, or "
        "a folder saved by transformers' save_pretrained)"
    )


def plan_pieces(d: Any) -> list[shards.Piece]:
    from aura_hpc.data.sources import TEXT_SUFFIXES, dataset_folder_files, dataset_shards, resolve_inputs

    piece_bytes = int(d.shard_mb * 2**20)
    if d.dataset:
        n = dataset_shards(d.dataset, d.dataset_subset or None, d.dataset_split, d.dataset_revision or None)
        # A local folder of many small data files: `datasets` reads several of them as one piece (see shards.Piece.files).
        # A Hub name's files are not sized without the network; its data files are large ones.
        if local := dataset_folder_files(d.dataset):
            n = min(n, max(1, -(-sum(f.stat().st_size for f in local) // max(1, piece_bytes))))
        return shards.plan([], TEXT_SUFFIXES, 0, d.dataset, False, n)
    if not d.path:
        raise DataError("data.stream needs a source (fix: --set data.path=s3://bucket/raw-text or local files, or data.dataset=NAME)")
    policy = storage.Policy(tries=d.read_tries, timeout_s=d.read_timeout_s)
    return shards.plan(resolve_inputs([d.path], keep_links=True), TEXT_SUFFIXES, piece_bytes, None, False, policy=policy, join_small=True)


# Slurm signals every process of the step (slurmstepd signals the whole container): SIGUSR2 ahead of the time
# limit killed each rank's encoder, and the rank, in the middle of a piece, ended with "the encoder died"
# (exit 74, the job over) instead of its checkpoint and requeue; SIGTERM (a cancel, a preemption) too, said as an
# out-of-memory kill. The rank decides; close() ends it with SIGKILL.
ENCODER_IGNORES = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT", "SIGTERM")  # close() kills it


def encoder_pool(local_world: int) -> ProcessPoolExecutor:
    """A rank's encoder process: its share of the node's cores (the Rust pool would take them all), deaf to stop signals."""
    return ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_encoder_started, initargs=(local_world,))


def _encoder_started(local_world: int) -> None:
    for name in ENCODER_IGNORES:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    shards.share_cores(local_world)


class StreamTokens(TokenReader):
    """The `PackedTokens` interface over a stream's pieces, encoded into the node's cache on demand."""

    remote = True  # its shards are fetched (encoded) before use: DataFeed manages them

    def __init__(self, d: Any, seq_len: int, local_rank: int = 0, local_world: int = 1) -> None:
        from aura_hpc.data.prepare import sha256_file
        from aura_hpc.data.tokenizer import STREAM_TOKENIZER_FIX, TOKENIZER_FILES, read_saved

        if not d.tokenizer:
            raise DataError(
                "data.stream needs data.tokenizer: the tokenizer the stream is encoded with (fix: --set data.tokenizer=DIR, "
                "e.g. a prepared directory of the same kind of text)"
            )
        tok_src = tokenizer_folder(d.tokenizer)
        tok = read_saved(tok_src, STREAM_TOKENIZER_FIX)
        self.seq_len, self.local_rank, self.local_world = seq_len, local_rank, local_world
        self.location, self.dataset = d.dataset or d.path, d.dataset
        self.pieces = plan_pieces(d)
        self.dtype = np.dtype(np.uint16 if tok.vocab_size <= 65536 else np.uint32)
        tok_sha = sha256_file(tok_src / "tokenizer.json")
        # Local files are named relative to their common folder: LAN nodes may keep their copies elsewhere.
        named = _portable(self.pieces)
        # "encoder": what a piece's tokens are (2: a document's end in both splits); another release's pieces are not these.
        key = {"pieces": [shards.piece_record(p) for p in named], "tokenizer": tok_sha, "val": d.val_fraction, "column": d.text_column}
        key["encoder"] = 2
        if d.dataset:  # c4's es/train, en/train and es/validation have the same pieces: not the same text
            key["dataset"] = [d.dataset_subset, d.dataset_split, *([d.dataset_revision] if d.dataset_revision else [])]
            key["objects"] = _folder_versions(d.dataset)
        else:
            key["objects"] = _object_versions(self.pieces)
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        root = Path(d.cache_dir).expanduser() if d.cache_dir else default_dir()
        self.build = root / "stream" / self.key[:16]
        self._held = stream_builds.hold(self.build)  # no other run removes it while this one reads it
        (self.build / "locks").mkdir(parents=True, exist_ok=True)
        self._tokenizer_dir = self.build / "tokenizer"
        with self._locked("tokenizer"):
            if not (self._tokenizer_dir / "tokenizer.json").is_file():
                tmp = self.build / ".tokenizer.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                # The tokenizer's files alone: data.tokenizer may be a model's snapshot, whose other weights (TF, Flax,
                # ONNX: gigabytes) were copied into every stream build on every node, counted against data.cache_gb.
                tmp.mkdir()
                for name in sorted(TOKENIZER_FILES):
                    if (tok_src / name).is_file():
                        shutil.copyfile(tok_src / name, tmp / name)
                tmp.rename(self._tokenizer_dir)
        if gone := stream_builds.forget_unused(self.build.parent, self.build, int(d.cache_gb * 2**30)):
            log.info("data.cache_gb: removed %d stream build(s) no run uses (%s)", len(gone), ", ".join(gone))
        self.manifest: dict[str, Any] = {
            "tokenizer": {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok_sha, "source": str(tok_src)},
            "dtype": self.dtype.name,
            "data_sha256": self.key,
            "stream": True,
        }
        self._job = dict(build=str(self.build), tokenizer_json=str(self._tokenizer_dir / "tokenizer.json"), eos_id=tok.eos_id,
                         dtype=self.dtype.name, val_fraction=d.val_fraction, text_column=d.text_column,
                         subset=d.dataset_subset or None, split=d.dataset_split, revision=d.dataset_revision or None,
                         read_tries=d.read_tries, read_timeout_s=d.read_timeout_s)  # fmt: skip
        self.cache_policy = storage.Policy(tries=d.read_tries, timeout_s=d.read_timeout_s)
        self.max_bytes = int(d.cache_gb * 2**30)
        self._sizes: dict[str, list[int]] = {"train": [-1] * len(self.pieces), "val": [-1] * len(self.pieces)}
        self.val_pieces: list[int] = []
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        for i, p in enumerate(self.pieces):  # pieces this node encoded before (an earlier attempt)
            record = shards.finished(self.build, p, 0, self.dtype.itemsize)
            if record is not None:
                self._learn(i, record)

    # ---- what the order and the feed ask ------------------------------------------------------
    def counts(self, split: str = "train") -> list[int]:
        return list(self._sizes[split]) if split == "train" else [self._sizes["val"][i] for i in self.val_pieces]

    def learn_counts(self, counts: list[int]) -> None:
        """Sizes saved in a checkpoint: positions before the current window need no encoding again."""
        for i, n in enumerate(counts[: len(self.pieces)]):
            if n >= 0 and self._sizes["train"][i] < 0:
                self._sizes["train"][i] = int(n)

    def _learn(self, i: int, record: dict[str, Any]) -> None:
        sizes = {split: max(0, (int(record[split]["tokens"]) - 1) // self.seq_len) for split in ("train", "val")}
        if 0 <= self._sizes["train"][i] != sizes["train"]:
            # Positions map to sequences through these sizes: taken in silence, samples were trained twice or never.
            if self.dataset:  # a Hub name without data.dataset_revision: its key holds no commit, a new run of it meets the old counts
                fix = (
                    "pin the commit the run started on, --set data.dataset_revision=COMMIT (the dataset's history on the Hub), "
                    "or stream a copy that does not change (`hf download --repo-type dataset NAME --local-dir DIR`, data.dataset=DIR)"
                )
            else:
                fix = f"the text as it was, then re-run to resume; or, for the new text, a new --run-name after removing {self.build}"
            raise DataError(
                f"piece {i} of {self.location} holds {sizes['train']} sequences, not the {self._sizes['train'][i]} counted before in "
                f"this run: its text changed under the run (a Hub dataset's new commit, a file edited) (fix: {fix})"
            )
        for split, n in sizes.items():
            self._sizes[split][i] = n

    def _locked(self, name: str) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.build / "locks" / f"{name}.lock")

    def _encode(self, i: int) -> None:
        """Piece i's shards in the node cache: found, or encoded by a background process of this rank."""
        piece = self.pieces[i]
        record = shards.finished(self.build, piece, 0, self.dtype.itemsize)
        if record is None:
            with self._locked(f"piece-{i}"):
                record = shards.finished(self.build, piece, 0, self.dtype.itemsize)  # another rank of this node made it meanwhile
                if record is None:
                    for stale in (self.build / shards.SHARDS).glob(f"*-{i:05d}.tmp*"):  # left by a killed encoder
                        stale.unlink(missing_ok=True)
                    try:
                        pending = self._encoder().submit(shards.encode, shards.Job(piece, **self._job))
                        # Not a blocking wait: close() must be able to end it. (A TimeoutError of the source's own,
                        # an NFS read's, would make `result(timeout=...)` spin: the future's state is asked instead.)
                        while not futures_wait([pending], timeout=0.2).done:
                            if self._closed:
                                raise DataError(f"stopped while encoding piece {i} of {self.location}")
                        record = pending.result()
                    except DataError:
                        raise
                    except (BrokenProcessPool, CancelledError):  # a pool of workers (multiprocessing's) waited forever
                        if self._closed:  # close() ended the encoder: not a death
                            raise DataError(f"stopped while encoding piece {i} of {self.location}") from None
                        self._close_encoder()
                        raise DataError(
                            f"the encoder of piece {i} of {self.location} died (killed: out of memory? see dmesg for oom-kill) "
                            "(fix: free the node's memory, then re-run to resume)"
                        ) from None
                    except Exception as exc:  # the source's own errors (network, a bad file)
                        said = (str(exc).splitlines() or [""])[0][:160]
                        raise DataError(
                            f"could not encode piece {i} of {self.location} ({type(exc).__name__}: {said}) "
                            "(fix: check the source, then re-run to resume)"
                        ) from None
        self._learn(i, record)

    def fetch(self, split: str, ids: list[int]) -> None:
        """Encode (or find) these pieces; train ids are piece indices, val ids index val_pieces.
        The node's ranks start at different pieces, so they encode a window side by side."""
        pieces = ids if split == "train" else [self.val_pieces[i] for i in ids]
        k = self.local_rank % max(1, len(pieces))
        for i in [*pieces[k:], *pieces[:k]]:
            self._encode(i)

    def fetch_validation(self, eval_sequences: int, first_window: list[int]) -> None:
        """The validation set: the val shards of the first window's pieces (of the first epoch)."""
        self.val_pieces = list(first_window)
        self.fetch("val", list(range(len(first_window))))

    def pin(self, split: str, keep: set[int]) -> None:
        for key in [k for k in self._maps if k[0] == split and k[1] not in keep]:
            del self._maps[key]
        if split == "train":
            self._evict(keep)

    def _evict(self, keep: set[int]) -> None:
        """data.cache_gb bounds the encoded pieces too (a stream of a large Hub dataset filled the node's disk): past it, the
        pieces encoded longest ago go first, never the window in use or the next one (`keep`) nor the validation pieces.
        One gone is encoded again if an epoch comes back to it; a rank still reading its memory map keeps the file's data."""
        folder = self.build / shards.SHARDS
        by_piece: dict[int, list[tuple[float, int, Path]]] = {}
        for f in folder.glob("*.bin"):
            try:
                st, piece = f.stat(), int(f.stem.rsplit("-", 1)[1])
            except (OSError, ValueError, IndexError):
                continue
            by_piece.setdefault(piece, []).append((st.st_mtime, st.st_size, f))
        used = sum(size for files in by_piece.values() for _, size, _ in files)
        protected = {*keep, *self.val_pieces}
        for piece in sorted(by_piece, key=lambda i: max(m for m, _, _ in by_piece[i])):
            if used <= self.max_bytes:
                return
            if piece in protected:
                continue
            with self._locked(f"piece-{piece}"):  # not while a rank of this node encodes it
                (self.build / shards.DONE / f"{piece:05d}.json").unlink(missing_ok=True)
                for _, size, f in by_piece[piece]:
                    f.unlink(missing_ok=True)
                    used -= size

    # ---- reading, as PackedTokens --------------------------------------------------------------
    def _map(self, split: str, piece: int) -> np.ndarray:
        m = self._maps.get((split, piece))
        if m is None:
            path = shards.shard_path(self.build, split, piece)
            for _ in range(3):  # a piece this node's cache let go (data.cache_gb: _evict) since it was sized is encoded again
                self._encode(piece)
                with self._locked(f"piece-{piece}"):  # mapped before any rank of this node can let it go again
                    if shards.finished(self.build, self.pieces[piece], 0, self.dtype.itemsize) is not None:
                        m = np.memmap(path, dtype=self.dtype, mode="r") if path.stat().st_size else np.zeros(0, self.dtype)
                        break
            else:
                raise DataError(f"piece {piece} of {self.location} keeps leaving the node's cache (fix: a larger data.cache_gb)")
            self._maps[split, piece] = m
        return m

    def locate(self, split: str, index: int) -> tuple[int, int]:
        if split == "train":
            return divmod(index, STRIDE)
        starts = np.concatenate([[0], np.cumsum(self.counts("val"))])
        j = int(np.searchsorted(starts, index, side="right")) - 1
        return self.val_pieces[j], index - int(starts[j])

    def num_sequences(self, split: str = "train") -> int:
        return int(sum(max(0, c) for c in self.counts(split)))

    @property
    def tokenizer_dir(self) -> Path:
        return self._tokenizer_dir

    def _encoder(self) -> ProcessPoolExecutor:
        """This rank's encoder process (made on first use; never after close(), which would leave it running)."""
        with self._pool_lock:
            if self._closed:
                raise DataError(f"stopped before encoding {self.location}")
            if self._pool is None:
                self._pool = encoder_pool(self.local_world)
            return self._pool

    def _close_encoder(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        # The piece in hand is not waited for: its process is killed (it ignores SIGTERM; Python 3.14's call, before it
        # its processes). What it wrote is named by its pid and removed by the next encoding of the piece.
        kill = getattr(pool, "kill_workers", None)
        if kill is not None:
            kill()
        else:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """The encoder ended. The build stays held until this process exits: the final checkpoint and sample read
        its tokenizer after the feed closes, and another run starting meanwhile took it for unused."""
        self._closed = True
        self._close_encoder()
        stream_builds.touch(self._held)

    def let_go(self) -> None:
        """The build no longer held (a process that goes on after its run: a notebook, a test)."""
        stream_builds.release(self._held)
        self._held = -1


class StreamOrder(GlobalOrder):
    """The global order over a stream's pieces: ids stay the same as more sizes become known."""

    def __init__(self, data: StreamTokens, seed: int, window: int) -> None:
        self.data = data
        super().__init__(data.counts("train"), seed, window or 4)

    def refresh(self) -> None:
        counts = self.data.counts("train")
        if counts != self.counts.tolist():
            self.learn(counts)

    def shard_ids(self, shard: int) -> np.ndarray:
        return shard * STRIDE + np.arange(max(0, int(self.counts[shard])))

    def _ids_are_positions(self) -> bool:
        # Ids are piece * STRIDE + j: a permutation of 0..n-1 would point past piece 0's end as soon as a
        # second piece exists (a stream of up to 4 pieces is one window by default). One piece keeps its order.
        return super()._ids_are_positions() and len(self.counts) == 1

    def state(self) -> dict[str, Any]:
        return {"piece_sequences": self.counts.tolist()}


def _portable(pieces: list[shards.Piece]) -> list[shards.Piece]:
    """The pieces with each local source named relative to the folder all of them share, and a local dataset
    folder by nothing (its files are in the key: _folder_versions)."""
    import dataclasses
    import os

    pieces = [dataclasses.replace(p, source="") if p.kind == "dataset" and Path(p.source).expanduser().is_dir() else p for p in pieces]
    local = {s for p in pieces if p.kind not in ("builtin", "dataset") for s in _sources(p) if not storage.is_remote(s)}
    if not local:
        return pieces
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in local])

    def named(source: str) -> str:
        return os.path.relpath(os.path.abspath(source), root) if source in local else source

    return [dataclasses.replace(p, source=named(p.source), files=tuple((named(f), n) for f, n in p.files)) for p in pieces]


def _sources(p: shards.Piece) -> list[str]:
    return [f for f, _ in p.files] or [p.source]


def _object_versions(pieces: list[shards.Piece]) -> list[list[Any]]:
    """What a changed file or object changes: an object's size and ETag; a local file's size and a
    digest of its content where it is read from (not its modification time: a LAN node with its own
    copy of the text has another mtime and the same data)."""
    out: list[list[Any]] = []
    listed: dict[str, tuple[int, str]] = {}
    for src in dict.fromkeys(s for p in pieces for s in _sources(p)):
        if storage.is_remote(src):
            if src not in listed:
                listed.update(storage.objects(src))
            out.append([src, *listed.get(src, (0, ""))])
        else:
            size = Path(src).stat().st_size
            out.append([Path(src).name, size, _sampled_digest(Path(src), size)])
    return out


def _folder_versions(dataset: str) -> list[list[Any]]:
    """A local dataset folder's files (none for a Hub name): relative name, size and a digest of a
    few 64 KB blocks (a folder of many large Parquet files is read for 256 KB a file, not 16 MB)."""
    from aura_hpc.data.sources import dataset_folder_files

    folder = Path(dataset).expanduser()
    out: list[list[Any]] = []
    for f in dataset_folder_files(dataset):
        size = f.stat().st_size
        out.append([f.relative_to(folder).as_posix(), size, _sampled_digest(f, size, 4, 1 << 16)])
    return out


def _sampled_digest(path: Path, size: int, samples: int = 16, block: int = 1 << 20) -> str:
    """sha256 of up to `samples` blocks spread over the file (all of it when small): a copy digests the
    same, an edit almost anywhere differs, and a 50 GB corpus costs 16 MB of reading."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= samples * block:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            for i in range(samples):
                f.seek((size - block) * i // (samples - 1))
                h.update(f.read(block))
    return h.hexdigest()
