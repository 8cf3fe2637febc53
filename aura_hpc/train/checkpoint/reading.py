"""Reading a checkpoint's files back: its meta, weights (memory-mapped) and trainer state, each failure one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aura_hpc.errors import CheckpointError

if TYPE_CHECKING:
    import torch


def unreadable(exc: BaseException) -> CheckpointError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(
        f"checkpoint could not be loaded safely ({type(exc).__name__}: {first[:200]}) "
        "(fix: move that checkpoint directory away to resume from the previous one)"
    )


def read_meta(ckpt: Path) -> dict[str, Any]:
    try:
        meta: dict[str, Any] = json.loads((ckpt / "meta.json").read_bytes())
    except Exception as exc:
        raise unreadable(exc) from None
    return meta


def load_weights_from(ckpt: Path, model: torch.nn.Module) -> None:
    """Copy the saved weights into `model` one tensor at a time (memory-mapped: one tensor in host memory)."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(ckpt / "model" / "model.safetensors"), framework="pt", device="cpu") as f:
            names = list(f.keys())
            _check_keys(model, names)
            params = model.state_dict()
            with torch.no_grad():
                for name in names:
                    saved = f.get_tensor(name)
                    if saved.shape != params[name].shape:  # copy_ would broadcast a smaller tensor in silence
                        raise CheckpointError(
                            f"checkpoint weight {name} has shape {tuple(saved.shape)}, the model's is {tuple(params[name].shape)} "
                            "(fix: resume with the config the run was started with, or use a new --run-name)"
                        )
                    params[name].copy_(saved)
    except CheckpointError:
        raise
    except Exception as exc:
        raise unreadable(exc) from None


def read_trainer_state(ckpt: Path, mapped: bool = True) -> dict[str, Any]:
    """Optimizer, scheduler and RNG states, memory-mapped where `mapped`: the ranks of a node share the pages
    (the file is read from shared storage once per node, not once per rank) when each copies them to its GPU.
    Not where they stay on the CPU (`mapped=False`): the optimizer would train in the file's pages, and keep
    the file mapped for the whole run (own_cpu_tensors)."""
    import torch

    try:
        # weights_only: a checkpoint is data, never code.
        state: dict[str, Any] = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:
        raise unreadable(exc) from None
    return state


def own_cpu_tensors(optimizer: torch.optim.Optimizer) -> None:
    """The loaded optimizer's CPU tensors copied out of the memory-mapped file. torch's `load_state_dict` keeps a
    CPU value as it is (a non-fused optimizer's `step`; every moment where the parameters are on the CPU), and
    each one holds the mapping of the whole file: a pruned checkpoint's blocks stayed allocated until the run
    ended (`du` did not see them, the disk-full line said to free space), and on NFS its silly-renamed
    `.nfs*` file made the prune's removal fail."""
    for per_param in optimizer.state.values():
        for key, value in list(per_param.items()):
            if getattr(value, "device", None) is not None and value.device.type == "cpu":
                per_param[key] = value.clone()


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    _check_keys(model, list(weights))
    params = model.state_dict()
    for name, saved in weights.items():  # load_state_dict's size mismatch was a traceback
        if saved.shape != params[name].shape:
            raise CheckpointError(
                f"checkpoint weight {name} has shape {tuple(saved.shape)}, the model's is {tuple(params[name].shape)} "
                "(fix: resume with the config the run was started with, or use a new --run-name)"
            )
    model.load_state_dict(weights, strict=False)


def _check_keys(model: torch.nn.Module, names: list[str]) -> None:
    expected = set(model.state_dict())
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    missing = sorted(expected - set(names) - tied)
    unexpected = sorted(set(names) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]}) "
            "(fix: resume with the config the run was started with, or use a new --run-name)"
        )
