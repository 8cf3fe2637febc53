"""Full weights, on demand, for a sharded checkpoint that holds only its shards (every save of an
fsdp or ZeRO run but the last: checkpoint/writer.py).

One process reads the shards (torch DCP, or DeepSpeed's own files through its zero_to_fp32) and
writes `model/model.safetensors`, which GPT2LMHeadModel.from_pretrained then loads. The checkpoint
stays self-verifying: the weights go in under a temporary name, then a new commit marker that
lists them replaces the old one (each by rename), so a crash leaves the checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import time
import warnings
from pathlib import Path

import torch

from aura_hpc.errors import CheckpointError
from aura_hpc.processes import alive, pid_space
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.checkpoint.writer import SHARDS

log = logging.getLogger("aura_hpc")

WEIGHTS = "model/model.safetensors"


def needs_full_weights(ckpt: Path) -> bool:
    """A sharded checkpoint whose commit marker lists no full weights."""
    if not (ckpt / SHARDS).is_dir():
        return False
    try:
        files = json.loads((ckpt / checkpoint.MARKER).read_text()).get("files", {})
    except (OSError, json.JSONDecodeError):
        return False  # verify() reports a broken marker
    return WEIGHTS not in files


def consolidate(ckpt: Path) -> bool:
    """Write the full weights of sharded checkpoint `ckpt` into its model/ folder; False when it
    already has them (or is not sharded)."""
    if not needs_full_weights(ckpt):
        return False
    try:
        config = json.loads((ckpt / "model" / "config.json").read_text())
        shards = ckpt / SHARDS
        weights = _from_dcp(shards) if (shards / ".metadata").is_file() else _from_deepspeed(shards)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"the shards of checkpoint {ckpt.name} could not be read into full weights ({type(exc).__name__}: "
            f"{str(exc).strip()[:200]}) (fix: check that {shards} is complete, or use an earlier checkpoint)"
        ) from None
    if config.get("tie_word_embeddings", True):
        weights.pop("lm_head.weight", None)  # stored once, as transformers does
    _commit(ckpt, {k: v.to(torch.float32).contiguous() for k, v in weights.items()})
    log.info("checkpoint %s: full weights written from its shards into model/", ckpt.name)
    return True


def _from_dcp(folder: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from aura_hpc.train.checkpoint.data_only import DataOnlyReader, load_dcp

    reader = DataOnlyReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"{folder} holds no model tensors (fix: use an earlier checkpoint)")
    with warnings.catch_warnings():
        # Without a process group DCP says it assumes one process: that is the intent here.
        warnings.simplefilter("ignore", UserWarning)
        load_dcp({"model": model}, folder)
    return model


def _from_deepspeed(folder: Path) -> dict[str, torch.Tensor]:
    from aura_hpc.train.process.deepspeed_import import quiet_deepspeed

    quiet_deepspeed(needed=True)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from aura_hpc.train.checkpoint.data_only import check_deepspeed_files, deepspeed_loads_as_data
    from aura_hpc.train.strategies.zero import TAG

    check_deepspeed_files(folder)  # the message that names the file; zero_to_fp32's loads then read data only
    try:
        # It prints its progress; `generate`'s stdout is the samples.
        with contextlib.redirect_stdout(io.StringIO()), deepspeed_loads_as_data(folder):
            state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)
    except ValueError as exc:
        if "is not a zero checkpoint" not in str(exc):
            raise
        state = _from_bf16_optimizer(folder / TAG)  # ZeRO-1 under bf16, which zero_to_fp32 refuses
    # The engine wraps the loss module, which holds the model as `lm`.
    return {k.removeprefix("lm."): v for k, v in state.items()}


def _from_bf16_optimizer(tag_dir: Path) -> dict[str, torch.Tensor]:
    """ZeRO-1 under bf16 (DeepSpeed's BF16_Optimizer), which deepspeed's zero_to_fp32 does not read:
    each rank's file holds its slice of every parameter group's flat fp32 masters; in rank order a
    group's slices hold its parameters one after the other (padding only at the end)."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SHAPES, SINGLE_PARTITION_OF_FP32_GROUPS

    def rank_of(p: Path) -> int:
        return int(p.name.split("bf16_zero_pp_rank_")[1].split("_")[0])

    files = sorted(tag_dir.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=rank_of)
    if [rank_of(f) for f in files] != list(range(len(files))):
        raise CheckpointError(f"{tag_dir} lacks the optimizer file of some rank (fix: use an earlier checkpoint)")
    parts = [_load(f)[OPTIMIZER_STATE_DICT][SINGLE_PARTITION_OF_FP32_GROUPS] for f in files]
    shapes = _load(tag_dir / "mp_rank_00_model_states.pt")[PARAM_SHAPES]
    out: dict[str, torch.Tensor] = {}
    for group, names in enumerate(shapes):
        flat = torch.cat([p[group].reshape(-1) for p in parts])
        offset = 0
        for name, shape in names.items():
            n = int(torch.Size(shape).numel())
            out[name] = flat[offset : offset + n].view(tuple(shape)).clone()
            offset += n
    return out


def _load(path: Path) -> dict:
    """A DeepSpeed file read as data, never as code: containers, tensors, and the one DeepSpeed record
    its ZeRO-1 bf16 files hold (a parameter's place in a partition)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    with warnings.catch_warnings(), torch.serialization.safe_globals([fragment_address]):
        warnings.simplefilter("ignore")
        return dict(torch.load(path, map_location="cpu", weights_only=True))


def _commit(ckpt: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    marker_path = ckpt / checkpoint.MARKER
    marker = json.loads(marker_path.read_text())
    final = ckpt / WEIGHTS
    space = pid_space()  # whose part it is: another machine of a shared folder may write too
    part = final.with_name(f".{final.name}.{space}.{os.getpid()}.tmp")
    new_marker = marker_path.with_name(f".{marker_path.name}.{space}.{os.getpid()}.tmp")
    _clear_dead_parts(space, final, marker_path)
    try:
        save_file(weights, str(part), metadata={"format": "pt"})
        checkpoint.fsync(part)
        marker["files"][WEIGHTS] = {"size": part.stat().st_size, "sha256": checkpoint.sha256_of(part)}
        new_marker.write_text(json.dumps(marker, indent=1))
        checkpoint.fsync(new_marker)
        part.rename(final)  # not yet listed: the old marker still describes a valid checkpoint
        checkpoint.fsync(ckpt / "model")  # before the marker that lists it: a power cut kept a marker of a file gone
        new_marker.rename(marker_path)
        checkpoint.fsync(ckpt)
    except Exception as exc:  # safetensors says a failed write with its own error (a traceback for `generate`)
        reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise CheckpointError(
            f"could not write the full weights into checkpoint {ckpt.name} ({reason}) (fix: free space or make {ckpt} writable)"
        ) from None
    finally:
        for leftover in (part, new_marker):
            leftover.unlink(missing_ok=True)


DEAD_PART_S = 3600.0  # a part unchanged this long has no writer left, whichever machine it was on


def _clear_dead_parts(space: str, *targets: Path) -> None:
    """Remove the parts a killed consolidation left beside `targets` (a model's size each, which the last checkpoint
    kept for good): only our own names (`.NAME.SPACE.PID.tmp`), and only when their writer is gone: a process of this
    PID space (`space`) no longer there, or, for another's, a part unchanged for DEAD_PART_S."""
    for target in targets:
        ours = re.compile(rf"\.{re.escape(target.name)}\.(?:(.+)\.)?(\d+)\.tmp")
        for part in target.parent.glob(f".{target.name}.*.tmp"):
            if not (found := ours.fullmatch(part.name)):
                continue
            with contextlib.suppress(OSError):
                gone = found[1] == space and not alive(int(found[2]))
                if part.is_file() and (gone or time.time() - part.stat().st_mtime > DEAD_PART_S):
                    part.unlink()
