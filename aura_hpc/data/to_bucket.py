"""`prepare --out s3://bucket/prefix`: the data is built on local disk (resumable, as for a local
--out) and uploaded; the manifest goes last, so until it is there the prefix is not prepared data
and no run trains on half of it.

The same rule as on disk: prepare writes only under a prefix that is empty or holds prepared data of
its own (a manifest, or the marker of its unfinished upload), and replaces prepared data of other
inputs only with --force. Replacing takes the old manifest away first, so a run that starts
meanwhile is refused instead of mixing old and new shards.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aura_hpc.data import out_dir, storage
from aura_hpc.errors import DataError

log = logging.getLogger("aura_hpc")

MARKER = out_dir.MARKER  # an upload under way: the input key it is for


def check_inputs(url: str, inputs: list[str], files: list[Any]) -> None:
    """A local --out's rules, for a prefix: never an input, and never where the inputs' next listing
    would take its manifest and tokenizer (JSON) for text."""
    url = url.rstrip("/")
    for f in files:
        if isinstance(f, str) and (f == url or f.startswith(url + "/")):
            raise DataError(
                f"--out {url} {'is' if f == url else 'contains'} the input {f}: prepare would replace what it reads "
                f"(fix: --out {url}-prepared)"
            )
    written = [storage.strip(storage.join(url, name)) for name in ("manifest.json", "tokenizer/tokenizer.json")]
    for item in (i for i in inputs if storage.is_remote(i)):
        prefix = item.rstrip("/")
        if glob.has_magic(item):
            from fsspec.utils import glob_translate

            pattern = re.compile(glob_translate(storage.strip(item)))
            inside = any(pattern.match(name) for name in written)
        else:
            inside = url == prefix or url.startswith(prefix + "/")
        if inside:
            raise DataError(
                f"--out {url} is inside the input {item}: its manifest and tokenizer would be read as input the next time "
                f"(fix: an --out outside the inputs, e.g. --out {prefix.split('*')[0].rstrip('/')}-prepared)"
            )


def _check_prefix(
    url: str,
    present: dict[str, int],
    manifest: dict[str, Any] | None,
    key: str,
    marker: dict[str, Any] | None,
    force: bool,
    damaged: bool = False,
) -> None:
    names = [u[len(url) + 1 :] for u in present]
    foreign = [n for n in names if not out_dir.our_file(n)]  # a user's tokenizer/notes.txt is theirs: judged by name
    damaged_ours = damaged and "tokenizer/tokenizer.json" in names  # as locally: with the tokenizer prepare uploads
    if present and (foreign or (not out_dir.our_manifest(manifest) and marker is None and not damaged_ours)):
        shown = ", ".join((foreign or names)[:3])
        raise DataError(
            f"--out {url} holds {len(present)} object(s) ({shown}) and no prepared data of ours; prepare never replaces what it "
            f"did not write (fix: another prefix, e.g. --out {url}-prepared)"
        )
    if manifest is not None and manifest.get("input_key") != key and not force:
        tok = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
        raise DataError(
            f"--out {url} already holds data prepared from other inputs or settings (tokenizer vocab {tok.get('vocab_size', '?')}, "
            f"created {manifest.get('created', '?')}); runs trained on it need it (fix: another --out, or --force to replace it)"
        )


def _read_marker(url: str, policy: storage.Policy) -> dict[str, Any]:
    """Our unfinished upload's marker: an object anyone with the bucket could have written."""
    try:
        marker = json.loads(storage.read_bytes(url, policy))
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or not isinstance(marker.get("input_key"), str):
        raise DataError(
            f"{url} is not the marker prepare leaves during an upload (a JSON object with its input_key) (fix: another --out, "
            "or delete that object if it is yours)"
        )
    return marker


def prepare_to_bucket(spec: Any, key: str, build_here: Callable[[Path], dict[str, Any]], cache_root: Path) -> dict[str, Any]:
    url = str(spec.out_dir).rstrip("/")
    storage.check_url(url, "--out")
    policy = storage.Policy()
    try:
        existing, damaged = storage.read_manifest(url, policy, check=False), False
    except storage.DamagedManifest:
        if not spec.force:
            raise
        existing, damaged = None, True  # replaced with --force where every object there has a name prepare writes
    if existing and existing.get("input_key") == key and not spec.force:
        return {**existing, "up_to_date": True}
    present = storage.listing(url, policy)
    marker_url = storage.join(url, MARKER)
    marker = _read_marker(marker_url, policy) if marker_url in present else None
    _check_prefix(url, present, existing, key, marker, spec.force, damaged)

    # The local build: under the cache, named after the URL, resumable like a local one.
    local_out = cache_root / "prepare" / hashlib.sha256(url.encode()).hexdigest()[:16] / "data"
    local_out.parent.mkdir(parents=True, exist_ok=True)
    for note in out_dir.clean_leftovers(local_out, key):
        log.info("%s", note)
    build = out_dir.start_build(local_out, key)
    manifest = build_here(build)
    (build / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))

    same_upload = marker is not None and marker.get("input_key") == key
    storage.write_bytes(marker_url, json.dumps({"input_key": key}).encode(), policy)
    if existing is not None or damaged:
        storage.delete(storage.join(url, "manifest.json"), policy)  # from here on, no run takes this prefix for data
    width = 4 if manifest["dtype"] == "uint32" else 2
    for s in manifest["shards"]:
        target = storage.join(url, s["file"])
        if same_upload and present.get(target) == s["tokens"] * width:
            continue  # uploaded before an interruption (the marker says: for these inputs)
        storage.upload(build / s["file"], target, policy)
    for f in sorted((build / "tokenizer").iterdir()):
        storage.upload(f, storage.join(url, "tokenizer", f.name), policy)
    storage.upload(build / "manifest.json", storage.join(url, "manifest.json"), policy)
    listed = {storage.join(url, s["file"]) for s in manifest["shards"]}
    listed |= {storage.join(url, "tokenizer", f.name) for f in (build / "tokenizer").iterdir()}
    tok_prefix = storage.join(url, "tokenizer") + "/"
    for old in present:  # of the replaced data (ours: shards/, and tokenizer/ files by the names prepare writes)
        ours = old.startswith(storage.join(url, "shards") + "/") or (
            old.startswith(tok_prefix) and out_dir.our_file("tokenizer/" + old[len(tok_prefix) :])
        )
        # An earlier --tokenizer's vocab.json and merges.txt were left beside the new tokenizer.json, and read with it.
        if ours and old not in listed:
            storage.delete(old, policy)
    storage.delete(marker_url, policy)
    shutil.rmtree(build, ignore_errors=True)
    return {**manifest, "up_to_date": False}
