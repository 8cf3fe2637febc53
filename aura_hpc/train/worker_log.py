"""Plain, rank-prefixed log lines to stdout and to logs/rank_<R>.log in the run directory."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("aura_hpc")


def setup(log_dir: Path | None, rank: int, stream_handler: logging.Handler | None = None) -> logging.Logger:
    fmt = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = stream_handler or logging.StreamHandler(sys.stdout)
    handler.setFormatter(fmt)
    log.addHandler(handler)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        # Appended, not truncated: a resumed run's log shows every attempt.
        fh = logging.FileHandler(log_dir / f"rank_{rank}.log", mode="a", encoding="utf-8")
        fh.setFormatter(fmt)
        log.addHandler(fh)
    return log
