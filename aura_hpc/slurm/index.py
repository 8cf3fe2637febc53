"""Which run directory a job id belongs to: run_dir/job.json, plus a per-user index of submissions."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from aura_hpc.errors import LaunchError
from aura_hpc.ops.file_lock import lock_briefly


def index_path() -> Path:
    return Path(os.environ.get("AURA_HPC_HOME") or Path.home() / ".aura_hpc") / "jobs.jsonl"


def record(job_id: str, run_dir: Path, name: str, submitted: str, log_dir: Path | None = None, world_size: int | None = None) -> None:
    """One line per submitted job. Its logs' folder and world size are kept here too: a resume submits the same run
    again and job.json then names the new job, which left the earlier job's logs out of reach."""
    path = index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    entry: dict[str, Any] = {"job_id": job_id, "run_dir": str(run_dir), "name": name, "submitted": submitted}
    if log_dir is not None:
        entry.update(log_dir=str(log_dir), world_size=world_size)
    line = json.dumps(entry)
    with path.open("a", encoding="utf-8") as f:
        # O_APPEND alone is not atomic on NFS (open(2)), where ~/.aura_hpc usually is on a cluster: two login
        # nodes' submits wrote at one offset and a job lost its line. A POSIX lock orders them, and taking it makes
        # the NFS client read the file's size afresh. Never holding up a submit whose job is queued already: 5 s.
        lock_briefly(f, 5.0)
        f.write(line + "\n")
        f.flush()  # before the lock goes with the file's closing


def entries() -> list[dict[str, Any]]:
    try:
        lines = index_path().read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def run_dirs() -> dict[str, Path]:
    """Each job id's run directory, from the newest submission with it (ids restart when a cluster is rebuilt). Read
    once per command: `status` and `history` asked the whole file again for each row (26 s for 1,000 rows)."""
    return {str(e["job_id"]): Path(e["run_dir"]) for e in entries() if isinstance(e.get("run_dir"), str) and "job_id" in e}


def run_dir_of(job_id: str) -> Path | None:
    return run_dirs().get(job_id)


def read_job_file(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "job.json"
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LaunchError(
            f"{run_dir} holds no job.json: it was not submitted with `submit` (fix: pass a job id or a submitted run directory)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = {}
    if not isinstance(data, dict) or not str(data.get("job_id", "")).replace("_", "").isdigit() or not data.get("log_dir"):
        raise LaunchError(f"{path} is damaged (not the record submit writes) (fix: pass the job id that submit printed)")
    return data


def resolve(target: str) -> tuple[str, Path | None, dict[str, Any] | None]:
    """JOB or RUN_DIR -> (job id, run dir if known, job.json if known)."""
    p = Path(target).expanduser()
    if p.is_dir():
        info = read_job_file(p)
        return str(info["job_id"]), p.resolve(), info
    if re.fullmatch(r"\d+_\[[\d,\-%]+\]", target):  # squeue's row of an array's pending elements
        raise LaunchError(
            f"{target} names several elements of array {target.split('_')[0]} (fix: pass {target.split('_')[0]} for the whole "
            f"array, or one element such as {target.split('_')[0]}_{re.findall(r'[0-9]+', target.split('_', 1)[1])[0]})"
        )
    if not target.replace("_", "").isdigit():
        raise LaunchError(f"{target!r} is neither a job id nor a run directory (fix: pass the id `submit` printed, or RUN_DIR)")
    run_dir = run_dir_of(target)
    info = None
    if run_dir is not None and (run_dir / "job.json").exists():
        info = read_job_file(run_dir)
        if str(info.get("job_id")) != target:
            info = _replaced_job(target, run_dir, info)
    return target, run_dir, info


def _replaced_job(job_id: str, run_dir: Path, newer: dict[str, Any]) -> dict[str, Any] | None:
    """An earlier job of a run that was submitted again (a resume), as its own index line describes it, with
    `superseded_by`: the job job.json names now. None where the index knows no such job of this run."""
    entry = next((e for e in reversed(entries()) if str(e.get("job_id")) == job_id and e.get("run_dir") == str(run_dir)), None)
    if entry is None:
        return None
    world = entry.get("world_size")
    return {
        "job_id": job_id,
        "job_name": str(entry.get("name") or ""),
        # Lines written before they carried it: a run's jobs log to the folder its job.json names, unless a job was a
        # sweep's point (its logs in the sweep's folder): a guess, which no verdict on the job is drawn from.
        "log_dir": str(entry.get("log_dir") or newer["log_dir"]),
        "log_dir_guessed": not entry.get("log_dir"),
        "world_size": world if isinstance(world, int) else None,
        "submitted": str(entry.get("submitted") or ""),
        "superseded_by": str(newer["job_id"]),
    }
