"""Sharded checkpoints read as data, never as code.

torch's DCP unpickles its `.metadata` with plain `pickle` and the non-tensor entries of a state dict
with `torch.load(weights_only=False)`; DeepSpeed loads its files with `weights_only=False` too. A
checkpoint is a file anyone with write access to the run directory (or a copy restored from
elsewhere) can shape, and a checksum in COMPLETE.json is rewritten as easily: so before torch or
DeepSpeed reads them, the globals those pickles may call are checked against what the libraries
themselves write, and DCP's non-tensor entries are loaded with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from aura_hpc.errors import CheckpointError

# What DCP's metadata pickles hold (torch 2.6 to 2.13): its own records, sizes, dtypes, a layout by
# name, the checkpoint's path. Anything else in it was not written by torch.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
}
# What DeepSpeed's ZeRO files hold beyond plain tensors and containers (stages 1-3, bf16, fp16, fp32).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_FIX = "restore the checkpoint from a copy you trust, or use an earlier one"


class _MetadataCheck(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_GLOBALS or module in _DCP_MODULES
        if module == "torch" and not allowed:
            allowed = isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        found = super().find_class(module, name)
        if module in _DCP_MODULES and not isinstance(found, type):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found


def check_dcp_metadata(path: Path) -> None:
    """DCP's metadata calls only what torch writes there; checked by unpickling it with nothing else
    allowed. Every rank checks before `dcp.load`, whose own failures are tracebacks from a collective."""
    try:
        with path.open("rb") as f:
            _MetadataCheck(f).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} asks to run {exc}, which torch never writes there (fix: {_FIX})") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{path} is not DCP metadata ({type(exc).__name__}) (fix: {_FIX})") from None


class DataOnlyReader(FileSystemReader):
    """DCP's reader, its metadata checked again as torch unpickles it (the file may change between)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        check_dcp_metadata(Path(str(self.path)) / (".metadata" if rank is None else f"__{rank}.metadata"))
        return super().read_metadata(*args, **kwargs)


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor entries (an optimizer's settings) loaded with weights_only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"entry {read_item.dest_index.fqn} of the checkpoint is not plain data ({str(exc).splitlines()[0][:160]}) (fix: {_FIX})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_dcp(state: dict[str, Any], folder: Path) -> None:
    """`dcp.load` of `folder` into `state` (collective where a process group exists), read as data; our
    refusals come out as themselves, not inside torch's CheckpointException (a BaseException, with
    every rank's traceback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_dcp_metadata(folder / ".metadata")
    try:
        dcp.load(state, storage_reader=DataOnlyReader(str(folder)), planner=DataOnlyPlanner())
    except CheckpointException as exc:
        ours = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def check_deepspeed_files(folder: Path) -> None:
    """Every DeepSpeed file under `folder` calls only what DeepSpeed writes there (torch's own tensor
    records aside), checked without unpickling it; before DeepSpeed loads them with weights_only=False."""
    for path in sorted(folder.rglob("*.pt")):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except ValueError:  # not a zip: DeepSpeed told to write torch's legacy format; read whole, as data
            _load_legacy_as_data(path)
            continue
        except Exception as exc:  # a damaged zip or pickle: torch raises several kinds
            raise CheckpointError(f"{path} is not a readable torch file ({type(exc).__name__}) (fix: {_FIX})") from None
        foreign = sorted(set(unsafe) - set(DEEPSPEED_GLOBALS))
        if foreign:
            raise CheckpointError(f"{path} asks to run {', '.join(foreign)[:200]}, which DeepSpeed never writes (fix: {_FIX})")


def _load_legacy_as_data(path: Path) -> None:
    import importlib

    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # this DeepSpeed has no such class: nor does its file
    try:
        with torch.serialization.safe_globals(allowed):
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} holds what DeepSpeed never writes ({str(exc).splitlines()[0][:160]}) (fix: {_FIX})") from None
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable torch file ({type(exc).__name__}) (fix: {_FIX})") from None
