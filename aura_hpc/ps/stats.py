"""Per-process statistics of a parameter-server run: RUN_DIR/stats/<host>_<role>_<start time>.json.

Rewritten atomically as the process goes (a crash leaves the last complete one); workers also put
theirs in the server's store, signed with the run's secret, and the server copies them into its own
run directory under a name it makes itself from values it checked (never a name from the store).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.ps import auth


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
        return stats_name(self.host, "ps" if self.role == "ps" else f"worker{self.rank}", self.start_time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def stats_name(host: str, who: str, start_time: float) -> str:
    """A file name from a host name (anything but letters, digits, '.' and '-' becomes '-'), a role and a time."""
    safe = re.sub(r"[^A-Za-z0-9.-]", "-", host)[:64].strip(".") or "host"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(start_time))
    return f"{safe}_{who}_{stamp}.json"


MAX_STATS_BYTES = 64 * 1024


def write_stats(run_dir: Path, text: str, name: str) -> Path:
    if "/" in name or name.startswith(".") or not name.endswith(".json"):
        raise ValueError(f"not a stats file name: {name[:40]!r}")
    folder = run_dir / "stats"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def publish(store: Any, key: bytes, nonce: str, text: str, final: bool) -> None:
    """A worker's stats into the server's store, signed (the server believes nothing unsigned there)."""
    store.set(f"stats/{nonce}", json.dumps({"body": text, "mac": auth.tag(key, "stats", nonce, text)}))
    if final:
        store.set(f"stats/{nonce}/final", auth.tag(key, "stats-final", nonce))


def _checked_stats(raw: bytes, key: bytes, nonce: str, rank: int) -> dict[str, Any]:
    if len(raw) > MAX_STATS_BYTES:
        raise ValueError(f"{len(raw)} bytes")
    outer = json.loads(raw)
    body = outer["body"]
    if not auth.valid(key, outer.get("mac"), "stats", nonce, body):
        raise ValueError("not signed with the run's secret")
    d = json.loads(body)
    if not isinstance(d, dict):
        raise ValueError("not an object")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(ProcessStats):
        v = d.get(f.name)
        if f.name == "extra":
            out[f.name] = v if isinstance(v, dict) else {}
        elif v is None or (isinstance(v, (int, float, str)) and not isinstance(v, bool)):
            out[f.name] = v[:200] if isinstance(v, str) else v
    out["role"], out["rank"] = "worker", rank  # what the server knows, not what the worker says
    return out


def copy_worker_stats(
    store: Any, key: bytes, nonce: str, seat_host: str, rank: int, joined: float, run_dir: Path, final_within_s: float = 0.0
) -> str | None:
    """Copy a worker's newest signed stats from the server's store into the run directory, under a
    name made here from the seat (checked host, rank, join time); None, or what failed. A worker
    that leaves in order publishes its final ones around its last message: those are waited for."""
    base = f"stats/{nonce}"
    deadline = time.monotonic() + final_within_s
    try:
        while time.monotonic() < deadline:
            if store.check([f"{base}/final"]) and auth.valid(
                key, store.get(f"{base}/final").decode("ascii", "replace"), "stats-final", nonce
            ):
                break
            time.sleep(0.05)
        if store.check([base]):
            stats = _checked_stats(store.get(base), key, nonce, rank)
            start = stats.get("start_time")
            # The worker's start time names the file (as the worker names its own copy) when it is plausible.
            plausible = isinstance(start, (int, float)) and time.time() - 366 * 86400 < start < time.time() + 86400
            write_stats(run_dir, json.dumps(stats, indent=1), stats_name(seat_host, f"worker{rank}", start if plausible else joined))
            for k in (base, f"{base}/final"):  # its copy is here: its keys leave the store
                store.delete_key(k)
    except (RuntimeError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
    return None


def add_link_totals(s: ProcessStats, links: list[Any]) -> None:
    """The server's traffic over every worker link it has had (ps/wire.py Link)."""
    s.bytes_sent = sum(link.bytes_sent for link in links)
    s.bytes_received = sum(link.bytes_received for link in links)
    s.round_trips = sum(link.round_trips for link in links)
    # The server's side of a round trip: gradient received -> new weights sent.
    s.mean_round_trip_ms = 1000.0 * sum(link.round_trip_s for link in links) / s.round_trips if s.round_trips else 0.0


def write_server_stats(s: ProcessStats, run_dir: Path, version: int, tokens: int, links: list[Any], extra: dict[str, Any]) -> None:
    s.steps, s.tokens, s.extra = version, tokens, extra
    add_link_totals(s, links)
    write_stats(run_dir, s.to_json(), s.file_name)
