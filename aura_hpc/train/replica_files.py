"""DiLoCo's per-rank files: each rank's own weights and AdamW moments, written by that rank into its
own run directory (LAN machines need no shared storage), checked on resume against the checksums
rank 0 recorded in the checkpoint's meta.json."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from aura_hpc.train.checkpoint import HashingFile, sha256_of, step_dir_name

REPLICAS = "replicas"  # DiLoCo: each rank's own state, beside the step folders of its run directory


def write_replica(root: Path, step: int, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's replica state, atomically: {file, size, sha256} for rank 0's meta.json."""
    folder = root / REPLICAS
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{step_dir_name(step)}.rank{rank}.pt"
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        hashing = HashingFile(f)
        torch.save(state, hashing)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(folder / name)
    return {"file": name, "size": (folder / name).stat().st_size, "sha256": hashing.h.hexdigest()}


def read_replica(root: Path, info: dict[str, Any]) -> dict[str, Any] | None:
    """A replica file that matches what rank 0 recorded, loaded; None when absent or different."""
    name = str(info.get("file", ""))
    path = root / REPLICAS / name
    if "/" in name or not path.is_file() or path.stat().st_size != info.get("size") or sha256_of(path) != info.get("sha256"):
        return None
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception:
        return None


def prune_replicas(root: Path, rank: int, keep: int) -> None:
    files = sorted((root / REPLICAS).glob(f"step_*.rank{rank}.pt"))
    for f in files[:-keep] if keep else []:
        f.unlink(missing_ok=True)
