"""A model built on the meta device, then initialised where its parameters live, one at a time.

Under FSDP every rank would otherwise build the whole fp32 model in host memory before sharding
it (12 GB per rank for gpt2-3b, eight ranks to a node). Here the constructor runs on the meta
device while a dispatch mode records what it does to tensors: the allocations, and the in-place
draws and fills of the initialisation, in order. Once the strategy has placed the parameters
(each rank its shard), `materialize` replays that record on host scratch tensors from the RNG
state the constructor started from, and copies each parameter's final value (this rank's part of
it) into place. The weights are bit for bit those of the model built on the host, and the host
holds at most a few parameters at once. A constructor that does anything else with its tensors
(an op reading one tensor into another) cannot be replayed: `build_on_meta` then returns None and
the caller builds on the host as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

Place = Callable[[torch.Tensor, torch.Tensor], None]  # (parameter, its whole value) -> this rank's part written

# Ops whose result does not depend on what the tensor held: an earlier value need not be kept.
_OVERWRITE = {"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_"}


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)  # a parameter and the tensor it wraps share one storage


@dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: int  # the storage written (in place) or made (factory)
    factory: bool


@dataclass
class InitRecord:
    ops: list[_Op]
    names: dict[int, str]  # storage -> parameter name
    rng: torch.Tensor  # the CPU RNG state the constructor started from
    keep: list[torch.Tensor]  # the meta tensors, so no storage address is reused

    def materialize(self, model: torch.nn.Module, dtype: torch.dtype, place: Place | None = None) -> None:
        """Replay the record on the host; copy each parameter's final value, cast to `dtype`, into
        what this rank holds of it (its shard of a DTensor, or the whole tensor; `place` for other
        layouts, called for every parameter in the same order on every rank)."""
        place = place or _place
        params = dict(model.named_parameters())
        following: dict[int, int | None] = {}  # op index -> the next op on the same tensor
        seen: dict[int, int] = {}
        for i in reversed(range(len(self.ops))):
            following[i] = seen.get(self.ops[i].key)
            seen[self.ops[i].key] = i
        # A parameter no op wrote after its allocation would hold whatever memory it got.
        written = {self.names[op.key] for op in self.ops if op.key in self.names and not _name(op.func).startswith("empty")}
        missing = sorted(set(params) - written)
        if missing:
            raise RuntimeError(f"no initialisation recorded for {missing}")
        live: dict[int, torch.Tensor] = {}
        torch.set_rng_state(self.rng)
        with torch.no_grad():
            for i, op in enumerate(self.ops):
                name, then = self.names.get(op.key), following[i]
                # Kept: what the next op reads, or a parameter's final value. Run anyway: every draw,
                # so the RNG moves as it did in the constructor.
                kept = (then is not None and _name(self.ops[then].func) not in _OVERWRITE) or (then is None and name is not None)
                if not kept and not _draws(op.func):
                    continue
                if op.factory:
                    value = op.func(*_on_host(op.args), **_on_host(op.kwargs))
                else:
                    value = live.pop(op.key, None)
                    if value is None:  # an overwrite: what the tensor held does not matter
                        value = torch.empty(op.args[0].shape, dtype=op.args[0].dtype)
                    op.func(value, *_on_host(op.args[1:]), **_on_host(op.kwargs))
                if kept and then is not None:
                    live[op.key] = value
                elif kept and name is not None:
                    place(params[name], value.to(dtype))


def _draws(func: Any) -> bool:
    name = _name(func)
    return "rand" in name or name.rstrip("_") in {"normal", "uniform", "bernoulli", "exponential", "geometric", "cauchy", "log_normal"}


def _name(func: Any) -> str:
    return str(func._schema.name).split("::")[-1]


def _on_host(tree: Any) -> Any:
    return tree_map(lambda x: torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x, tree)


def _place(param: torch.Tensor, value: torch.Tensor) -> None:
    local = param.to_local() if hasattr(param, "to_local") else param
    if hasattr(param, "device_mesh"):
        # FSDP2's Shard(0): torch.chunk over the mesh, in rank order.
        mesh = param.device_mesh
        chunks = value.chunk(mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        value = chunks[rank] if rank < len(chunks) else value[:0]
    if tuple(local.shape) != tuple(value.shape):
        raise RuntimeError(f"a shard of shape {tuple(local.shape)} for a value of shape {tuple(value.shape)}")
    local.copy_(value)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.keep: list[torch.Tensor] = []
        self.unsupported: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        schema = func._schema
        writes_first = bool(schema.arguments) and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
        if not tensors and isinstance(out, torch.Tensor):
            self.ops.append(_Op(func, args, kwargs, _key(out), factory=True))
            self.keep.append(out)
        elif writes_first and len(tensors) == 1 and tensors[0] is args[0]:
            self.ops.append(_Op(func, args, kwargs, _key(args[0]), factory=False))
            self.keep.append(args[0])
        elif self.unsupported is None and schema.name not in ("aten::detach", "aten::alias"):
            self.unsupported = str(schema.name)
        return out


def build_on_meta(factory: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, InitRecord] | None:
    """The model `factory()` makes, on the meta device, and the record that initialises it; None when
    its constructor does something the record cannot replay."""
    rng = torch.get_rng_state()
    recorder = _Recorder()
    with torch.device("meta"), recorder:
        model = factory()
    if recorder.unsupported is not None:
        return None
    names = {_key(p): n for n, p in model.named_parameters()}
    return model, InitRecord(recorder.ops, names, rng, recorder.keep)
