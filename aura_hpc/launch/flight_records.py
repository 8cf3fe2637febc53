"""Torch's flight records, read back: which rank never entered, or never finished, which collective.

torch's flight recorder keeps each rank's last collectives: per process group, the sequence number of
the last one enqueued, started and completed, and for each its name, sizes and the Python frames that
made it. NCCL's is dumped by its monitor thread through the pipe the watchdog writes into; gloo's
(torch >= 2.13) by our worker's own thread (train/process/flight_dump.py), through the same pipe. The
dumps are pickles: they are read with an unpickler that looks up no class, so a record holds nothing
but plain values (a dump on a shared run directory is another node's file, not our own).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A record of 2,000 collectives with their frames is a few MB; anything far larger is not one.
MAX_RECORD_BYTES = 64 << 20


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight record names {module}.{name}; only plain values are read")


def load(path: Path) -> dict[str, Any] | None:
    """One rank's dump, or None when it is missing, too large or not a plain record."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None
        data = path.read_bytes()
        record = _PlainUnpickler(io.BytesIO(data)).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("entries", []), list) else None


@dataclass
class Stuck:
    """What the flight records say: the ranks that hold the others up, at which collective of which group."""

    line: str
    culprits: list[int]
    group: str
    seq: int
    op: str

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "culprits": self.culprits, "group": self.group, "seq": self.seq, "op": self.op}


def _int(value: Any, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _group_names(record: dict[str, Any]) -> dict[str, str]:
    """This rank's group ids (a per-process counter: a rank outside a group never makes it, so the same
    group has other ids on other ranks) to the groups' names, which every rank shares."""
    names: dict[str, str] = {}
    for e in _entries(record):
        pg = e.get("process_group")
        if isinstance(pg, (list, tuple)) and pg and isinstance(pg[0], str):
            names.setdefault(str(e.get("pg_id")), pg[0])
    return names


def _default_group(record: dict[str, Any]) -> str | None:
    for e in _entries(record):
        pg = e.get("process_group")
        if isinstance(pg, (list, tuple)) and len(pg) > 1 and pg[1] == "default_pg" and isinstance(pg[0], str):
            return pg[0]
    return None


def _status(record: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per group name: the last collective enqueued, started and completed (from the entries when the
    record has no pg_status, as older releases write)."""
    names = _group_names(record)
    status = record.get("pg_status")
    out: dict[str, dict[str, int]] = {}
    if isinstance(status, dict):
        for pg, s in status.items():
            if isinstance(s, dict) and str(pg) in names:
                out[names[str(pg)]] = {k: _int(s.get(f"last_{k}_collective")) for k in ("enqueued", "started", "completed")}
        if out:
            return out
    for e in _entries(record):
        if e.get("is_p2p") or str(e.get("pg_id")) not in names:
            continue
        s = out.setdefault(names[str(e.get("pg_id"))], {"enqueued": -1, "started": -1, "completed": -1})
        seq = _int(e.get("collective_seq_id"))
        s["enqueued"] = max(s["enqueued"], seq)
        if e.get("state") in ("started", "completed"):
            s["started"] = max(s["started"], seq)
        if e.get("state") == "completed" or e.get("retired"):
            s["completed"] = max(s["completed"], seq)
    return out


def _members(records: dict[int, dict[str, Any]], group: str) -> set[int] | None:
    """The ranks of a group where a record says (NCCL's pg_config lists them; gloo's does not); else None."""
    for record in records.values():
        config = record.get("pg_config")
        entry = config.get(group) if isinstance(config, dict) else None
        ranks = entry.get("ranks") if isinstance(entry, dict) else None
        if isinstance(ranks, str):
            try:
                parsed = [int(x) for x in ranks.strip("[] ").split(",") if x.strip()]
            except ValueError:
                continue
            if parsed:
                return set(parsed)
    return None


def _entries(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in record.get("entries", []) if isinstance(e, dict)]


def _entry(records: dict[int, dict[str, Any]], group: str, seq: int) -> dict[str, Any] | None:
    for record in records.values():
        for e in _entries(record):
            pg = e.get("process_group")
            named = isinstance(pg, (list, tuple)) and bool(pg) and pg[0] == group
            if named and _int(e.get("collective_seq_id")) == seq and not e.get("is_p2p"):
                return e
    return None


def _where(entry: dict[str, Any] | None) -> str:
    """The innermost frame of ours that made the collective ("step.py:123"), else the innermost one."""
    frames = [f for f in (entry or {}).get("frames", []) if isinstance(f, dict)]
    ours = next((f for f in frames if "aura_hpc/" in str(f.get("filename", ""))), frames[0] if frames else None)
    if ours is None:
        return ""
    path = str(ours.get("filename", "?"))
    path = path.split("aura_hpc/", 1)[1] if "aura_hpc/" in path else path.rsplit("/", 1)[-1]
    return f"{path[:120]}:{_int(ours.get('line'), 0)} in {str(ours.get('name', '?'))[:60]}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def judge(records: dict[int, dict[str, Any]], asked: list[int]) -> Stuck | None:
    """The first group where the ranks' records part: ranks that never entered the collective their peers
    wait in, else ranks that entered it and never finished it. `asked`: every rank whose record was asked
    for (one without a record is named as such, never as a culprit by itself)."""
    status = {r: _status(rec) for r, rec in records.items()}
    default = next((d for rec in records.values() if (d := _default_group(rec)) is not None), None)
    groups = sorted({pg for s in status.values() for pg in s}, key=lambda g: (g != default, g))
    silent = sorted(set(asked) - set(records))
    never = {"enqueued": -1, "started": -1, "completed": -1}
    for pg in groups:
        # A group appears in a rank's status only once that rank entered its first collective: a member that
        # never did (the culprit at a group's first use) is counted at -1, where membership is known.
        members = set(records) if pg == default else (_members(records, pg) or set()) & set(records)
        have = {r: s.get(pg, never) for r, s in status.items() if pg in s or r in members}
        top = max(s["enqueued"] for s in have.values())
        if top < 0:
            continue
        entry = _entry(records, pg, top)
        op = str((entry or {}).get("profiling_name", "a collective"))[:60]
        name = f"{op} #{top} of group {pg}"
        behind = sorted(r for r, s in have.items() if s["enqueued"] < top)
        if behind:
            inside = sorted(set(have) - set(behind))
            at = _where(entry)
            line = f"{_ranks(behind)} never entered {name} ({_ranks(inside)} did{f', at {at}' if at else ''})"
            return Stuck(line + _no_record(silent), behind, pg, top, op)
        unfinished = sorted(r for r, s in have.items() if s["completed"] < top)
        # gloo marks a collective completed when its work is next cleaned up, not when it ends: only NCCL's
        # completion (read from the device's events) tells a finished rank from one still inside.
        if unfinished and len(unfinished) < len(have) and not op.startswith("gloo:"):
            line = f"{_ranks(unfinished)} entered {name} and never finished it (the others did){_no_record(silent)}"
            return Stuck(line, unfinished, pg, top, op)
        if unfinished and silent:
            waiting = sorted(have)
            return Stuck(f"{_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} in {name}{_no_record(silent)}", [], pg, top, op)
    return None


def _no_record(silent: list[int]) -> str:
    return f"; {_ranks(silent)} gave no record" if silent else ""


def read_kept(where: Path, kept: dict[int, str]) -> dict[int, dict[str, Any]]:
    """The records copied into a hang's folder (file names by rank), read back by rank."""
    return {r: record for r, name in kept.items() if (record := load(where / name)) is not None}
