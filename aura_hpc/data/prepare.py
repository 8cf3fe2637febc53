"""`python -m aura_hpc prepare`: text in, a shareable prepared directory out.

Layout of a prepared directory (copy it, or put it on NFS for all nodes):
    train.bin, val.bin   packed token ids (uint16 when the vocabulary fits, else uint32)
    tokenizer/           a transformers-loadable tokenizer folder
    manifest.json        written last: sources, token counts, dtype, tokenizer hash
The directory is built under a temporary name and renamed into place, so a half-written
prepare never looks complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.data import out_dir
from aura_hpc.data.tokenizer import load_tokenizer, train_tokenizer
from aura_hpc.errors import DataError

log = logging.getLogger("aura_hpc")

FORMAT_VERSION = 1
TEXT_SUFFIXES = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_BATCH_CHARS = 1 << 20  # text per encode_batch call: big enough for the Rust thread pool to pay off


@dataclass
class PrepareSpec:
    out_dir: Path
    inputs: list[str] = field(default_factory=list)
    dataset: str | None = None  # a Hugging Face dataset name (or a local dataset folder), streamed
    subset: str | None = None
    split: str = "train"
    text_column: str = "text"
    max_tokens: int = 0
    tokenizer: str | None = None  # a tokenizer folder or hub name; None = train a byte-level BPE
    vocab_size: int = 8192
    val_fraction: float = 0.01
    builtin: bool = False  # the package's own corpus
    force: bool = False


@dataclass
class _Unit:
    text: str
    end_of_doc: bool


def input_folders(inputs: list[str]) -> list[Path]:
    """The folders among the inputs (given or matched by a glob), resolved."""
    found = []
    for item in inputs:
        matches = [Path(m) for m in sorted(glob.glob(item, recursive=True))] if glob.has_magic(item) else [Path(item)]
        found += [m.resolve() for m in matches if m.is_dir()]
    return found


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Files, folders (recursive) and globs to a sorted list of supported files."""
    files: list[Path] = []
    for item in inputs:
        matches = [Path(m) for m in sorted(glob.glob(item, recursive=True))] if glob.has_magic(item) else [Path(item)]
        if not matches or not all(m.exists() for m in matches):
            raise DataError(f"input {item!r} does not exist (fix: pass .txt/.jsonl/.parquet files, a folder or a glob)")
        for m in matches:
            if m.is_dir():
                files += sorted(p for p in m.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            elif m.suffix.lower() in TEXT_SUFFIXES:
                files.append(m)
            else:
                raise DataError(f"input {str(m)!r} has an unsupported type {m.suffix!r} (fix: use {', '.join(TEXT_SUFFIXES)})")
    if not files:
        raise DataError(f"no .txt/.jsonl/.parquet files found in {inputs} (fix: point at the files or their folder)")
    return sorted({f.resolve() for f in files})


def _split_paragraphs(text: str) -> list[str]:
    parts = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    return [p.strip("\n") + "\n\n" for p in parts]


def _records(
    builder: str, data_files: list[str] | None, name: str | None, subset: str | None, split: str, column: str, source: str
) -> Iterator[str]:
    """Stream the text column of a dataset through `datasets` (hub name or local files)."""
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        if data_files is not None:
            ds = datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(name, subset, split=split, streaming=True)
    except FileNotFoundError as exc:
        raise DataError(f"dataset {source!r} not found ({exc}) (fix: check the name/path, or --subset/--split)") from None
    except ValueError as exc:
        raise DataError(f"dataset {source!r} could not be loaded: {str(exc).splitlines()[0]} (fix: check --subset/--split)") from None
    except ConnectionError as exc:
        raise DataError(f"dataset {source!r} needs the network ({exc}) (fix: download it first, or use local files)") from None
    first = True
    for row in ds:
        if first:
            if column not in row:
                raise DataError(
                    f"column {column!r} not in {source!r}; its columns are {', '.join(map(str, row))} (fix: --text-column NAME)"
                )
            first = False
        text = row[column]
        if isinstance(text, str) and text.strip():
            check_text(source, text)
            yield text


def iter_units(spec: PrepareSpec, files: list[Path]) -> Iterator[_Unit]:
    """Text units in a fixed order; a unit is what goes wholly to train or to validation."""
    if spec.builtin:
        from aura_hpc.data.corpus import generate

        for para in _split_paragraphs(generate()):
            yield _Unit(para, False)
        yield _Unit("", True)
        return
    if spec.dataset:
        for text in _records("", None, spec.dataset, spec.subset, spec.split, spec.text_column, spec.dataset):
            yield _Unit(text, True)
        return
    for f in files:
        kind = TEXT_SUFFIXES[f.suffix.lower()]
        if kind == "text":
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{f} is not UTF-8 text ({exc.reason} at byte {exc.start}) (fix: convert it with iconv -t utf-8)") from None
            check_text(f, text)
            paras = _split_paragraphs(text)
            for i, para in enumerate(paras):
                yield _Unit(para, i == len(paras) - 1)
        else:
            for text in _records(kind, [str(f)], None, None, "train", spec.text_column, str(f)):
                yield _Unit(text, True)


def check_text(source: Path | str, text: str) -> None:
    """Refuse what is not text before the tokenizer trainer sees it: NUL bytes (a binary file, or a
    disk image) make one giant pre-token, and byte-level BPE training then runs for hours."""
    at = text.find("\0")
    if at >= 0:
        raise DataError(
            f"{source} holds NUL bytes (first at character {at}): it is binary, not text (fix: remove it from the inputs, "
            "or strip the NULs with tr -d '\\000')"
        )


def input_key(spec: PrepareSpec, files: list[Path]) -> str:
    """What the output depends on; an equal key means re-running is a no-op."""
    key: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "max_tokens": spec.max_tokens,
        "vocab_size": spec.vocab_size,
        "val_fraction": spec.val_fraction,
        "text_column": spec.text_column,
    }
    if spec.builtin:
        from aura_hpc.data.corpus import CORPUS_VERSION

        key["builtin"] = CORPUS_VERSION
    elif spec.dataset:
        key["dataset"] = [spec.dataset, spec.subset, spec.split]
    else:
        key["files"] = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    if spec.tokenizer:
        tok_json = Path(spec.tokenizer) / "tokenizer.json"
        key["tokenizer"] = _sha256_file(tok_json) if tok_json.exists() else spec.tokenizer
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare_hint(path: Path) -> str:
    """The prepare command for a data.path that is not prepared: a folder of text is an input,
    never the output (prepare refuses to write over files it did not write)."""
    if path.is_dir() and any(path.iterdir()):
        out = path.with_name(f"{path.name}-prepared")
        return f"python -m aura_hpc prepare {path} --out {out}, then --set data.path={out}"
    return f"python -m aura_hpc prepare YOUR_TEXT_FILES --out {path}"


def tokenizer_vocab(cfg: Any) -> int:
    """The prepared data's vocabulary; for data not prepared yet (the built-in corpus) data.vocab_size, an upper bound."""
    if cfg.data.path:
        try:
            return int(json.loads((Path(cfg.data.path) / "manifest.json").read_text())["tokenizer"]["vocab_size"])
        except (OSError, ValueError, KeyError):
            pass
    return cfg.model.vocab_size or cfg.data.vocab_size


def read_manifest(prepared: Path) -> dict[str, Any] | None:
    try:
        return json.loads((prepared / "manifest.json").read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def prepare(spec: PrepareSpec) -> dict[str, Any]:
    """Tokenize and pack; returns the manifest. Idempotent and atomic."""
    if not 0 < spec.val_fraction < 0.5:
        raise DataError(f"--val-fraction must be between 0 and 0.5, got {spec.val_fraction} (fix: --val-fraction 0.01)")
    if spec.max_tokens < 0:
        raise DataError(f"--max-tokens must be 0 (no limit) or more, got {spec.max_tokens}")
    if not spec.tokenizer and not 256 <= spec.vocab_size <= 1_000_000:
        raise DataError(f"--vocab-size must be between 256 and 1000000, got {spec.vocab_size} (fix: --vocab-size 8192)")
    if not spec.builtin and not spec.dataset and not spec.inputs:
        raise DataError("nothing to prepare (fix: pass input files/folders/globs, or --dataset NAME)")
    files = [] if (spec.builtin or spec.dataset) else resolve_inputs(spec.inputs)
    out = Path(spec.out_dir).expanduser().absolute()
    if out.parent.is_dir():
        for note in out_dir.clean_leftovers(out):
            log.info("%s", note)
    key = input_key(spec, files)
    existing = read_manifest(out)
    if existing and existing.get("input_key") == key and not spec.force:
        existing["up_to_date"] = True
        return existing
    out_dir.check_out_dir(out, files, [] if spec.builtin or spec.dataset else input_folders(spec.inputs), existing, spec.force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {out.parent} ({exc.strerror}) (fix: choose a writable --out)") from None
    if not os.access(out.parent, os.W_OK):
        raise DataError(f"cannot write to {out.parent} (fix: choose a writable --out, or fix its permissions)")

    t0 = time.perf_counter()
    tmp = out_dir.start_build(out)
    try:
        manifest = _build(spec, files, tmp, key)
        manifest["elapsed_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
        _fsync_tree(tmp)
        out_dir.finish_build(tmp, out)
    except BaseException:
        out_dir.abandon_build(tmp)
        raise
    manifest["up_to_date"] = False
    return manifest


def _build(spec: PrepareSpec, files: list[Path], tmp: Path, key: str) -> dict[str, Any]:
    # Tokenizer parallelism is what makes encode_batch fast; it must be on in this process.
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    tok_dir = tmp / "tokenizer"
    if spec.tokenizer:
        tok = load_tokenizer(spec.tokenizer, tok_dir)
        tok_source = spec.tokenizer
    else:
        tok = train_tokenizer((u.text for u in iter_units(spec, files) if u.text), spec.vocab_size, tok_dir)
        tok_source = f"byte-level BPE trained here (--vocab-size {spec.vocab_size})"
    backend, vocab, eos = tok.backend, tok.vocab_size, tok.eos_id
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32

    counts = {"train": 0, "val": 0}
    hashes = {"train": hashlib.sha256(), "val": hashlib.sha256()}
    units_total = 0
    t_enc = time.perf_counter()
    with open(tmp / "train.bin", "wb") as f_train, open(tmp / "val.bin", "wb") as f_val:
        sinks = {"train": f_train, "val": f_val}
        done = False
        batch: list[_Unit] = []
        chars = 0

        def flush() -> bool:
            """Encode a batch of units in parallel (Rust threads) and append them to their split."""
            nonlocal units_total
            encs = backend.encode_batch([u.text for u in batch], add_special_tokens=False)
            out: dict[str, list[int]] = {"train": [], "val": []}
            full = False
            for u, enc in zip(batch, encs, strict=True):
                ids = enc.ids
                if u.end_of_doc:
                    ids.append(eos)
                split = "val" if _is_val(units_total, spec.val_fraction) else "train"
                units_total += 1
                if spec.max_tokens:
                    room = spec.max_tokens - counts["train"] - counts["val"] - len(out["train"]) - len(out["val"])
                    if room <= len(ids):
                        ids, full = ids[:room], True
                out[split].extend(ids)
                if full:
                    break
            for split, ids in out.items():
                if ids:
                    data = np.array(ids, dtype=dtype).tobytes()
                    sinks[split].write(data)
                    hashes[split].update(data)
                    counts[split] += len(ids)
            return full

        for unit in iter_units(spec, files):
            batch.append(unit)
            chars += len(unit.text)
            if chars >= _BATCH_CHARS:
                done = flush()
                batch, chars = [], 0
                if done:
                    break
        if batch and not done:
            flush()
    encode_s = time.perf_counter() - t_enc
    if counts["train"] + counts["val"] == 0:
        raise DataError("the inputs contain no text (fix: check the files or --text-column)")
    if counts["val"] == 0:
        # Too few units for a unit-level split (e.g. one paragraph): take the tail of train.
        _move_tail_to_val(tmp, dtype, counts, hashes, spec.val_fraction)
    sources = [spec.dataset] if spec.dataset else (["builtin:aura-es-v1"] if spec.builtin else [str(f) for f in files])
    total = counts["train"] + counts["val"]
    return {
        "format": FORMAT_VERSION,
        "input_key": key,
        "sources": sources,
        "dataset": {"name": spec.dataset, "subset": spec.subset, "split": spec.split, "text_column": spec.text_column}
        if spec.dataset
        else None,
        "tokenizer": {
            "source": tok_source,
            "vocab_size": vocab,
            "eos_id": eos,
            "sha256": _sha256_file(tok_dir / "tokenizer.json"),
        },
        "dtype": np.dtype(dtype).name,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "units": units_total,
        "data_sha256": hashlib.sha256((hashes["train"].hexdigest() + hashes["val"].hexdigest()).encode()).hexdigest(),
        "encode_tokens_per_s": round(total / encode_s) if encode_s > 0 else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _is_val(i: int, fraction: float) -> bool:
    """Every ~1/fraction-th unit, spread evenly through the corpus."""
    return int((i + 1) * fraction) > int(i * fraction)


def _move_tail_to_val(tmp: Path, dtype: Any, counts: dict[str, int], hashes: dict[str, Any], fraction: float) -> None:
    train = np.fromfile(tmp / "train.bin", dtype=dtype)
    n_val = max(1, int(len(train) * fraction))
    keep, val = train[:-n_val], train[-n_val:]
    keep.tofile(tmp / "train.bin")
    val.tofile(tmp / "val.bin")
    counts["train"], counts["val"] = len(keep), len(val)
    hashes["train"], hashes["val"] = hashlib.sha256(keep.tobytes()), hashlib.sha256(val.tobytes())


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
