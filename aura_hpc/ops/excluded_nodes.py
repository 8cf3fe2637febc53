"""The nodes a run wants left out of its next start: where a rank hung, a straggler, a node that failed screening.

Kept in RUN_DIR/excluded_nodes.json (the node's Slurm name, why, when) by whoever names the node (the
Slurm watchdog, rank 0's straggler scores); slurm/exclude.py leaves them out of a requeued job.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from aura_hpc.ops.file_lock import lock_briefly

LOCK_WAIT_S = 10.0

FILE = "excluded_nodes.json"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def record(run_dir: Path, node: str, why: str) -> None:
    """Keep `node` for the next requeue (once; the first reason stays). Several nodes' watchdogs and rank 0 write
    here: under a lock, where the mount has locks (each read the file, added its node and renamed its copy over the
    other's, which lost one). A file that cannot be read (an NFS error) is never written over: OSError."""
    if not NODE_NAME.fullmatch(node):
        return
    path = run_dir / FILE
    fd = os.open(run_dir / f".{FILE}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        lock_briefly(fd, LOCK_WAIT_S)  # (rank 0 asks inside the training loop: never held up past it)
        kept = _read(path) if path.exists() else {}
        if node in kept:
            return
        kept[node] = {"why": why, "at": time.time()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(kept, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        os.close(fd)


def wanted(run_dir: Path) -> dict[str, dict[str, object]]:
    try:
        return _read(run_dir / FILE)
    except OSError:
        return {}


def _read(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise OSError(f"{path} is not the list aura_hpc writes ({exc}): left as it is") from None
    if not isinstance(data, dict):
        raise OSError(f"{path} is not the list aura_hpc writes: left as it is")
    return {k: v for k, v in data.items() if isinstance(k, str) and NODE_NAME.fullmatch(k) and isinstance(v, dict)}
