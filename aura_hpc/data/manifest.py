"""A prepared directory's manifest, checked before any of it is used: it may come from a bucket or a
folder anyone could write, and its values become dtypes, array sizes and file names."""

from __future__ import annotations

import re
from typing import Any

from aura_hpc.errors import DataError

# The only token files a manifest may name: a name from a manifest (perhaps downloaded) never
# leads outside the prepared directory.
TOKEN_FILE = re.compile(r"(shards/(train|val)-\d{5,}|(train|val))\.bin")
SHA256 = re.compile(r"[0-9a-f]{64}")
DTYPES = ("uint16", "uint32")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """The manifest at `where` (its path or URL), if every field the readers use has the type and
    range prepare writes; else one DataError naming the field."""

    def bad(field: str, value: Any, want: str) -> DataError:
        return DataError(
            f"{where}: {field} is {str(value)[:60]!r}, not {want}; it was not written by prepare or was damaged "
            "(fix: prepare the data again with --force)"
        )

    if not isinstance(manifest, dict):
        raise bad("the manifest", type(manifest).__name__, "a JSON object")
    if manifest.get("dtype") not in DTYPES:
        raise bad("dtype", manifest.get("dtype"), "uint16 or uint32")
    tok = manifest.get("tokenizer")
    if not isinstance(tok, dict):
        raise bad("tokenizer", tok, "an object")
    vocab, eos = tok.get("vocab_size"), tok.get("eos_id")
    if not _count(vocab) or vocab < 1:
        raise bad("tokenizer.vocab_size", vocab, "a positive integer")
    if not _count(eos) or eos >= vocab:
        raise bad("tokenizer.eos_id", eos, f"an integer below the vocab_size {vocab}")
    sha = tok.get("sha256")
    if not isinstance(sha, str) or not SHA256.fullmatch(sha):  # part of a cache folder's name
        raise bad("tokenizer.sha256", sha, "64 hex digits")
    listed = manifest.get("shards")
    if not listed:  # format 1: train.bin and val.bin
        for split in ("train", "val"):
            if not _count(manifest.get(f"{split}_tokens")):
                raise bad(f"{split}_tokens", manifest.get(f"{split}_tokens"), "a count of tokens")
        return manifest
    if not isinstance(listed, list):
        raise bad("shards", listed, "a list")
    seen: set[str] = set()
    for i, entry in enumerate(listed):
        if not isinstance(entry, dict):
            raise bad(f"shards[{i}]", entry, "an object")
        if entry.get("split") not in ("train", "val"):
            raise bad(f"shards[{i}].split", entry.get("split"), "train or val")
        if not isinstance(entry.get("file"), str) or not (m := TOKEN_FILE.fullmatch(entry["file"])):
            raise bad(f"shards[{i}].file", entry.get("file"), "a token file (shards/train-NNNNN.bin)")
        if (m.group(2) or m.group(3)) != entry["split"] or entry["file"] in seen:  # training tokens never in validation
            raise bad(f"shards[{i}].file", entry["file"], f"a {entry['split']} token file listed once")
        seen.add(entry["file"])
        if not _count(entry.get("tokens")):
            raise bad(f"shards[{i}].tokens", entry.get("tokens"), "a count of tokens")
        if not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"]):
            raise bad(f"shards[{i}].sha256", entry.get("sha256"), "64 hex digits")
    return manifest
