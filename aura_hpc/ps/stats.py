"""Per-process statistics of a parameter-server run: RUN_DIR/stats/<host>_<role>_<start time>.json.

Rewritten atomically as the process goes (a crash leaves the last complete one); workers also put
theirs in the server's store, and the server copies them into its own run directory.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ProcessStats:
    role: str  # "ps" or "worker"
    rank: int  # 0 for the server
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None
    steps: int = 0  # server: updates applied; worker: gradients sent
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    mean_round_trip_ms: float = 0.0  # worker: gradient sent -> weights back; server: mean over its workers
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def file_name(self) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.start_time))
        who = "ps" if self.role == "ps" else f"worker{self.rank}"
        return f"{self.host}_{who}_{stamp}.json"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def write_stats(run_dir: Path, text: str, name: str) -> Path:
    folder = run_dir / "stats"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def copy_worker_stats(store: Any, ticket: int, run_dir: Path, final_within_s: float = 0.0) -> str | None:
    """Copy a worker's newest stats from the server's store into the run directory; None, or what failed.
    A worker that leaves in order publishes its final ones around its last message: those are waited for."""
    key = f"stats/{ticket}"
    deadline = time.monotonic() + final_within_s
    try:
        while not store.check([f"{key}/final"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if store.check([key]):
            write_stats(run_dir, store.get(key).decode(), store.get(f"{key}/name").decode())
    except (RuntimeError, OSError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def add_link_totals(s: ProcessStats, links: list[Any]) -> None:
    """The server's traffic over every worker link it has had (ps/wire.py Link)."""
    s.bytes_sent = sum(link.bytes_sent for link in links)
    s.bytes_received = sum(link.bytes_received for link in links)
    s.round_trips = sum(link.round_trips for link in links)
    # The server's side of a round trip: gradient received -> new weights sent.
    s.mean_round_trip_ms = 1000.0 * sum(link.round_trip_s for link in links) / s.round_trips if s.round_trips else 0.0
