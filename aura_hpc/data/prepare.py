"""`python -m aura_hpc prepare`: text in, a shareable prepared directory out.

Layout of a prepared directory (copy it, put it on NFS for all nodes, or in a bucket):
    shards/train-NNNNN.bin, shards/val-NNNNN.bin   packed token ids of each piece of the input
                                                   (uint16 when the vocabulary fits, else uint32)
    tokenizer/           a transformers-loadable tokenizer folder
    manifest.json        written last: sources, shards with token counts and hashes, dtype, tokenizer hash
The directory is built under a hidden name and renamed into place (uploaded, manifest last, for
s3://), so a half-written prepare never looks complete; the pieces it finished are kept for the
next run of the same inputs (shards.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shlex
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.config.checks import revision_problem
from aura_hpc.data import out_dir, shards, storage
from aura_hpc.data.sources import (  # noqa: F401  (split_paragraphs re-exported for tests)
    TEXT_SUFFIXES,
    dataset_folder_files,
    dataset_shards,
    input_folders,
    resolve_inputs,
    split_paragraphs,
)
from aura_hpc.data.tokenizer import load_tokenizer, train_tokenizer
from aura_hpc.errors import DataError

log = logging.getLogger("aura_hpc")

FORMAT_VERSION = 2  # 2: shards/ and a manifest listing them (1: train.bin and val.bin, still read)


@dataclass
class PrepareSpec:
    out_dir: Path | str  # a folder, or s3://bucket/prefix
    inputs: list[str] = field(default_factory=list)
    dataset: str | None = None  # a Hugging Face dataset name (or a local dataset folder), streamed
    subset: str | None = None
    split: str = "train"
    revision: str | None = None  # the Hub dataset's commit (or tag, branch): the same text whenever it is prepared
    text_column: str = "text"
    max_tokens: int = 0
    tokenizer: str | None = None  # a tokenizer folder or hub name; None = train a byte-level BPE
    vocab_size: int = 8192
    val_fraction: float = 0.01
    builtin: bool = False  # the package's own corpus
    force: bool = False
    workers: int = 1  # processes encoding pieces at once (the output does not depend on it)
    shard_mb: float = 64.0  # text per piece (one train and one validation shard each)
    tokenizer_sample_mb: float = 256.0  # text the tokenizer is trained on, taken evenly from the pieces
    cache_dir: str = ""  # where an --out in object storage is built before it is uploaded


def input_key(spec: PrepareSpec, files: list[Path | str]) -> str:
    """What the output depends on; an equal key means re-running is a no-op."""
    key: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "max_tokens": spec.max_tokens,
        "vocab_size": spec.vocab_size,
        "val_fraction": spec.val_fraction,
        "text_column": spec.text_column,
        "shard_mb": spec.shard_mb,
        "tokenizer_sample_mb": spec.tokenizer_sample_mb,
    }
    if spec.builtin:
        from aura_hpc.data.corpus import CORPUS_VERSION

        key["builtin"] = CORPUS_VERSION
    elif spec.dataset:
        key["dataset"] = [spec.dataset, spec.subset, spec.split, *([spec.revision] if spec.revision else [])]
        folder = dataset_folder_files(spec.dataset)
        if folder:  # a local dataset folder: text added to it is new input, as for files
            key["dataset_files"] = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in folder]
    else:
        remote = storage.objects if any(isinstance(f, str) for f in files) else None
        listed: dict[str, tuple[int, str]] = {}
        for f in files:
            if isinstance(f, str) and f not in listed and remote is not None:
                listed.update(remote(f))
        key["files"] = [
            [str(f), f.stat().st_size, f.stat().st_mtime_ns] if isinstance(f, Path) else [f, *listed.get(f, (0, ""))] for f in files
        ]
    if spec.tokenizer:
        tok_json = Path(spec.tokenizer) / "tokenizer.json"
        key["tokenizer"] = sha256_file(tok_json) if tok_json.exists() else spec.tokenizer
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """A file's SHA-256 (prepared data, tokenizers and checkpoints alike)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def prepare_hint(path: Path) -> str:
    """The prepare command for a data.path that is not prepared: a folder of text is an input,
    never the output (prepare refuses to write over files it did not write)."""
    if path.is_dir() and any(path.iterdir()):
        out = path.with_name(f"{path.name}-prepared")
        src, dst = shlex.quote(str(path)), shlex.quote(str(out))
        return f"python -m aura_hpc prepare {src} --out {dst}, then --set data.path={dst}"
    return f"python -m aura_hpc prepare YOUR_TEXT_FILES --out {shlex.quote(str(path))}"


def read_manifest(prepared: Path) -> dict[str, Any] | None:
    """The folder's manifest.json as a JSON object; None when there is none (or it is no object: not ours). One that
    is not JSON raises storage.DamagedManifest: read as none, a run said the folder was no prepared data and advised
    preparing it as text, and `prepare --force` refused it as a manifest not ours."""
    try:
        value = json.loads((prepared / "manifest.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except ValueError:  # not JSON, not UTF-8
        raise storage.damaged_manifest(str(prepared / "manifest.json")) from None
    return value if isinstance(value, dict) else None


def existing_manifest(out: Path, force: bool) -> tuple[dict[str, Any] | None, bool]:
    """--out's manifest, and whether it is a damaged one that --force replaces (without --force: refused, with the fix)."""
    try:
        return read_manifest(out), False
    except storage.DamagedManifest:
        if not force:
            raise
        return None, True


def check_spec(spec: PrepareSpec) -> None:
    """The settings' own ranges (a dry run says what the run would refuse)."""
    if not 0 < spec.val_fraction < 0.5:
        raise DataError(f"--val-fraction must be between 0 and 0.5, got {spec.val_fraction} (fix: --val-fraction 0.01)")
    if spec.max_tokens < 0:
        raise DataError(f"--max-tokens must be 0 (no limit) or more, got {spec.max_tokens}")
    if not spec.tokenizer and not 256 <= spec.vocab_size <= 1_000_000:
        raise DataError(f"--vocab-size must be between 256 and 1000000, got {spec.vocab_size} (fix: --vocab-size 8192)")
    if not spec.builtin and not spec.dataset and not spec.inputs:
        raise DataError("nothing to prepare (fix: pass input files/folders/globs, or --dataset NAME)")
    if problem := revision_problem(spec.dataset or "", spec.revision, "--revision"):
        raise DataError(problem)


def check_out(spec: PrepareSpec) -> None:
    """What the run would refuse of --out (an input, inside an input folder, files not ours, other inputs'
    data without --force): a dry run says it, nothing written."""
    files = [] if (spec.builtin or spec.dataset) else resolve_inputs(spec.inputs)
    if storage.is_remote(str(spec.out_dir)):
        from aura_hpc.data.to_bucket import check_inputs

        check_inputs(str(spec.out_dir), spec.inputs, files)
        return
    out = Path(spec.out_dir).expanduser().resolve()
    existing, damaged = existing_manifest(out, spec.force)
    if existing and existing.get("input_key") == input_key(spec, files) and not spec.force:
        return  # up to date: the run would do nothing
    local_files = [f for f in files if isinstance(f, Path)]
    out_dir.check_out_dir(out, local_files, _input_folders(spec), existing, spec.force, damaged)


def _input_folders(spec: PrepareSpec) -> list[Path]:
    """The folders an --out must not be inside. A local dataset folder is one: every file in it is in the input key, so
    an --out there was accepted, and the same command then refused as other inputs' data."""
    if spec.builtin:
        return []
    if spec.dataset:
        return [Path(spec.dataset).expanduser().resolve()] if dataset_folder_files(spec.dataset) else []
    return input_folders(spec.inputs)


def prepare(spec: PrepareSpec) -> dict[str, Any]:
    """Tokenize and pack; returns the manifest. Idempotent and atomic."""
    check_spec(spec)
    files = [] if (spec.builtin or spec.dataset) else resolve_inputs(spec.inputs)
    key = input_key(spec, files)
    if storage.is_remote(str(spec.out_dir)):
        from aura_hpc.data.cache import default_dir
        from aura_hpc.data.to_bucket import check_inputs, prepare_to_bucket

        check_inputs(str(spec.out_dir), spec.inputs, files)
        started = time.perf_counter()

        def build_here(build: Path) -> dict[str, Any]:
            manifest = _build(spec, files, build, key)
            manifest["elapsed_s"] = round(time.perf_counter() - started, 3)
            return manifest

        return prepare_to_bucket(spec, key, build_here, Path(spec.cache_dir) if spec.cache_dir else default_dir())
    # A link (data -> /scratch/prepared) is followed: the data goes where it points, on that disk, and the
    # link stays. Moved aside as the old output, the link itself was replaced by a folder beside it.
    out = Path(spec.out_dir).expanduser().resolve()
    if out.parent.is_dir():
        for note in out_dir.clean_leftovers(out, key):
            log.info("%s", note)
    existing, damaged = existing_manifest(out, spec.force)
    if existing and existing.get("input_key") == key and not spec.force:
        existing["up_to_date"] = True
        return existing
    local_files = [f for f in files if isinstance(f, Path)]
    out_dir.check_out_dir(out, local_files, _input_folders(spec), existing, spec.force, damaged)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {out.parent} ({exc.strerror}) (fix: choose a writable --out)") from None
    if not os.access(out.parent, os.W_OK):
        raise DataError(f"cannot write to {out.parent} (fix: choose a writable --out, or fix its permissions)")

    t0 = time.perf_counter()
    build = out_dir.start_build(out, key)  # the same inputs find their unfinished build again
    manifest = _build(spec, files, build, key)
    manifest["elapsed_s"] = round(time.perf_counter() - t0, 3)
    (build / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
    _fsync_tree(build)
    out_dir.finish_build(build, out)
    manifest["up_to_date"] = False
    return manifest


def plan_pieces(spec: PrepareSpec, files: list[Path | str]) -> list[shards.Piece]:
    n_dataset = dataset_shards(spec.dataset, spec.subset, spec.split, spec.revision) if spec.dataset else 1
    return shards.plan(files, TEXT_SUFFIXES, int(spec.shard_mb * 2**20), spec.dataset, spec.builtin, n_dataset)


def encode_jobs(spec: PrepareSpec, pieces: list[shards.Piece], build: Path, tok: Any) -> list[shards.Job]:
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    single = len(pieces) == 1  # one piece (a Hub dataset of one file): its budget applies while it is read
    tok_json = str(build / "tokenizer" / "tokenizer.json")
    return [
        shards.Job(p, str(build), tok_json, tok.eos_id, np.dtype(dtype).name, spec.val_fraction,
                   spec.text_column, spec.subset, spec.split, spec.max_tokens if single else 0, revision=spec.revision)
        for p in pieces
    ]  # fmt: skip


def _build(spec: PrepareSpec, files: list[Path | str], build: Path, key: str) -> dict[str, Any]:
    """The tokenizer (once), every piece's shards (in parallel, resumable), and the manifest."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # encode_batch's Rust threads are what makes it fast
    pieces = plan_pieces(spec, files)
    tok, tok_source = make_tokenizer(spec, pieces, build / "tokenizer")
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    jobs = encode_jobs(spec, pieces, build, tok)
    t_enc = time.perf_counter()
    records = shards.encode_all(jobs, max(1, spec.workers), spec.max_tokens)
    encode_s = time.perf_counter() - t_enc
    listed = shards.shard_list(records)
    if not listed:
        raise DataError("the inputs contain no text (fix: check the files or --text-column)")
    if not any(s["split"] == "val" for s in listed):
        listed = _move_tail_to_val(build, listed, np.dtype(dtype), spec.val_fraction)
    listed = _join_small(build, listed, np.dtype(dtype), int(spec.shard_mb * 2**20), len(pieces))
    _keep_only(build, listed)
    counts = {split: sum(s["tokens"] for s in listed if s["split"] == split) for split in ("train", "val")}
    sources = [spec.dataset] if spec.dataset else (["builtin:aura-es-v1"] if spec.builtin else [str(f) for f in files])
    return {
        "format": FORMAT_VERSION,
        "input_key": key,
        "sources": sources,
        "dataset": {
            "name": spec.dataset,
            "subset": spec.subset,
            "split": spec.split,
            "revision": spec.revision,
            "text_column": spec.text_column,
        }
        if spec.dataset
        else None,
        "tokenizer": {
            "source": tok_source,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "sha256": sha256_file(build / "tokenizer" / "tokenizer.json"),
        },
        "dtype": np.dtype(dtype).name,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "shards": listed,
        "pieces": len(pieces),
        "data_sha256": hashlib.sha256("".join(s["sha256"] for s in listed).encode()).hexdigest(),
        "encode_tokens_per_s": round((counts["train"] + counts["val"]) / encode_s) if encode_s > 0 else None,
        "workers": spec.workers,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def make_tokenizer(spec: PrepareSpec, pieces: list[shards.Piece], tok_dir: Path) -> tuple[Any, str]:
    """The tokenizer, made once per build: loaded, or trained on an even sample of the pieces
    (--tokenizer-sample-mb spread over them; all of a small corpus). A resumed build keeps it."""
    from aura_hpc.data.tokenizer import read_saved

    done = tok_dir.parent / "tokenizer.done"
    if done.is_file() and (tok_dir / "tokenizer.json").is_file():
        return read_saved(tok_dir), done.read_text(encoding="utf-8")
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    if spec.tokenizer:
        tok, source = load_tokenizer(spec.tokenizer, tok_dir), spec.tokenizer
    else:
        share = spec.tokenizer_sample_mb * 2**20 / len(pieces)
        # A Parquet or JSON object is sampled from a local copy of all of it, kept for its encoding (one download, not
        # two) while the copies fit in a quarter of the room: kept all, a corpus of objects larger than the disk filled it.
        room, kept = shutil.disk_usage(tok_dir.parent).free // 4, 0

        def sample() -> Iterator[str]:
            nonlocal kept
            for whole in pieces:
                taken, start = 0, whole.start
                copy = shards.input_copy(shards.Job(whole, str(tok_dir.parent), "", 0, "uint16", 0.0, ""))
                while taken < share:
                    # A window at a time: characters of the text are fewer than the bytes that hold them (JSON rows'
                    # other fields, \uXXXX escapes: a Chinese corpus gave a fifth of its share in one window).
                    p = shards.head_of(dataclasses.replace(whole, start=start), int(share * 1.25) + 4096)
                    job = shards.Job(p, str(tok_dir.parent), "", 0, "uint16", spec.val_fraction, spec.text_column, spec.subset, spec.split,
                                     revision=spec.revision)  # fmt: skip
                    for text, _ in shards.piece_texts(job):
                        if text:
                            yield text
                            taken += len(text)
                        if taken >= share:
                            break
                    if p.end == whole.end:
                        break
                    start = p.end
                with contextlib.suppress(OSError):
                    if copy.is_file() and kept + copy.stat().st_size > room:
                        copy.unlink()  # downloaded again to be encoded
                    elif copy.is_file():
                        kept += copy.stat().st_size

        tok = train_tokenizer(sample(), spec.vocab_size, tok_dir)
        source = f"byte-level BPE trained here (--vocab-size {spec.vocab_size}, on up to {spec.tokenizer_sample_mb:g} MB of the text)"
    done.write_text(source, encoding="utf-8")
    return tok, source


def _move_tail_to_val(build: Path, listed: list[dict[str, Any]], dtype: np.dtype, fraction: float) -> list[dict[str, Any]]:
    """Too few units for a unit-level split (e.g. one paragraph): the tail of the last train shard."""
    last = next(s for s in reversed(listed) if s["split"] == "train")
    train = np.fromfile(build / last["file"], dtype=dtype)
    n_val = max(1, int(len(train) * fraction))
    keep, val = train[:-n_val], train[-n_val:]
    keep.tofile(build / last["file"])
    val_file = last["file"].replace("/train-", "/val-")
    val.tofile(build / val_file)
    last.update(tokens=len(keep), sha256=hashlib.sha256(keep.tobytes()).hexdigest())
    return [*listed, {"split": "val", "file": val_file, "tokens": len(val), "sha256": hashlib.sha256(val.tobytes()).hexdigest()}]


def _join_small(build: Path, listed: list[dict[str, Any]], dtype: np.dtype, target: int, first_free: int) -> list[dict[str, Any]]:
    """Consecutive small shards of a split (a quarter of `target` bytes at most) joined, in order, into shards of up to
    `target` bytes. Each shard is cut into
    sequences on its own, the tokens short of one at its end left out: a corpus of one file per article (a piece, so a
    shard, each) kept half its tokens at data.seq_len 256, and none at 1024. A joined shard takes a number past every
    piece's, so a build stopped here resumes from its pieces' own shards, which stay until the manifest is written."""
    out = []
    for split in ("train", "val"):
        groups: list[list[dict[str, Any]]] = []
        index = first_free
        room = target // dtype.itemsize
        for s in (s for s in listed if s["split"] == split):
            # Small shards alone: a piece of --shard-mb of text encodes to about half of it, and joining those copied
            # the whole corpus at the end, on one thread, into twice its room.
            small = s["tokens"] <= room // 4
            if small and groups and groups[-1][-1]["tokens"] <= room // 4 and sum(g["tokens"] for g in groups[-1]) + s["tokens"] <= room:
                groups[-1].append(s)
            else:
                groups.append([s])
        for group in groups:
            if len(group) == 1:
                out.append(group[0])
                continue
            name, digest = f"{shards.SHARDS}/{split}-{index:05d}.bin", hashlib.sha256()
            index += 1
            with open(build / f"{name}.tmp", "wb") as f:
                for s in group:
                    data = (build / s["file"]).read_bytes()
                    f.write(data)
                    digest.update(data)
            (build / f"{name}.tmp").replace(build / name)
            out.append({"split": split, "file": name, "tokens": sum(s["tokens"] for s in group), "sha256": digest.hexdigest()})
    return out


def _keep_only(build: Path, listed: list[dict[str, Any]]) -> None:
    """The finished directory holds what the manifest lists: the build's records and the shards past
    a token budget go."""
    wanted = {s["file"] for s in listed}
    for f in (build / shards.SHARDS).iterdir():
        if f"{shards.SHARDS}/{f.name}" not in wanted:
            f.unlink()
    shutil.rmtree(build / shards.DONE, ignore_errors=True)
    shutil.rmtree(build / "inputs", ignore_errors=True)  # local copies of Parquet/JSON objects
    (build / "tokenizer.done").unlink(missing_ok=True)


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
