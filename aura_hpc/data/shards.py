"""Sharded, parallel encoding for `prepare`: the input cut into pieces, each piece encoded on its own (by one of `--workers` processes, or
one task of a Slurm array) into one train and one validation shard, and a manifest over all of them.

The pieces depend only on the input and --shard-mb (a text file is cut into byte ranges at blank lines, else line ends, else before a
space or a character; a JSON-lines file at line ends; a Parquet or JSON file is one piece; a Hub dataset or the built-in corpus is one),
and a piece's tokens depend only on the piece and the tokenizer, so the same input gives the same shards whatever the number of workers.
A shard is written under a temporary name and renamed, and a piece counts as done only once both its shards and its record are in place:
a build that stopped (a killed worker, a failed array task) keeps its finished pieces, and a re-run redoes only the others. Nothing is
trained on before the manifest exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.data import storage
from aura_hpc.errors import DataError

SHARDS = "shards"
DONE = "done"  # a piece's record, written after its shards: the piece is complete
_BATCH_CHARS = 1 << 20  # text per encode_batch call: big enough for the Rust thread pool to pay off


@dataclass(frozen=True)
class Piece:
    index: int
    source: str  # a file path, a dataset name, or "builtin"
    kind: str  # text | json | jsonl | parquet | dataset | builtin
    start: int = 0  # byte range of a text or JSON-lines file
    end: int = -1
    last: bool = True  # the file's last piece: its last paragraph ends a document
    # A stream's consecutive small files of one kind as one piece of up to piece_bytes, as (source, size); `source` the first. Each
    # a piece of its own dropped its tail shorter than a sequence: 1 KB articles at seq_len 1024 trained on almost nothing.
    files: tuple[tuple[str, int], ...] = ()


def piece_record(p: Piece) -> dict[str, Any]:
    """A piece as its record and a stream's key hold it (JSON's types). `files` only where set: a piece of one file is
    recorded as before it existed, so the pieces and streams an earlier release encoded are still found."""
    out = asdict(p) | {"files": [list(f) for f in p.files]}
    return out if p.files else {k: v for k, v in out.items() if k != "files"}


def _size(source: str) -> int:
    return storage.size(source) if storage.is_remote(source) else Path(source).stat().st_size


def read_range(source: str, start: int, end: int, policy: storage.Policy | None = None) -> bytes:
    """Bytes [start, end) of a local file or an object (one ranged GET, retried as `policy` says:
    data.read_tries and data.read_timeout_s)."""
    if storage.is_remote(source):
        return storage.read_bytes(source, policy or storage.Policy(), start, end) if end > start else b""
    with open(source, "rb") as f:
        f.seek(start)
        return f.read(end - start)


_BLANK_LINE = re.compile(rb"\n\r?\n")  # a paragraph's end, in a file with Windows line ends (CRLF) too
_LINE_END = re.compile(rb"\n")
_LONGEST_SEPARATOR = 3  # a window reads this far past its end: a separator across two windows is found whole


_PARAGRAPH_PATIENCE = 1 << 20  # no blank line within this of a cut: the text is cut at a line end
# A text with no line end near a cut either (a dump without newlines) is cut before a space, as `bounded` cuts a
# long line, and with none of those, before a character's first byte: else one piece, read whole into memory.
_SPACE = re.compile(rb" ")
_CHAR_START = re.compile(rb"[\x00-\x7f\xc0-\xff]")  # not a UTF-8 continuation byte
_FALLBACK = {_BLANK_LINE: _LINE_END, _LINE_END: _SPACE, _SPACE: _CHAR_START}


def _cut(source: str, piece_bytes: int, separator: re.Pattern[bytes], policy: storage.Policy | None = None) -> list[tuple[int, int]]:
    """Byte ranges of about piece_bytes (up to 1 MiB more), each ending just after a separator, before a space or
    a character (_FALLBACK), or at the end. Text with no blank line near a cut (one document per line) is cut at a
    line end: it was one piece of the whole file, read whole into one encoder's memory, by every rank, 64 KiB at a
    time. JSON lines are cut at line ends only."""
    text, piece_bytes = separator is _BLANK_LINE, max(piece_bytes, 1)  # 0 (a --shard-mb under a byte) cut nowhere
    size = _size(source)
    if size <= piece_bytes:
        return [(0, size)]
    ranges, start = [], 0
    while start < size:
        nominal = start + piece_bytes
        if nominal >= size:
            ranges.append((start, size))
            break
        end, at, wanted = size, nominal, separator
        while at < size:  # read on until a separator appears
            window = read_range(source, at, min(size, at + (1 << 16) + _LONGEST_SEPARATOR), policy)
            found = wanted.search(window)
            if found is not None:
                end = at + (found.end() if wanted in (_BLANK_LINE, _LINE_END) else found.start())  # a space starts the next
                break
            at += 1 << 16
            if at - nominal >= _PARAGRAPH_PATIENCE and wanted in _FALLBACK and (text or wanted is not _LINE_END):
                wanted, at = _FALLBACK[wanted], nominal
        ranges.append((start, end))
        start = end
    return ranges


def plan(
    files: list[Any],
    kinds: dict[str, str],
    piece_bytes: int,
    dataset: str | None,
    builtin: bool,
    dataset_pieces: int = 1,
    policy: storage.Policy | None = None,
    join_small: bool = False,
) -> list[Piece]:
    """The pieces of the input; with `join_small` (a stream), see Piece.files."""
    if builtin:
        return [Piece(0, "builtin", "builtin")]
    if dataset:  # `dataset_pieces` runs of the dataset's files (datasets' shard(n, i)): one per file of a Hub dataset
        n = dataset_pieces or 1
        return [Piece(i, dataset, "dataset", i, n, True) for i in range(n)]
    pieces: list[Piece] = []
    group: list[Piece] = []  # whole small files not yet a piece (join_small), of group_bytes[0] bytes
    group_bytes = [0]  # kept as it grows: summed anew at each file, 20,000 small files took 5 s to plan

    def close_group() -> None:
        if len(group) == 1:
            pieces.append(replace(group[0], index=len(pieces)))
        elif group:
            files = tuple((g.source, g.end) for g in group)
            pieces.append(Piece(len(pieces), group[0].source, group[0].kind, 0, group[0].end, True, files))
        group.clear()
        group_bytes[0] = 0

    for f in map(str, files):
        suffix = os.path.splitext(f.rsplit("/", 1)[-1])[1].lower()
        kind = kinds[suffix]
        if kind == "text" or (kind == "json" and suffix == ".jsonl"):
            kind = "text" if kind == "text" else "jsonl"
            ranges = _cut(f, piece_bytes, _BLANK_LINE if kind == "text" else _LINE_END, policy)
            if join_small and len(ranges) == 1:
                if group and (group[0].kind != kind or group_bytes[0] + ranges[0][1] > piece_bytes):
                    close_group()
                group.append(Piece(-1, f, kind, 0, ranges[0][1], True))
                group_bytes[0] += ranges[0][1]
                continue
            close_group()
            for i, (a, b) in enumerate(ranges):
                pieces.append(Piece(len(pieces), f, kind, a, b, i == len(ranges) - 1))
        else:
            close_group()
            pieces.append(Piece(len(pieces), f, kind))
    close_group()
    return pieces


@dataclass
class Job:
    """What one encoder needs: picklable, for a worker process or a Slurm task."""

    piece: Piece
    build: str  # the build directory
    tokenizer_json: str
    eos_id: int
    dtype: str
    val_fraction: float
    text_column: str
    subset: str | None = None
    split: str = "train"
    max_tokens: int = 0  # > 0: stop this piece there (a token budget's last piece)
    read_tries: int = 0  # how an object's bytes are read (data.read_tries, data.read_timeout_s); 0: storage's defaults
    read_timeout_s: float = 0.0
    revision: str | None = None  # a Hub dataset's pinned commit (data.dataset_revision, prepare --revision)

    def policy(self) -> storage.Policy | None:
        return storage.Policy(tries=self.read_tries, timeout_s=self.read_timeout_s) if self.read_tries > 0 else None


def head_of(p: Piece, nbytes: int, policy: storage.Policy | None = None) -> Piece:
    """The first ~`nbytes` of a text or JSON-lines piece, up to a line end: what a tokenizer sample of that much
    reads (the whole piece was read, so a 256 MB sample of a 500 GB corpus read all of it, objects downloaded)."""
    if p.files or p.kind not in ("text", "jsonl") or p.end - p.start <= nbytes:
        return p
    stop = p.start + nbytes
    window = read_range(p.source, max(p.start, stop - 65536), stop, policy)
    end = window.rfind(b"\n") + 1  # after a line end; in text without one, before a space or a character, as _cut
    if end == 0 and p.kind == "text":
        end = max(window.rfind(b" "), 0) or next((i for i in range(len(window) - 1, 0, -1) if not 0x80 <= window[i] < 0xC0), 0)
    if end <= 0:  # one JSON row longer than the window: the whole piece
        return p
    return replace(p, end=stop - len(window) + end, last=False)


def piece_texts(job: Job) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of a piece, in order."""
    from aura_hpc.data.sources import bounded, check_column, check_text, records, row_text, split_paragraphs

    def document(text: str) -> Iterator[tuple[str, bool]]:  # one row's text; a huge one in pieces cut before a space
        pieces = bounded(text)
        for i, piece in enumerate(pieces):
            yield piece, i == len(pieces) - 1

    p = job.piece
    if p.files:
        for source, size in p.files:
            yield from piece_texts(replace(job, piece=Piece(p.index, source, p.kind, 0, size, True)))
        return
    if p.kind == "builtin":
        from aura_hpc.data.corpus import generate

        for para in split_paragraphs(generate()):
            yield para, False
        yield "", True
        return
    if p.kind == "dataset":
        for text in records("", None, p.source, job.subset, job.split, job.text_column, p.source, (p.start, p.end), job.revision):
            yield from document(text)
        return
    if p.kind in ("text", "jsonl"):
        raw = read_range(p.source, p.start, p.end, job.policy())
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            # A UTF-16 file (Windows' "Unicode", Excel's "Unicode text") starts with its byte-order mark: told to read it
            # as WINDOWS-1252, the copy held NUL bytes and was refused again.
            head = raw[:2] if p.start == 0 else read_range(p.source, 0, 2, job.policy())
            source = "UTF-16" if head in (b"\xff\xfe", b"\xfe\xff") else "WINDOWS-1252"
            raise DataError(
                f"{p.source} is not UTF-8 text ({exc.reason} at byte {p.start + exc.start}) (fix: convert a copy, e.g. "
                f"iconv -f {source} -t UTF-8 {p.source} > utf8/{os.path.basename(p.source)}, and prepare that)"
            ) from None
        if p.start == 0:  # a byte-order mark (PowerShell, Excel, Notepad): not text to train on, nor JSON
            text = text.removeprefix("\ufeff")
        check_text(p.source, text)
        if p.kind == "text":
            paras = split_paragraphs(text)
            for i, para in enumerate(paras):
                yield para, p.last and i == len(paras) - 1
            return
        first = p.start == 0  # a file's first row, whichever piece of all the inputs it starts
        at = 0  # characters into the piece: a line that is not JSON is named by its byte
        # Rows end at "\n" alone: str.splitlines() also ends them at U+2028, U+2029 and U+0085, which JSON
        # writers leave unescaped inside strings (scraped text, cp1252 read as latin-1).
        for line in text.split("\n"):
            start, at = at, at + len(line) + 1
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    byte = p.start + len(text[:start].encode("utf-8"))
                    raise DataError(
                        f"{p.source}: the line at byte {byte} is not JSON ({exc.msg}) (fix: one JSON object per line)"
                    ) from None
                if first and (not isinstance(row, dict) or job.text_column not in row):
                    keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
                    raise DataError(
                        f"column {job.text_column!r} not in {p.source!r}; its columns are {keys} (fix: --text-column NAME, or "
                        "if it is no data (metadata beside the corpus), move it out of the folder or pass the data files by a glob)"
                    )
                value = row.get(job.text_column) if isinstance(row, dict) else None
                if first:
                    check_column(p.source, job.text_column, value)
                first = False
                if isinstance(value, str) and (value := row_text(value)).strip():
                    yield from document(value)
        return
    local = p.source
    if storage.is_remote(p.source):  # a Parquet or JSON object: read whole, from a local copy
        local = str(input_copy(job))
        # The tokenizer's sample downloaded it already (the encoding downloaded it again: twice the egress).
        if not (os.path.isfile(local) and os.path.getsize(local) == storage.size(p.source, job.policy() or storage.Policy())):
            Path(local).parent.mkdir(parents=True, exist_ok=True)
            part = f"{local}.part{os.getpid()}"  # whole or not there: a killed download is no copy
            storage.download(p.source, part, job.policy() or storage.Policy())
            os.replace(part, local)
    for text in records(p.kind, [local], None, None, "train", job.text_column, p.source):
        yield from document(text)


def input_copy(job: Job) -> Path:
    """Where a Parquet or JSON object is copied to be read (records() reads local files)."""
    return Path(job.build or ".") / "inputs" / f"{job.piece.index:05d}{os.path.splitext(job.piece.source)[1]}"


def is_val(i: int, fraction: float) -> bool:
    """Every ~1/fraction-th unit, spread evenly."""
    return int((i + 1) * fraction) > int(i * fraction)


def shard_path(build: Path, split: str, index: int) -> Path:
    return build / SHARDS / f"{split}-{index:05d}.bin"


def encode(job: Job) -> dict[str, Any]:
    """Encode one piece into its two shards; returns (and records) their token counts and hashes."""
    from tokenizers import Tokenizer

    build, p = Path(job.build), job.piece
    tok = Tokenizer.from_file(job.tokenizer_json)
    dtype = np.dtype(job.dtype)
    (build / SHARDS).mkdir(parents=True, exist_ok=True)
    (build / DONE).mkdir(parents=True, exist_ok=True)
    tmp = {s: shard_path(build, s, p.index).with_suffix(f".tmp{os.getpid()}") for s in ("train", "val")}
    counts, hashes = {"train": 0, "val": 0}, {"train": hashlib.sha256(), "val": hashlib.sha256()}
    unit = p.index * 7919  # a piece-dependent start: validation units spread over the pieces
    full = False
    # A split holds tokens of a document not yet closed by an end-of-text token: the document's end closes it in every
    # split it reached (on the last unit's alone, a document whose last paragraph went to validation ran into the next
    # one in train, without a separator).
    open_doc = {"train": False, "val": False}
    with open(tmp["train"], "wb") as f_train, open(tmp["val"], "wb") as f_val:
        sinks = {"train": f_train, "val": f_val}
        batch: list[tuple[str, bool]] = []
        chars = 0

        def flush() -> bool:
            nonlocal unit
            encs = tok.encode_batch([t for t, _ in batch], add_special_tokens=False)
            out: dict[str, list[int]] = {"train": [], "val": []}
            for (_, ends), enc in zip(batch, encs, strict=True):
                split = "val" if is_val(unit, job.val_fraction) else "train"
                unit += 1
                adds = [(split, list(enc.ids) + ([job.eos_id] if ends else []))]
                open_doc[split] = open_doc[split] or bool(enc.ids)
                if ends:
                    other = "train" if split == "val" else "val"
                    if open_doc[other]:
                        adds.append((other, [job.eos_id]))
                    open_doc.update(train=False, val=False)
                for into, ids in adds:
                    if job.max_tokens:
                        room = job.max_tokens - counts["train"] - counts["val"] - len(out["train"]) - len(out["val"])
                        if room <= len(ids):
                            out[into].extend(ids[:room])
                            _write(out, sinks, hashes, counts, dtype)
                            return True
                    out[into].extend(ids)
            _write(out, sinks, hashes, counts, dtype)
            return False

        for text, ends in piece_texts(job):
            batch.append((text, ends))
            chars += len(text)
            if chars >= _BATCH_CHARS:
                full = flush()
                batch, chars = [], 0
                if full:
                    break
        if batch and not full:
            full = flush()
    record: dict[str, Any] = {"piece": piece_record(p), "max_tokens": job.max_tokens, "full": full}
    for s in ("train", "val"):
        with open(tmp[s], "rb") as f:
            os.fsync(f.fileno())
        tmp[s].replace(shard_path(build, s, p.index))
        record[s] = {"file": f"{SHARDS}/{shard_path(build, s, p.index).name}", "tokens": counts[s], "sha256": hashes[s].hexdigest()}
    done = build / DONE / f"{p.index:05d}.json"
    done.with_suffix(".tmp").write_text(json.dumps(record))
    done.with_suffix(".tmp").replace(done)
    if storage.is_remote(p.source) and p.kind not in ("text", "jsonl"):
        input_copy(job).unlink(missing_ok=True)  # encoded: a corpus of objects is not kept whole on local disk
    return record


def _write(out: dict[str, list[int]], sinks: dict[str, Any], hashes: dict[str, Any], counts: dict[str, int], dtype: np.dtype) -> None:
    for split, ids in out.items():
        if ids:
            data = np.array(ids, dtype=dtype).tobytes()
            sinks[split].write(data)
            hashes[split].update(data)
            counts[split] += len(ids)
        ids.clear()


def finished(build: Path, piece: Piece, max_tokens: int, itemsize: int) -> dict[str, Any] | None:
    """A piece's record when its shards are complete (sizes as recorded: `itemsize` bytes a token), for
    the same piece and budget; None otherwise (a shard cut short by a crash or a full disk is encoded again)."""
    try:
        record: dict[str, Any] = json.loads((build / DONE / f"{piece.index:05d}.json").read_text())
    except (OSError, ValueError):
        return None
    if record.get("piece") != piece_record(piece) or record.get("max_tokens") != max_tokens:
        return None
    for s in ("train", "val"):
        try:
            f = build / SHARDS / Path(str(record[s]["file"])).name
            if f.stat().st_size != int(record[s]["tokens"]) * itemsize:
                return None
        except (OSError, KeyError, TypeError, ValueError):
            return None
    return record


def encode_all(jobs: list[Job], workers: int, budget: int) -> list[dict[str, Any]]:
    """Every piece not already done, by `workers` processes. With a token budget the pieces go in
    order, `workers` at a time, and encoding stops at the piece that reaches it (that one is
    encoded again up to the budget): a small budget over a huge corpus reads only its start."""
    out: list[dict[str, Any]] = []
    used, wave = 0, (max(1, workers) if budget else len(jobs))
    for at in range(0, len(jobs), wave):
        # Each piece of a wave stops at what is left of the budget: the first wave was encoded whole (8 workers,
        # 8 whole data files of a Hub dataset for a budget the first one's start covers), then again, cut.
        group = [replace(job, max_tokens=budget - used) if budget else job for job in jobs[at : at + wave]]
        for job, record in zip(group, _encode_group(group, workers), strict=True):
            n = record["train"]["tokens"] + record["val"]["tokens"]
            if budget and used + n >= budget:
                if used + n > budget or not record.get("full"):
                    record = encode(Job(**{**asdict(job), "piece": job.piece, "max_tokens": budget - used}))
                out.append(record)
                return out
            used += n
            out.append(record)
    return out


def _encode_group(jobs: list[Job], workers: int) -> list[dict[str, Any]]:
    """The records of these pieces: finished ones as found, the others encoded now."""
    if not jobs:
        return []
    build = Path(jobs[0].build)
    records: list[dict[str, Any] | None] = [finished(build, j.piece, j.max_tokens, np.dtype(j.dtype).itemsize) for j in jobs]
    todo = [j for j, r in zip(jobs, records, strict=True) if r is None]
    if workers > 1 and len(todo) > 1:
        import multiprocessing as mp

        # Spawned, not forked: the tokenizer's Rust thread pool already ran in this process.
        with mp.get_context("spawn").Pool(min(workers, len(todo)), initializer=share_cores, initargs=(workers,)) as pool:
            fresh = iter(pool.imap(encode, todo))
            return [r if r is not None else next(fresh) for r in records]
    return [r if r is not None else encode(j) for j, r in zip(jobs, records, strict=True)]


def share_cores(workers: int) -> None:
    """Each worker's tokenizer threads: the cores shared out (the Rust pool would take them all)."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    os.environ["TOKENIZERS_PARALLELISM"] = "true"


def shard_list(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's shards, in piece order, empty ones left out."""
    return [
        {"split": s, "file": r[s]["file"], "tokens": r[s]["tokens"], "sha256": r[s]["sha256"]}
        for r in records
        for s in ("train", "val")
        if r[s]["tokens"] > 0
    ]
