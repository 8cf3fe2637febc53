"""What in a checkpoint's step folder this run wrote, and what it did not: a user's notes, an export, a model card
put beside the weights for the Hub. A save never replaces, and a prune never removes, a folder holding the latter
(a re-save of a step after a rollback swapped the folder out and deleted the user's files with it; so did a prune)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from aura_hpc.errors import CheckpointWriteError

log = logging.getLogger("aura_hpc")

MARKER = "COMPLETE.json"
# What a step folder of ours holds at its top (writer.py's SHARDS: sharded strategies' per-rank files).
OURS = {MARKER, "meta.json", "trainer_state.pt", "model", "config.yaml", "tokenizer", "sharded"}
# The marker, and what a consolidation adds to a committed sharded checkpoint (consolidate.py), with its parts.
_CONSOLIDATED = {"model/model.safetensors", MARKER}


def not_ours(folder: Path) -> list[str]:
    """The files in step folder `folder` this run did not write, relative and sorted; [] for a folder of ours alone.
    A committed folder's are those its marker does not list. Without a readable marker (a save interrupted, or a
    folder never ours) they are the names at its top that our save never writes."""
    try:
        listed = set(json.loads((folder / MARKER).read_text())["files"])
    except FileNotFoundError:
        return _unlisted_at_top(folder)
    except OSError as exc:
        # There but unread at this moment (ESTALE on NFS while another node rewrites it): what it lists is not known, so
        # nothing in the folder is taken for ours (the names at the top alone passed a user's model/README.md).
        return [f"{MARKER} (unreadable: {exc.strerror or type(exc).__name__})"]
    except (ValueError, KeyError, TypeError):
        return _unlisted_at_top(folder)
    # The full weights a consolidation puts in place are ours before the marker that lists them is rewritten (one
    # interrupted between the two left them unlisted).
    listed |= _CONSOLIDATED
    found = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_dir() and not p.is_symlink():
            # An empty folder that none of our saves makes (a user's, for files to come) went with a pruned checkpoint.
            if rel not in OURS and _empty(p):
                found.append(f"{rel}/")
            continue
        # `.nfsXXXX`: an NFS client's name for a file of ours deleted while a reader held it open; it goes at the close.
        if rel in listed or _part_of_listed(rel, listed) or p.name.startswith(".nfs"):
            continue
        found.append(rel)
    return sorted(found)


def _empty(folder: Path) -> bool:
    try:
        return next(folder.iterdir(), None) is None
    except OSError:  # gone meanwhile (a prune of its own run on another node): nothing of a user's to keep
        return False


def _unlisted_at_top(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in OURS and not p.name.startswith(".nfs"))


def _part_of_listed(rel: str, listed: set[str]) -> bool:
    """A consolidation's part beside the file it is writing (consolidate.py: `.NAME.SPACE.PID.tmp`)."""
    folder, _, name = rel.rpartition("/")
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    siblings = (f.rpartition("/") for f in listed)
    return any(where == folder and name.startswith(f".{sibling}.") for where, _, sibling in siblings)


_KEPT_SAID: set[Path] = set()


def holds_files_not_ours(ckpt: Path) -> bool:
    """True, and said (once per process, not at every save), when a checkpoint prune would remove holds files this
    run did not write: it is kept whole."""
    extra = not_ours(ckpt)
    if extra and ckpt not in _KEPT_SAID:
        _KEPT_SAID.add(ckpt)
        log.warning(
            "checkpoint %s is past train.keep_last but holds files this run did not write (%s): kept whole "
            "(fix: move them out of it; the next save removes it)",
            ckpt.name,
            said(extra),
        )
    return bool(extra)


def said(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def refuse_replacing(final: Path) -> None:
    """Raise when a save of a step would replace `final`, and `final` is not only ours: checked before anything is
    written (the write of a large model would be time lost), and again just before the swap."""
    root = final.parent
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        kind = "a link" if final.is_symlink() else "a file"
        raise CheckpointWriteError(
            f"{final} is {kind}, not a checkpoint folder this run wrote, and it was not replaced "
            f"(fix: move it out of {root}, then re-run the same command to resume)"
        )
    if not final.is_dir() or not (extra := not_ours(final)):
        return
    if not (final / MARKER).is_file():
        raise CheckpointWriteError(
            f"{final} holds no {MARKER}, so it is no checkpoint this run committed, and it was not replaced "
            f"(fix: move it out of {root}, then re-run the same command to resume)"
        )
    raise CheckpointWriteError(
        f"{final} holds files this run did not write ({said(extra)}), so a new save of its step did not replace it "
        f"(fix: move those files out of {final.name}, then re-run the same command to resume)"
    )
