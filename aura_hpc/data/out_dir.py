"""Where `prepare` writes: what it may replace, the temporary sibling it builds in, and the swap.

The rule is that prepare deletes nothing it did not write. An `--out` folder is replaced only when
it is a prepared directory of ours (a manifest prepare wrote, and nothing but the files prepare
names, inside shards/ and tokenizer/ too); any other non-empty folder is refused with what it
holds. The new data is built in a hidden sibling marked as ours (`.NAME.build-KEY`, KEY from the
inputs) and renamed into place only when complete, so an interrupted prepare leaves the old data or
nothing, and the next prepare of the same inputs resumes its finished pieces. A build of other
inputs left by a killed prepare is recognised by its marker and removed (and the old data moved
aside just before a crash is put back).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from aura_hpc.data.tokenizer import TOKENIZER_FILES
from aura_hpc.errors import DataError
from aura_hpc.processes import alive

# What a prepared directory holds; anything else in --out is somebody else's.
MARKER = ".aura-prepare"  # inside a temporary sibling: who is building it (removed once it is in place)
_OUR_FILES = re.compile(
    rf"manifest\.json|train\.bin|val\.bin|{re.escape(MARKER)}|shards/(train|val)-\d{{5,}}\.bin|tokenizer/(?P<tok>[^/]+)"
)
_KEY = re.compile(r"[0-9a-f]{64}")


def our_file(name: str) -> bool:
    """Whether `name` (relative to a prepared directory, / between folders) is a name prepare writes."""
    m = _OUR_FILES.fullmatch(name)
    return m is not None and (m["tok"] is None or m["tok"] in TOKENIZER_FILES)


def our_manifest(manifest: Any) -> bool:
    """A manifest prepare wrote (its format and input key), not any JSON named manifest.json."""
    return isinstance(manifest, dict) and manifest.get("format") in (1, 2) and bool(_KEY.fullmatch(str(manifest.get("input_key"))))


def foreign_files(out: Path) -> list[str]:
    """What in `out` prepare did not write, judged file by file down into shards/ and tokenizer/
    (prepare writes no links and no other folders)."""
    found = []
    for p in sorted(out.iterdir()):
        if p.name in ("shards", "tokenizer") and p.is_dir() and not p.is_symlink():
            for q in sorted(p.iterdir()):
                if q.is_symlink() or not q.is_file() or not our_file(f"{p.name}/{q.name}"):
                    found.append(f"{p.name}/{q.name}")
        elif p.is_symlink() or not p.is_file() or not our_file(p.name):
            found.append(p.name)
    return found


def _listing(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_out_dir(
    out: Path, inputs: list[Path], input_dirs: list[Path], manifest: dict[str, Any] | None, force: bool, damaged: bool = False
) -> None:
    """Refuse an --out that is an input, holds an input, lies inside an input folder, or holds files
    that are not ours; refuse to replace prepared data of other inputs without --force. `damaged`: its manifest.json
    is not JSON (--force given): ours if every file there has a name prepare writes, tokenizer/tokenizer.json among them."""
    out_abs = out.expanduser().resolve()
    for f in inputs:
        if f == out_abs or out_abs in f.parents:
            raise DataError(
                f"--out {out} {'is' if f == out_abs else 'contains'} the input {f}: prepare would replace what it reads "
                f"(fix: --out {out_abs.parent / (out_abs.name + '-prepared')})"
            )
    for d in input_dirs:
        if d == out_abs or d in out_abs.parents:
            raise DataError(
                f"--out {out} is inside the input folder {d}: its token files would be read as input the next time "
                f"(fix: --out {d.parent / (d.name + '-prepared')})"
            )
    if out_abs.exists() and not out_abs.is_dir():
        raise DataError(f"--out {out} exists and is not a folder (fix: choose another --out; prepare replaces only its own folders)")
    if not out_abs.is_dir():
        return
    entries = sorted(p.name for p in out_abs.iterdir())
    if not entries:
        return
    foreign = foreign_files(out_abs)
    # A damaged manifest is prepare's where the folder also holds the tokenizer prepare writes: a user's own train.bin
    # beside some other tool's manifest.json is not taken for it.
    damaged_ours = damaged and (out_abs / "tokenizer" / "tokenizer.json").is_file()
    if foreign or not (our_manifest(manifest) or damaged_ours):
        what = _listing(foreign) if foreign else "a manifest.json prepare did not write"
        raise DataError(
            f"--out {out} is not empty and is not a prepared directory (it holds {what}); prepare never replaces "
            f"files it did not write (fix: choose a new or empty folder, e.g. --out {out_abs.parent / (out_abs.name + '-prepared')})"
        )
    if not force:
        m = manifest or {}
        tok = m.get("tokenizer") if isinstance(m.get("tokenizer"), dict) else {}
        sources = m.get("sources") if isinstance(m.get("sources"), list) else []
        raise DataError(
            f"--out {out} already holds data prepared from other inputs or settings ({len(sources)} source(s), tokenizer "
            f"vocab {tok.get('vocab_size', '?')}, created {m.get('created', '?')}); runs trained on it need it "
            "(fix: choose another --out, or add --force to replace it)"
        )


def _owner(folder: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def build_name(out: Path, key: str) -> Path:
    """Where the prepare of these inputs builds: the same name again after an interruption, so a
    re-run (or another task of a Slurm array) finds the finished pieces."""
    return out.parent / f".{out.name}.build-{key[:16]}"


def clean_leftovers(out: Path, key: str = "") -> list[str]:
    """Siblings of `out` left by a killed prepare on this host: builds of other inputs are removed (a
    build of these inputs is resumed), the old data moved aside before a crash is put back when
    `out` is missing. Returns what was done."""
    done: list[str] = []
    host = socket.gethostname()
    for kind in ("tmp", "build", "old"):
        prefix = f".{out.name}.{kind}-"
        # Compared as text, not as a pattern: --out data[12] matched data1's and data2's, and removed data2's only copy.
        for sib in sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix)) if out.parent.is_dir() else []:
            owner = _owner(sib)
            if owner is None or owner.get("host") != host or alive(int(owner.get("pid", 0))):
                continue  # not ours, another machine's, or a prepare still running
            if kind == "build" and sib == build_name(out, key):
                continue  # resumed below
            if kind == "old" and not out.exists():
                (sib / MARKER).unlink()
                sib.rename(out)
                done.append(f"restored {out} from an interrupted replacement")
            else:
                shutil.rmtree(sib, ignore_errors=True)
                done.append(f"removed {sib.name} left by an interrupted prepare (pid {owner.get('pid')})")
    return done


def start_build(out: Path, key: str) -> Path:
    """The hidden sibling of `out` this build writes into, marked as ours; an unfinished build of the
    same inputs is taken over with what it finished."""
    build = build_name(out, key)
    owner = _owner(build) if build.exists() else None
    if build.exists() and owner is None:
        raise DataError(f"{build} exists and is not a build of prepare's (fix: move it away)")
    if (
        owner is not None
        and owner.get("host") == socket.gethostname()
        and alive(int(owner.get("pid", 0)))
        and owner.get("pid") != os.getpid()
    ):
        raise DataError(f"another prepare (pid {owner.get('pid')}) is building {out} from the same inputs (fix: wait for it)")
    build.mkdir(exist_ok=True)
    _mark(build)
    return build


def _mark(folder: Path) -> None:
    (folder / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "created": time.time()}))


def finish_build(tmp: Path, out: Path) -> None:
    """Move the complete build into place. An existing `out` (already checked to be ours) is moved
    aside first and removed after the new one is in place."""
    if out.exists():
        foreign = foreign_files(out)
        if foreign:  # added while we were building
            raise DataError(f"--out {out} now holds {_listing(foreign)}, which prepare did not write (fix: move them, then run again)")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        _mark(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    (out / MARKER).unlink(missing_ok=True)
