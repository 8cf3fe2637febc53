"""What the parameter server records: metrics rows, the staleness distribution, per-worker
contributions, and checkpoints `last` and `best` in the same atomic format as `local`.

checkpoints/step_<version>/ are train/checkpoint/files.py's directories (written to a temp folder,
fsynced, renamed, with COMPLETE.json); `checkpoints/last` and `checkpoints/best` are symlinks
to the newest and to the lowest-validation-loss one, each swapped in by an atomic rename.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aura_hpc.config import RunConfig
from aura_hpc.errors import CheckpointError
from aura_hpc.ps.model_copy import ModelCopy
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.parts.schedule import apply_settings

log = logging.getLogger("aura_hpc")

MODE = "ps"


@dataclass
class Interval:
    """The updates since the last metrics row."""

    losses: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    tokens: int = 0
    dropped: int = 0
    contributions: Counter[int] = field(default_factory=Counter)

    def count(self, hist: Counter[str], rank: int, staleness: int, loss: float, tokens: int) -> None:
        """One applied update, in this interval and in the run's staleness histogram."""
        self.tokens += tokens
        self.losses.append(loss)
        self.staleness.append(staleness)
        self.contributions[rank] += 1
        hist[str(staleness)] += 1


@dataclass
class Resumed:
    version: int
    tokens: int
    positions: dict[int, int]
    best_eval: float | None
    staleness: dict[str, int]
    path: Path


def _link(root: Path, name: str, target: Path) -> None:
    tmp = root / f".{name}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    tmp.replace(root / name)


def meta(
    tokens: int,
    positions: dict[int, int],
    best_eval: float | None,
    hist: Counter[str],
    max_steps: int,
    workers: int,
    eval_loss: float | None,
) -> dict[str, Any]:
    """What a parameter-server checkpoint records beside the weights (meta.json)."""
    out: dict[str, Any] = {
        "tokens_seen": tokens,
        "positions": {str(k): v for k, v in positions.items()},
        "best_eval": best_eval,
        "staleness": dict(hist),
        "max_steps": max_steps,
        "world_size": workers,
    }
    if eval_loss is not None:
        out["eval_loss"] = eval_loss
    return out


def save(
    cfg: RunConfig,
    model_copy: ModelCopy,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    version: int,
    meta: dict[str, Any],
) -> Path:
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    return save_state(cfg, model_copy.model, model_copy.data.tokenizer_dir, state, version, meta)


def save_state(cfg: RunConfig, model: Any, tokenizer_dir: Path | None, state: dict[str, Any], version: int, meta: dict[str, Any]) -> Path:
    """A checkpoint of `model` and the optimizer and schedule `state` (a snapshot's, ps/off_lock.py, or the live ones)."""
    root = cfg.run_dir / "checkpoints"
    full_meta = {
        "step": version,
        "version": version,
        "mode": MODE,
        "fingerprint": cfg.model_fingerprint(),
        "train_lr": cfg.train.lr,
        **meta,
    }
    path = checkpoint.save(root, version, model, state, full_meta, tokenizer_dir, cfg.to_yaml(), max(cfg.train.keep_last, 1))
    _link(root, "last", path)
    best = checkpoint.best(root)
    if best is not None:
        _link(root, "best", best.path)
    return path


def resume(cfg: RunConfig, model_copy: ModelCopy, optimizer: torch.optim.Optimizer, scheduler: Any) -> Resumed | None:
    """Load the newest valid checkpoint of the run directory (`last`, or an older one if it is corrupt)."""
    ckpt = checkpoint.newest_valid(cfg.run_dir / "checkpoints")
    if ckpt is None:
        return None
    meta = checkpoint.read_meta(ckpt.path)
    if meta.get("mode") != MODE:
        raise CheckpointError(
            f"run directory {cfg.run_dir} holds checkpoints of a `local`/`submit` run, not of a parameter server "
            "(fix: another --run-name for the parameter-server run)"
        )
    if meta.get("fingerprint") != cfg.model_fingerprint():
        raise CheckpointError(
            f"checkpoint {ckpt.path.name} is of another model shape or data.seq_len than this config "
            "(fix: resume with the config the run was started with, or use a new --run-name)"
        )
    was = meta.get("world_size")
    if isinstance(was, int) and was != cfg.ps.workers:
        # Each worker's saved position counts sequences of its own shard: 1 of 3 is not 1 of 1 (a third
        # of the data again, the rest never).
        raise CheckpointError(
            f"checkpoint {ckpt.path.name} was written with --workers {was} and this server has --workers {cfg.ps.workers}: "
            f"the data is split into {was} parts there (fix: resume with --workers {was}, or a new --run-name)"
        )
    checkpoint.load_weights_from(ckpt.path, model_copy.model)
    state = checkpoint.read_trainer_state(ckpt.path)
    optimizer.load_state_dict(state["optimizer"])
    checkpoint.own_cpu_tensors(optimizer)  # out of the mapped file: a pruned checkpoint's space is freed
    scheduler.load_state_dict(state["scheduler"])
    # The config's learning rate, weight decay and betas over the checkpoint's, as `local` takes them: a re-run with a
    # lower train.lr (a divergence's fix) trained on at the old one.
    apply_settings(optimizer, scheduler, cfg.train, meta.get("train_lr"))
    return Resumed(
        version=int(meta["version"]),
        tokens=int(meta.get("tokens_seen", 0)),
        positions={int(k): int(v) for k, v in meta.get("positions", {}).items()},
        best_eval=meta.get("best_eval"),
        staleness={str(k): int(v) for k, v in meta.get("staleness", {}).items()},
        path=ckpt.path,
    )


def staleness_text(hist: Counter[str]) -> str:
    """'0:12 1:30 2:5 dropped:1' — how many gradients arrived how many versions late."""
    numbers = sorted((k for k in hist if k.isdigit()), key=int)
    parts = [f"{k}:{hist[k]}" for k in numbers]
    if hist.get("dropped"):
        parts.append(f"dropped:{hist['dropped']}")
    return " ".join(parts) or "none yet"


def metrics_row(version: int, lr: float, interval: Interval, seconds: float, workers: int, hist: Counter[str]) -> dict[str, Any]:
    st = interval.staleness
    row: dict[str, Any] = {
        "step": version,
        "version": version,
        "loss": sum(interval.losses) / len(interval.losses) if interval.losses else None,
        "lr": lr,
        "tokens_per_s": interval.tokens / seconds if seconds > 0 else 0.0,
        "staleness_mean": sum(st) / len(st) if st else 0.0,
        "staleness_max": max(st) if st else 0,
        "dropped": interval.dropped,
        "workers": workers,
        "contributions": {str(k): v for k, v in sorted(interval.contributions.items())},
        "staleness_hist": dict(hist),
    }
    return row


def progress_line(row: dict[str, Any], max_steps: int, hist: Counter[str]) -> str:
    loss, eval_loss = row["loss"], row.get("eval_loss")
    return (
        f"version {row['version']}/{max_steps} loss {f'{loss:.4f}' if loss is not None else '-'}"
        + (f" eval {eval_loss:.4f}" if eval_loss is not None else "")
        + (
            f" (of version {row['eval_version']})"
            if eval_loss is not None and row.get("eval_version", row["version"]) != row["version"]
            else ""
        )
        + f" | {row['tokens_per_s']:.0f} tokens/s | workers {row['workers']} | staleness {staleness_text(hist)}"
    )


def summary(run_dir: Path, version: int, max_steps: int, tokens: int, best_eval: float | None, hist: Counter[str], text: str) -> None:
    data = {
        "mode": MODE,
        "step": version,
        "max_steps": max_steps,
        "finished": version >= max_steps,
        "tokens_seen": tokens,
        "best_eval": best_eval,
        "staleness": dict(hist),
        "checkpoint": str(run_dir / "checkpoints" / "last"),
        "metrics": str(run_dir / "metrics.jsonl"),
        "sample": text,
    }
    (run_dir / "summary.json").write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
