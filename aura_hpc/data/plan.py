"""`prepare --dry-run`: what a prepare would read and write, and how long it would take, before it
starts (a 20B-token corpus is hours of encoding). Estimates from this machine kind's measurements
(PLATFORM.md, docs/speed.md): byte-level BPE at ~3.2 bytes of Spanish text per token, ~700K
tokens/s per encoding process, tokenizer training ~0.15 s per MB of its sample."""

from __future__ import annotations

import math
from pathlib import Path

from aura_hpc.data import storage
from aura_hpc.data.prepare import TEXT_SUFFIXES, PrepareSpec, input_folders, resolve_inputs

BYTES_PER_TOKEN = 3.2
TOKENS_PER_S_PER_WORKER = 700_000
TOKENIZER_S_PER_MB = 0.15


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return f"{n:,.1f} TB"


def _suffix(f: Path | str) -> str:
    name = str(f).rsplit("/", 1)[-1]
    return name[name.rfind(".") :].lower() if "." in name else ""


def _sizes(inputs: list[str], files: list[Path | str]) -> list[int]:
    """Each input file's size: local files from the filesystem, objects from one listing per input."""
    listed: dict[str, int] = {}
    for item in inputs:
        if storage.is_remote(item):
            listed.update(storage.listing(item.rstrip("/") + "/" if "*" not in item else item))
    return [f.stat().st_size if isinstance(f, Path) else listed.get(f) or storage.size(f) for f in files]


def describe(spec: PrepareSpec) -> list[tuple[str, str]]:
    if spec.dataset or spec.builtin:
        pinned = f" at revision {spec.revision}" if spec.revision else ""
        what = f"dataset {spec.dataset}{pinned}" if spec.dataset else "the built-in corpus"
        budget = f", stopping at {spec.max_tokens:,} tokens" if spec.max_tokens else ""
        return [
            ("read", f"{what}, streamed, by one process{budget} (its size is not known before it is read)"),
            ("write", f"{spec.out_dir}: one train and one validation shard, the tokenizer, manifest.json"),
        ]
    files = resolve_inputs(spec.inputs)
    folders = input_folders(spec.inputs)
    sizes = _sizes(spec.inputs, files)
    total = sum(sizes)
    # Pieces estimated from sizes: a dry run reads no text (a prepare finds paragraph boundaries by reading).
    piece = int(spec.shard_mb * 2**20)
    cut = [TEXT_SUFFIXES.get(_suffix(f)) == "text" or _suffix(f) == ".jsonl" for f in files]
    n_pieces = sum(max(1, math.ceil(n / piece)) if c else 1 for n, c in zip(sizes, cut, strict=True))
    tokens = total / BYTES_PER_TOKEN
    if spec.max_tokens:
        tokens = min(tokens, spec.max_tokens)
    width = 4 if _vocab(spec) > 65536 else 2
    sample_mb = min(spec.tokenizer_sample_mb, total / 2**20)
    seconds = (0 if spec.tokenizer else sample_mb * TOKENIZER_S_PER_MB) + tokens / (TOKENS_PER_S_PER_WORKER * max(1, spec.workers))
    shown = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return [
        ("read", f"{len(files)} file(s), {_size(total)}: {shown}" + (f" (from {len(folders)} folder(s))" if folders else "")),
        (
            "tokens",
            f"~{tokens:,.0f} (at ~{BYTES_PER_TOKEN} bytes of text per token){' (the --max-tokens budget)' if spec.max_tokens else ''}",
        ),
        ("shards", f"{n_pieces} piece(s) of up to {spec.shard_mb:g} MB of text: up to {2 * n_pieces} shards (train and validation)"),
        ("disk", f"~{_size(tokens * width)} of token files ({'uint32' if width == 4 else 'uint16'}) in {spec.out_dir}"),
        (
            "time",
            f"~{seconds:,.0f} s with {spec.workers} worker(s)"
            + (
                ""
                if spec.tokenizer
                else f", of which ~{sample_mb * TOKENIZER_S_PER_MB:,.0f} s training the tokenizer on {sample_mb:,.0f} MB"
            ),
        ),
    ]


def _vocab(spec: PrepareSpec) -> int:
    """The vocabulary the tokens are stored for: a given --tokenizer's own (a 128K one is 4 bytes a token), else --vocab-size."""
    if spec.tokenizer and (Path(spec.tokenizer) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        from aura_hpc.data.tokenizer import id_space

        try:
            return id_space(Tokenizer.from_file(str(Path(spec.tokenizer) / "tokenizer.json")))
        except Exception:  # tokenizers raises its own for a damaged file: the run says it; the estimate takes --vocab-size
            return spec.vocab_size
    return spec.vocab_size
