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

FILE = "excluded_nodes.json"
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def record(run_dir: Path, node: str, why: str) -> None:
    """Keep `node` for the next requeue (once; the first reason stays)."""
    if not NODE_NAME.fullmatch(node):
        return
    kept = wanted(run_dir)
    if node in kept:
        return
    kept[node] = {"why": why, "at": time.time()}
    path = run_dir / FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(kept, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def wanted(run_dir: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads((run_dir / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and NODE_NAME.fullmatch(k) and isinstance(v, dict)}
