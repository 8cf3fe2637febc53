"""Sharded checkpoints read as data, never as code.

torch's DCP unpickles its `.metadata` with plain `pickle` and the non-tensor entries of a state dict
with `torch.load(weights_only=False)`; DeepSpeed asks for `weights_only=False` too. A
checkpoint is a file anyone with write access to the run directory (or a copy restored from
elsewhere) can shape, and a checksum in COMPLETE.json is rewritten as easily: so before torch or
DeepSpeed reads them, the globals those pickles may call are checked against what the libraries
themselves write, and DCP's non-tensor entries are loaded with `weights_only=True`. DeepSpeed's own
loads then run forced to `weights_only` too: a file swapped between the check and DeepSpeed's read is
refused as data, never run.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

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


_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # what DCP's writer names its files, in the checkpoint's own folder


# The records BUILD may set attributes of: instances of these modules' classes, the file's own.
_BUILT_MODULES = (*_DCP_MODULES, "torch.distributed.checkpoint.filesystem", "collections", "pathlib")


class _Refused(pickle.UnpicklingError):
    """What the file asks that torch never writes there ("run posix.system")."""


class _MetadataCheck(pickle._Unpickler):  # the Python one: its BUILD can be guarded
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        # BUILD sets attributes of the object below it: never of a class or function the file named, which live on
        # in the process (a refused file left pathlib's classes and torch's layout table rewritten).
        target = self.stack[-2]
        module = type(target).__module__
        if isinstance(target, type) or not any(module == m or module.startswith(f"{m}.") for m in _BUILT_MODULES):
            raise _Refused(f"set the attributes of {getattr(target, '__qualname__', type(target).__qualname__)}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        # A dotted name (pickle protocol 4) is looked up attribute by attribute from the module: the metadata
        # module holds `torch`, and `torch.ctypes.util.subprocess.Popen` ran a command as it was checked.
        if "." in name:
            raise _Refused(f"run {module}.{name}")
        allowed = (module, name) in _DCP_GLOBALS or module in _DCP_MODULES
        if module == "torch" and not allowed:
            allowed = isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise _Refused(f"run {module}.{name}")
        found = super().find_class(module, name)
        if module in _DCP_MODULES and not (isinstance(found, type) and found.__module__ == module):  # its own records
            raise _Refused(f"run {module}.{name}")
        return found


def read_dcp_metadata(path: Path) -> Any:
    """DCP's metadata, unpickled with nothing allowed but what torch writes there, its shard files named as DCP
    names them (a name with a folder in it read another checkpoint's tensors). Every rank reads it before
    `dcp.load`, whose own failures are tracebacks from a collective."""
    try:
        with path.open("rb") as f:
            metadata = _MetadataCheck(f).load()
    except _Refused as exc:
        raise CheckpointError(f"{path} asks to {exc}, which torch never writes there (fix: {_FIX})") from None
    except (pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path} is not DCP metadata ({type(exc).__name__}) (fix: {_FIX})") from None
    files = getattr(metadata, "storage_data", None)
    if not isinstance(files, dict):
        raise CheckpointError(f"{path} is not DCP metadata (no storage_data) (fix: {_FIX})")
    for info in files.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _SHARD_FILE.fullmatch(name):
            raise CheckpointError(f"{path} names a shard file {str(name)[:80]!r} that DCP never writes (fix: {_FIX})")
    return metadata


def check_dcp_metadata(path: Path) -> None:
    read_dcp_metadata(path)


class DataOnlyReader(FileSystemReader):
    """DCP's reader, given the metadata it checked itself (torch's reader opened the file again and unpickled
    whatever it then held)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(Path(str(self.path)) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does (2.6 to 2.13)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


def check_deepspeed_files(folder: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Every DeepSpeed file under `folder` calls only what DeepSpeed writes there (torch's own tensor
    records aside), checked without unpickling it: the message that names the file, before DeepSpeed's loads.
    `share` (rank, world): this rank's share of the files, every world-th one. The ranks of a resume check a
    checkpoint together, each file once: every rank checking every rank's file was world² opens of shared
    storage per resume (260k at 512 GPUs), and a legacy-format file was read whole by every rank."""
    rank, world = share
    for i, path in enumerate(sorted(folder.rglob("*.pt"))):
        if i % world != rank:
            continue
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
    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} holds what DeepSpeed never writes ({str(exc).splitlines()[0][:160]}) (fix: {_FIX})") from None
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable torch file ({type(exc).__name__}) (fix: {_FIX})") from None


def _deepspeed_classes() -> list[Any]:
    import importlib

    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # this DeepSpeed has no such class: nor does its file
    return allowed


_FORCE, _FORCE_NOT = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def deepspeed_loads_as_data(folder: Path) -> Iterator[None]:
    """Inside, every `torch.load` (DeepSpeed's and zero_to_fp32's ask for weights_only=False) reads data only,
    DeepSpeed's own records allowed: the files were checked once, and one replaced after the check would
    otherwise be unpickled as code. torch reads both variables at each load; the second would make it raise."""
    saved = {k: os.environ.pop(k, None) for k in (_FORCE, _FORCE_NOT)}
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            yield
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"a DeepSpeed file under {folder} holds what DeepSpeed never writes ({str(exc).splitlines()[0][:160]}) (fix: {_FIX})"
        ) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
