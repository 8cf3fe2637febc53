"""What each node runs (aura_hpc, torch, NCCL), compared before a process group starts: by the
worker's start (train/process/distributed.py) and by `check` between nodes.

LAN machines install their own torch: a laptop on torch 2.5 beside a desktop on 2.6, or two CUDA
builds of one release, each with its own NCCL. NCCL's bootstrap then fails on its version check
(or, across releases whose wire differs, waits), and gloo across torch releases is a run nobody
tested. Said through the store, every rank refuses together, naming the node and the fix.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import aura_hpc


def of_this_process(node: int, host: str, nccl: bool, torch_version: str = "") -> dict[str, Any]:
    """This process's versions and where it runs, as the others will read them. `nccl`: the group
    will be NCCL's on a GPU here; `torch_version`: what to say instead of torch's own (fault injection)."""
    import torch
    import torch.distributed as dist

    said: dict[str, Any] = {
        "node": node,
        "host": host[:64],
        "aura_hpc": aura_hpc.__version__,
        "torch": torch_version or torch.__version__.split("+")[0],
        "nccl": None,
    }
    if nccl and dist.is_nccl_available():
        # The library's own version (no CUDA context): what NCCL's bootstrap compares across ranks.
        try:  # major.minor.patch: NCCL compares its version code, not torch's suffix field
            said["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version()[:3])
        except Exception as exc:  # a broken libnccl: said, so the others do not wait for this rank
            said["nccl"] = f"unreadable ({str(exc)[:80]})"
    return said


_FIX = {
    "aura_hpc": "pip install the same aura_hpc on every node",
    "torch": "the same torch release on every node, e.g. pip install torch=={want} on {host}",
    "nccl": "the same torch build on every node (its CUDA variant, e.g. +cu126, brings its NCCL) on {host}",
}


def mismatch(said: list[Any], who: str = "rank") -> tuple[str, str]:
    """The first process whose versions differ from the first one's: what differs ("aura_hpc", "torch", "nccl") and
    a one-line error; ("", "") when all agree. `said`: each one's answer in order, a dict or its JSON, as read from a store: a peer's
    bytes, parsed and never trusted to hold what they should."""
    answers: list[dict[str, Any]] = []
    for r, one in enumerate(said):
        if isinstance(one, str):
            with contextlib.suppress(ValueError):
                one = json.loads(one)
        if not isinstance(one, dict):
            return "aura_hpc", f"{who} {r} did not say which versions it runs: {_text(one)} (fix: {_FIX['aura_hpc']})"
        answers.append(one)
    first = answers[0]
    for name in ("aura_hpc", "torch", "nccl"):  # across every rank, one field at a time: NCCL's last, as auto falls back on it
        for r, other in enumerate(answers[1:], start=1):
            want, got = first.get(name), other.get(name)
            if name == "nccl" and (want is None or got is None):
                continue  # a node without NCCL: the backend's own decision names it
            if want != got:
                fix = _FIX[name].format(want=_text(want), host=_text(other.get("host")))
                return name, (
                    f"the nodes run different {name} versions: {_where(who, r, other)} runs {name} {_text(got)} "
                    f"and {_where(who, 0, first)} {name} {_text(want)} (fix: {fix})"
                )
    return "", ""


def _where(who: str, r: int, one: dict[str, Any]) -> str:
    if who == "node":
        return f"node {r} ({_text(one.get('host'))})"
    return f"{who} {r} (node {_text(one.get('node'))}, {_text(one.get('host'))})"


def _text(value: Any) -> str:
    """A peer's value as it may appear in a terminal line: short, printable."""
    return "".join(c if c.isprintable() else "?" for c in str(value)[:64])
