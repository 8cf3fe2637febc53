"""Atomic, self-verifying checkpoints: one directory per step.

    checkpoints/step_00000100/
        model/            config.json + model.safetensors (loadable by transformers)
        trainer_state.pt  optimizer, scheduler, RNG states (loaded with weights_only=True)
        meta.json         step, data position, tokens, config fingerprint, world size
        tokenizer/        the tokenizer the model was trained with
        config.yaml       the resolved run config
        COMPLETE.json     commit marker, written last: size and sha256 of every file above

Written into `.tmp-step_...` in the same parent, fsynced, then renamed: a crash at any point
leaves either the previous checkpoints untouched plus an ignored temp dir, or a complete one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aura_hpc.errors import CheckpointError

log = logging.getLogger("aura_hpc")

MARKER = "COMPLETE.json"
_NAME = re.compile(r"^step_(\d{8,})$")


@dataclass
class Checkpoint:
    path: Path
    step: int


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(
    root: Path,
    step: int,
    model: Any,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    tokenizer_dir: Path | None,
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Write checkpoint `step` atomically and prune to the newest `keep_last`. Rank 0 only."""
    from aura_hpc.train import faults

    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    _clean_stale_temps(root)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    run_dir = root.parent

    def stage(name: str) -> None:
        faults.checkpoint_stage(name, run_dir)

    try:
        tmp.mkdir()
        model.save_pretrained(str(tmp / "model"), safe_serialization=True)
        stage("model")
        buf = io.BytesIO()
        torch.save(trainer_state, buf)
        _write(tmp / "trainer_state.pt", buf.getvalue())
        stage("trainer_state")
        _write(tmp / "meta.json", json.dumps(meta, indent=2).encode())
        stage("meta")
        _write(tmp / "config.yaml", config_yaml.encode())
        stage("config")
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        stage("tokenizer")
        files: dict[str, dict[str, Any]] = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                _fsync(p)
                files[str(p.relative_to(tmp))] = {"size": p.stat().st_size, "sha256": _sha256(p)}
        for d in [tmp, *[p for p in tmp.rglob("*") if p.is_dir()]]:
            _fsync(d)
        stage("files")
        _write(tmp / MARKER, json.dumps({"step": step, "files": files}, indent=1).encode())
        stage("marker")
        _fsync(tmp)
        if final.exists():
            # The same step written again (after a rollback the weights differ): swap it in.
            old = root / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror or str(exc)
        fix = "free disk space" if exc.errno == errno.ENOSPC else "check the permissions and the filesystem"
        raise CheckpointError(
            f"could not write checkpoint {final.name} in {root} ({reason}); the previous checkpoints are intact "
            f"(fix: {fix}, then re-run the same command to resume)"
        ) from None
    prune(root, keep_last)
    return final


def _clean_stale_temps(root: Path) -> None:
    """Partial checkpoints from a crash mid-save; only the writer (rank 0) is ever here."""
    for p in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
        if p.is_dir() and not p.name.endswith(f"-{os.getpid()}"):
            log.info("removing partial checkpoint %s left by an interrupted save", p.name)
            shutil.rmtree(p, ignore_errors=True)


def list_complete(root: Path) -> list[Checkpoint]:
    """Committed checkpoints, newest first (not yet content-verified)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / MARKER).exists():
                out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step, reverse=True)


def _eval_loss(ckpt: Checkpoint) -> float | None:
    try:
        value = json.loads((ckpt.path / "meta.json").read_text()).get("eval_loss")
    except (OSError, json.JSONDecodeError):
        return None
    return float(value) if value is not None else None


def best(root: Path) -> Checkpoint | None:
    """The complete checkpoint with the lowest validation loss, if any recorded one."""
    scored = [(loss, c) for c in list_complete(root) if (loss := _eval_loss(c)) is not None]
    return min(scored, key=lambda x: (x[0], -x[1].step))[1] if scored else None


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` and the best by validation loss."""
    keep_best = best(root)
    for ckpt in list_complete(root)[keep_last:]:
        if keep_best is None or ckpt.path != keep_best.path:
            shutil.rmtree(ckpt.path, ignore_errors=True)


def verify(ckpt: Path) -> str | None:
    """None when every file matches its marker entry; otherwise what is wrong."""
    try:
        marker = json.loads((ckpt / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable commit marker ({exc})"
    for rel, want in marker.get("files", {}).items():
        p = ckpt / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != want["size"]:
            return f"{rel} has {p.stat().st_size} bytes, expected {want['size']}"
        if _sha256(p) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def newest_valid(root: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies; corrupt newer ones are reported and set aside."""
    complete = list_complete(root)
    newest_complete = complete[0].step if complete else -1
    if root.is_dir():
        for p in sorted(root.iterdir()):
            m = _NAME.match(p.name)
            if m and p.is_dir() and not (p / MARKER).exists() and int(m.group(1)) > newest_complete:
                log.warning("checkpoint %s has no %s (its save was interrupted): ignored", p.name, MARKER)
    for ckpt in complete:
        problem = verify(ckpt.path)
        if problem is None:
            return ckpt
        aside = root / f"corrupt-{ckpt.path.name}-{int(time.time())}"
        with contextlib.suppress(OSError):
            ckpt.path.rename(aside)
        log.warning("checkpoint %s is corrupt (%s); moved it to %s and using the previous one", ckpt.path.name, problem, aside.name)
    return None


def read_payload(ckpt: Path) -> dict[str, bytes]:
    """The raw bytes a resuming rank needs (lets rank 0 ship them to ranks without shared storage)."""
    return {
        "model": (ckpt / "model" / "model.safetensors").read_bytes(),
        "trainer_state": (ckpt / "trainer_state.pt").read_bytes(),
        "meta": (ckpt / "meta.json").read_bytes(),
    }


def decode_payload(payload: dict[str, bytes]) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load as load_safetensors

    try:
        weights = load_safetensors(payload["model"])
        # weights_only: a checkpoint is data, never code.
        state = torch.load(io.BytesIO(payload["trainer_state"]), map_location="cpu", weights_only=True)
        meta = json.loads(payload["meta"])
    except Exception as exc:  # any decoding failure means the same thing to the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint could not be loaded safely ({type(exc).__name__}: {first[:200]}) "
            "(fix: move that checkpoint directory away to resume from the previous one)"
        ) from None
    return weights, state, meta


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]}) "
            "(fix: resume with the config the run was started with, or use a new --run-name)"
        )
