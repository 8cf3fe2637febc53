"""State that crosses between ranks (optimizer, scheduler and RNG states) without pickle.

A tree of dicts, lists, tuples, numbers, strings, None and tensors becomes JSON plus the tensors
(safetensors bytes, or base64 inside the JSON for small states): what a peer sends is decoded as
data and nothing else, so a rank that lies can send wrong numbers but never run code here.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import torch

_PLAIN = (str, int, float, bool, type(None))


def to_parts(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(a JSON-able skeleton, the tensors it refers to by name)."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            name = str(len(tensors))
            tensors[name] = x.detach().to("cpu").contiguous()
            return {"__T": name}
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, tuple):
            return {"__t": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                return {"__d": {k: enc(v) for k, v in x.items()}}
            return {"__m": [[enc(k), enc(v)] for k, v in x.items()]}
        raise TypeError(f"{type(x).__name__} cannot cross between ranks (only tensors, numbers, strings and containers)")

    return enc(obj), tensors


def from_parts(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def dec(x: Any) -> Any:
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict) and len(x) == 1:
            ((kind, body),) = x.items()
            if kind == "__T" and isinstance(body, str) and body in tensors:
                return tensors[body]
            if kind == "__t" and isinstance(body, list):
                return tuple(dec(v) for v in body)
            if kind == "__d" and isinstance(body, dict):
                return {str(k): dec(v) for k, v in body.items()}
            if kind == "__m" and isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in body):
                return {_key(dec(k)): dec(v) for k, v in body}
        raise ValueError("not a state this version of aura_hpc sends")

    return dec(skeleton)


def _key(k: Any) -> Any:
    if isinstance(k, (list, dict)):
        raise ValueError("a key that is not a plain value")
    return k


def to_bytes(obj: Any) -> tuple[bytes, bytes]:
    """(JSON skeleton, safetensors blob): for large states (a checkpoint's optimizer state)."""
    from safetensors.torch import save

    skeleton, tensors = to_parts(obj)
    return json.dumps(skeleton).encode(), save(tensors) if tensors else b""


def from_bytes(skeleton: bytes, blob: bytes) -> Any:
    from safetensors.torch import load

    return from_parts(json.loads(skeleton.decode("utf-8")), load(blob) if blob else {})


def to_json(obj: Any) -> Any:
    """All of it as JSON values, tensors inline (base64): for small states (RNG streams)."""
    skeleton, tensors = to_parts(obj)
    inline = {
        k: [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(t.numpy().tobytes()).decode()] for k, t in tensors.items()
    }
    return {"skeleton": skeleton, "tensors": inline}


_DTYPES = {"uint8": torch.uint8, "int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "float64": torch.float64}


def from_json(data: Any) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), dict):
        raise ValueError("not a state this version of aura_hpc sends")
    tensors = {}
    for name, (dtype, shape, b64) in data["tensors"].items():
        if dtype not in _DTYPES or not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError("a tensor of a kind this version of aura_hpc does not send")
        raw = bytearray(base64.b64decode(b64, validate=True))
        if math.prod(shape) * _DTYPES[dtype].itemsize != len(raw):  # a peer's shape is never allocated beyond its bytes
            raise ValueError(f"a tensor whose shape {shape[:8]} does not match its {len(raw)} bytes")
        tensors[str(name)] = torch.frombuffer(raw, dtype=_DTYPES[dtype]).reshape(shape) if raw else torch.empty(shape, dtype=_DTYPES[dtype])
    return from_parts(data["skeleton"], tensors)
