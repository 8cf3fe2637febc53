"""Atomic, self-verifying checkpoints: one directory per step.

    checkpoints/step_00000100/
        model/            config.json + model.safetensors + the tokenizer's files (loadable by transformers alone)
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
import copy
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aura_hpc.data.prepare import sha256_file as _sha256
from aura_hpc.errors import CheckpointError, CheckpointWriteError
from aura_hpc.ops.disk import disk_full, disk_of
from aura_hpc.train.checkpoint.durable_io import HashingFile as HashingFile
from aura_hpc.train.checkpoint.durable_io import copy_hashed
from aura_hpc.train.checkpoint.durable_io import fsync as fsync
from aura_hpc.train.checkpoint.durable_io import write_synced as _write
from aura_hpc.train.checkpoint.ownership import MARKER as MARKER
from aura_hpc.train.checkpoint.ownership import holds_files_not_ours, refuse_replacing
from aura_hpc.train.checkpoint.reading import load_weights as load_weights
from aura_hpc.train.checkpoint.reading import load_weights_from as load_weights_from
from aura_hpc.train.checkpoint.reading import own_cpu_tensors as own_cpu_tensors
from aura_hpc.train.checkpoint.reading import read_meta as read_meta
from aura_hpc.train.checkpoint.reading import read_trainer_state as read_trainer_state
from aura_hpc.train.checkpoint.reading import unreadable as unreadable

if TYPE_CHECKING:  # torch is imported where a tensor is handled: `generate` refuses bad arguments without it
    import torch

log = logging.getLogger("aura_hpc")

# A tokenizer's own files (a Hub snapshot's folder may hold weights and adapters of other formats: not copied beside ours).
TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
}
_NAME = re.compile(r"^step_(\d{8,})$")


@dataclass
class Checkpoint:
    path: Path
    step: int


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_step_dir_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None


@dataclass
class ModelSnapshot:
    """A model's weights (tied copies once) and configuration in host memory, detached from training."""

    weights: dict[str, torch.Tensor]
    config: dict[str, Any]  # transformers' GPT-2 config.json
    generation_config: dict[str, Any]


def host_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory: what training mutates next cannot reach it."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def sha256_of(path: Path) -> str:
    return _sha256(path)


def model_configs(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config.json and generation_config.json transformers' GPT2LMHeadModel reads for `model`."""
    from aura_hpc.train.model.gpt import generation_config, hf_config

    return hf_config(model.config), generation_config(model.config)


def unique_weights(model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict with a tied weight (lm_head = wte) once, as transformers stores it."""
    weights: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, int]] = set()
    for name, t in model.state_dict().items():
        key = (str(t.device), t.data_ptr())
        if key not in seen:
            seen.add(key)
            weights[name] = t
    return weights


def snapshot_model(model: Any) -> ModelSnapshot:
    weights = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in unique_weights(model).items()}
    return ModelSnapshot(weights, *model_configs(model))


def _write_model(folder: Path, snap: ModelSnapshot) -> dict[str, str]:
    """config.json, generation_config.json and model.safetensors, as `save_pretrained` lays them out
    (GPT2LMHeadModel.from_pretrained loads the folder)."""
    from safetensors.torch import save_file

    folder.mkdir()
    hashes = {
        "model/config.json": _write(folder / "config.json", (json.dumps(snap.config, indent=2, sort_keys=True) + "\n").encode()),
        "model/generation_config.json": _write(
            folder / "generation_config.json", (json.dumps(snap.generation_config, indent=2) + "\n").encode()
        ),
    }
    if snap.weights:  # none in a sharded checkpoint but the last: train/checkpoint/consolidate.py makes them from the shards
        save_file(snap.weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        hashes["model/model.safetensors"] = _sha256(folder / "model.safetensors")
    return hashes


def begin(root: Path, step: int) -> Path:
    """The empty temporary folder checkpoint `step` is written into (rank 0; sharded files go in too)."""
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_temps(root)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def save(
    root: Path,
    step: int,
    model: Any,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    tokenizer_dir: Path | None,
    config_yaml: str,
    keep_last: int,
    tmp: Path | None = None,
    known_hashes: dict[str, str] | None = None,
) -> Path:
    """Write checkpoint `step` atomically and prune to the newest `keep_last`. Rank 0 only.

    `model` is a ModelSnapshot (or a model, snapshotted here); `trainer_state` must not change
    while this runs (the asynchronous writer gets a host copy). `tmp` is a folder from begin()
    that already holds files other ranks wrote (their hashes in `known_hashes`).
    """
    from aura_hpc.train.instruments import faults

    snap = model if isinstance(model, ModelSnapshot) else snapshot_model(model)
    final = root / step_dir_name(step)
    run_dir = root.parent

    def stage(name: str) -> None:
        faults.checkpoint_stage(name, run_dir)

    try:
        refuse_replacing(final)  # before anything is removed or written (a large model's write would be time lost)
        # Room first: a lowered train.keep_last takes effect before this write, not after it.
        prune(root, keep_last, step)
        if tmp is None:
            tmp = begin(root, step)
        hashes = dict(known_hashes or {})
        hashes.update(_write_model(tmp / "model", snap))
        stage("model")
        import torch

        with open(tmp / "trainer_state.pt", "wb") as f:
            hashing = HashingFile(f)
            torch.save(trainer_state, hashing)
            f.flush()
            os.fsync(f.fileno())
        hashes["trainer_state.pt"] = hashing.h.hexdigest()
        stage("trainer_state")
        hashes["meta.json"] = _write(tmp / "meta.json", json.dumps(meta, indent=2).encode())
        stage("meta")
        hashes["config.yaml"] = _write(tmp / "config.yaml", config_yaml.encode())
        stage("config")
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            for src in sorted(p for p in tokenizer_dir.rglob("*") if p.is_file()):
                dst = tmp / "tokenizer" / src.relative_to(tokenizer_dir)
                dst.parent.mkdir(parents=True, exist_ok=True)
                hashes[str(dst.relative_to(tmp))] = copy_hashed(src, dst)
                # Also beside the weights: transformers' AutoTokenizer (and pipeline) on model/ alone built an empty
                # GPT-2 tokenizer from config.json's model_type, and generated nothing, without an error.
                beside = tmp / "model" / src.name
                if src.name in TOKENIZER_FILES and src.parent == tokenizer_dir and (tmp / "model").is_dir() and not beside.exists():
                    hashes[str(beside.relative_to(tmp))] = copy_hashed(src, beside)
        stage("tokenizer")
        absent = sorted(rel for rel in known_hashes or {} if not (tmp / rel).is_file())
        if absent:  # another rank's shards written elsewhere: a checkpoint without them would verify and not resume
            raise FileNotFoundError(f"other ranks' files are not in {tmp.name}: {', '.join(absent[:3])}")
        files: dict[str, dict[str, Any]] = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                fsync(p)
                rel = str(p.relative_to(tmp))
                files[rel] = {"size": p.stat().st_size, "sha256": hashes.get(rel) or _sha256(p)}
        for d in [tmp, *[p for p in tmp.rglob("*") if p.is_dir()]]:
            fsync(d)
        stage("files")
        _write(tmp / MARKER, json.dumps({"step": step, "files": files}, indent=1).encode())
        stage("marker")
        fsync(tmp)
        refuse_replacing(final)  # a user's file put there while this was written
        if final.exists():
            # The same step written again (after a rollback the weights differ): swap it in.
            old = root / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync(root)
    except Exception as exc:  # torch.save reports a full disk as RuntimeError("... unexpected pos ...")
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # the partial write would keep the disk full
        raise exc if isinstance(exc, CheckpointWriteError) else write_failure(exc, root, step) from None
    try:
        prune(root, keep_last, step)
    except OSError as exc:  # step is committed: a failed clean-up is no failed write (every rank stopped on it)
        log.warning("checkpoint step %d is written; removing older ones failed (%s)", step, exc.strerror or exc)
    return final


def write_failure(exc: BaseException, root: Path, step: int) -> CheckpointWriteError:
    """The one line for a checkpoint that could not be written, after its partial files are gone. It never raises:
    it runs in every rank's error path, before the collective that tells the others (a folder that fails a write
    often fails its listing too: EIO, ESTALE, EACCES on NFS)."""
    try:
        previous = next((c.step for c in list_complete(root) if c.step != step), None)
        kept = f"previous checkpoint step {previous} is intact" if previous is not None else "no earlier checkpoint exists"
    except OSError as listing:
        kept = f"the earlier checkpoints could not be listed either: {listing.strerror or listing}"
    if disk_full(exc, root):
        try:
            where = disk_of(root)
        except (OSError, RuntimeError):
            where = str(root)
        return CheckpointWriteError(
            f"no space left on {where} while writing checkpoint step {step} ({kept}; the partial write was removed) "
            "(fix: free space there, lower train.keep_last, or use an output_dir on a larger disk; then re-run the same command)"
        )
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    reason = getattr(exc, "strerror", None) or first
    return CheckpointWriteError(
        f"could not write checkpoint step {step} in {root} ({type(exc).__name__}: {reason}; {kept}) "
        "(fix: check the permissions and the filesystem, then re-run the same command to resume)"
    )


def _clean_stale_temps(root: Path) -> None:
    """Partial checkpoints from a crash mid-save; only the writer (rank 0) is ever here."""
    remove_partial(root, spare_own=True)


def remove_partial(root: Path, spare_own: bool = False) -> None:
    """Checkpoint folders a crash left half-written (`.tmp-step_*`, renamed when complete), set aside by a re-save
    (`.old-step_*`: a committed one is put back first) or half-deleted (`.del-step_*`, a pruned one). Only the run's
    writer, or the launcher holding the run lock, is here. `spare_own`: not this process's own save in progress."""
    restore_set_aside(root)
    for p in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*"), *root.glob(".del-step_*")]:
        if p.is_dir() and (not spare_own or p.name.startswith(".del-") or not p.name.endswith(f"-{os.getpid()}")):
            log.info("removing partial checkpoint %s left by an interrupted save", p.name)
            shutil.rmtree(p, ignore_errors=True)


def restore_set_aside(root: Path) -> None:
    """A crash between a re-saved step's two renames leaves the committed copy it was replacing only as
    `.old-step_N-PID`: put it back, whatever PID it names (a writer restarted in a container has its
    predecessor's). Only the run's writer calls this, never mid-save (a reader could collide with a swap)."""
    for p in root.glob(".old-step_*"):
        final = root / p.name[len(".old-") :].rsplit("-", 1)[0]
        if not _NAME.match(final.name) or final.exists():
            continue
        if p.is_dir() and (p / MARKER).exists():
            log.warning("checkpoint %s was set aside by an interrupted re-save of its step: restored", final.name)
            with contextlib.suppress(OSError):
                p.rename(final)


def list_complete(root: Path) -> list[Checkpoint]:
    """Committed checkpoints, newest first (not yet content-verified)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / MARKER).exists():  # a link to a folder elsewhere too (prune leaves it)
                out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step, reverse=True)


def _eval_loss(ckpt: Checkpoint) -> float | None:
    """A finite validation loss, or None: a NaN compares less than nothing and was "best" wherever it stood first
    (the newest), and the real best was pruned."""
    with contextlib.suppress(OSError, json.JSONDecodeError, TypeError, ValueError):
        value = json.loads((ckpt.path / "meta.json").read_text()).get("eval_loss")
        return float(value) if value is not None and math.isfinite(float(value)) else None
    return None


def best(root: Path) -> Checkpoint | None:
    """The complete checkpoint with the lowest validation loss, if any recorded one."""
    scored = [(loss, c) for c in list_complete(root) if (loss := _eval_loss(c)) is not None]
    return min(scored, key=lambda x: (x[0], -x[1].step))[1] if scored else None


def prune(root: Path, keep_last: int, step: int) -> None:
    """Keep the newest `keep_last` up to `step` (the one written now) and the best by validation loss. A newer one is
    one the resume passed over (corrupt, and it could not be moved aside): counted, it left only itself."""
    keep_best = best(root)
    for ckpt in [c for c in list_complete(root) if c.step <= step][keep_last:]:
        if ckpt.path.is_symlink() or (keep_best is not None and ckpt.path == keep_best.path):  # a link: not ours
            continue
        if holds_files_not_ours(ckpt.path):
            continue
        # Out of the step folders' names first, in one rename: a process killed mid-delete left a half-deleted
        # checkpoint that still said complete, and, its marker removed first, one nothing ever removed or named
        # (gigabytes under a step folder's name). A `.del-` folder is removed by the next save's clean-up.
        gone = root / f".del-{ckpt.path.name}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            ckpt.path.rename(gone)
        except OSError:
            (ckpt.path / MARKER).unlink(missing_ok=True)
            gone = ckpt.path
        shutil.rmtree(gone, ignore_errors=True)  # a file still open elsewhere on NFS (.nfsXXXX) can keep it


def verify(ckpt: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when every file of this rank's share matches its marker entry; otherwise what is wrong.
    `share` (rank, world): every world-th file, its presence, size and checksum; the ranks of a resume
    check a checkpoint together, each file once, and gather their verdicts (every rank stat-ing every
    file was world² metadata calls on shared storage: 260k at 512 GPUs)."""
    try:  # a marker of another shape (a list, sizes as text) or a file gone while read (pruned by its run): said
        marker = json.loads((ckpt / MARKER).read_text())
        rank, world = share
        for i, (rel, want) in enumerate(sorted(marker.get("files", {}).items())):
            if i % world != rank:
                continue
            p = ckpt / rel
            if not p.is_file():
                return f"missing file {rel}"
            if p.stat().st_size != want["size"]:
                return f"{rel} has {p.stat().st_size} bytes, expected {want['size']}"
            if _sha256(p) != want["sha256"]:
                return f"{rel} does not match its checksum"
    except FileNotFoundError as exc:
        return f"unreadable commit marker or files ({type(exc).__name__}: {str(exc)[:200]})"
    except OSError as exc:
        # The storage failed to read (EIO, ESTALE, a permission): nothing says the checkpoint is damaged, and setting
        # it aside on a blip sent a run back to step 0.
        return f"{READ_FAILED}{exc.strerror or type(exc).__name__}: {getattr(exc, 'filename', None) or ckpt}"
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"unreadable commit marker or files ({type(exc).__name__}: {str(exc)[:200]})"
    return None


READ_FAILED = "the storage could not read it: "


def not_read(problem: str, name: str) -> CheckpointError | None:
    """The error for a checkpoint the storage failed to read (nothing is set aside), or None for real damage."""
    if not problem.startswith(READ_FAILED):
        return None
    return CheckpointError(
        f"checkpoint {name} could not be checked: {problem} (fix: check the storage's mount and permissions, then re-run the "
        "same command; nothing was set aside)"
    )


def raise_if_not_read(problems: list[str], name: str) -> None:
    for problem in problems:
        if (error := not_read(problem, name)) is not None:
            raise error


def set_aside(ckpt: Checkpoint, root: Path, problem: str) -> None:
    if (error := not_read(problem, ckpt.path.name)) is not None:
        raise error
    aside = root / f"corrupt-{ckpt.path.name}-{int(time.time())}"
    try:
        ckpt.path.rename(aside)
    except OSError as exc:  # said as it is (it read "moved it"); rank 0 alone is here, the others wait: no raise
        log.warning(
            "checkpoint %s is corrupt (%s) and could not be moved aside (%s); trying the one before it (fix: move it away yourself)",
            ckpt.path.name,
            problem,
            exc.strerror or exc,
        )
        return
    log.warning("checkpoint %s is corrupt (%s); moved it to %s, trying the one before it", ckpt.path.name, problem, aside.name)


def note_interrupted(root: Path) -> None:
    """Say which step folders lack a commit marker (their save was interrupted)."""
    complete = list_complete(root)
    newest_complete = complete[0].step if complete else -1
    if root.is_dir():
        for p in sorted(root.iterdir()):
            m = _NAME.match(p.name)
            if m and p.is_dir() and not (p / MARKER).exists() and int(m.group(1)) > newest_complete:
                log.warning("checkpoint %s has no %s (an interrupted save, or a folder not ours): ignored", p.name, MARKER)


def newest_valid(root: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies (one process hashes every file); corrupt newer ones are
    reported and set aside."""
    note_interrupted(root)
    for ckpt in list_complete(root):
        problem = verify(ckpt.path)
        if problem is None:
            return ckpt
        set_aside(ckpt, root, problem)
    return None
