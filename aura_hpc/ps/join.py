"""Joining a parameter-server run through the server's TCPStore.

A worker takes a ticket (an atomic counter in the store), writes its request (host, address,
wanted rank, fingerprint) under it and waits for the server's reply under the same ticket.
The server reads tickets in order, so exactly one place decides ranks: two workers asking for
the same rank cannot both get it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from aura_hpc.config import RunConfig
from aura_hpc.errors import ConfigError, LaunchError

COUNTER = "join/count"
# A ticket whose request never arrives (its worker died between the two writes) is skipped after this.
ABANDONED_TICKET_S = 5.0


def request_join(store: dist.Store, request: dict[str, Any], server: str, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """(ticket, the server's reply); a refusal is raised with the server's one-line reason."""
    ticket = int(store.add(COUNTER, 1))
    store.set(f"join/{ticket}", json.dumps(request))
    key = f"join/{ticket}/reply"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise LaunchError(
                f"the parameter server at {server} took the join request but did not answer within {timeout_s:.0f}s "
                "(fix: look at the server's terminal; it may be saving or stopping — start the worker again)"
            )
        time.sleep(0.1)
    reply: dict[str, Any] = json.loads(store.get(key))
    if not reply.get("ok"):
        error = ConfigError if reply.get("kind") == "config" else LaunchError
        raise error(str(reply.get("error")))
    return ticket, reply


class Tickets:
    """The server's side: join requests in ticket order."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.next = 1
        self._waiting_since: float | None = None

    def poll(self) -> tuple[int, dict[str, Any]] | None:
        key = f"join/{self.next}"
        if self.store.check([key]):
            ticket = self.next
            self.next += 1
            self._waiting_since = None
            return ticket, json.loads(self.store.get(key))
        if self.store.check([COUNTER]) and int(self.store.add(COUNTER, 0)) >= self.next:
            now = time.monotonic()
            self._waiting_since = self._waiting_since or now
            if now - self._waiting_since > ABANDONED_TICKET_S:
                self.next += 1
                self._waiting_since = None
        return None

    def reply(self, ticket: int, reply: dict[str, Any]) -> None:
        self.store.set(f"join/{ticket}/reply", json.dumps(reply))


def refusal(message: str, kind: str = "launch") -> dict[str, Any]:
    return {"ok": False, "kind": kind, "error": message}


def fingerprint(cfg: RunConfig, data_path: str) -> dict[str, str]:
    """What the server and every worker must agree on, by part, so a mismatch can be named."""
    manifest = json.loads((Path(data_path) / "manifest.json").read_text(encoding="utf-8"))
    t = cfg.train
    return {
        "model": cfg.model_fingerprint(),
        "data": str(manifest.get("data_sha256", "")),
        "train": f"batch_size={t.batch_size} grad_accum={t.grad_accum} precision={t.precision} seed={t.seed} loss={t.loss}",
    }


# The parts of the fingerprint, what each is called in a refusal, and the fix.
_PARTS = (
    ("model", "model (shape or data.seq_len)", "the same --config/--set as the server"),
    ("data", "prepared data", "the same data: copy the server's prepared directory (data.path) to the worker"),
    ("train", "train settings", "the same --config/--set as the server"),
)


def decide(req: dict[str, Any], ours: dict[str, str], workers: int, taken: dict[int, str], stopping: bool) -> dict[str, Any]:
    """The server's answer to one join request; `taken` describes the connected worker of each rank."""
    if req.get("probe"):  # `check --server`: no rank, no training
        return {"ok": True, "rank": -1}
    host = req.get("host", "?")
    theirs = req.get("fingerprint", {})
    for part, what, fix in _PARTS:
        if theirs.get(part) != ours[part]:
            return refusal(
                f"worker {host} has another {what} than the server ({theirs.get(part)} vs {ours[part]}) "
                f"(fix: start the worker with {fix}; the server prints the exact command)",
                "config",
            )
    if stopping:
        return refusal("the parameter server is stopping (fix: start the worker again after the server restarts)")
    wanted = int(req.get("rank") or 0)
    if wanted:
        if not 1 <= wanted <= workers:
            return refusal(
                f"--worker-rank {wanted} is outside 1..{workers} (the server was started with --workers {workers}) "
                f"(fix: a rank from 1 to {workers}, or omit --worker-rank to be given a free one)"
            )
        if wanted in taken:
            return refusal(
                f"worker rank {wanted} is already taken by {taken[wanted]} "
                "(fix: omit --worker-rank to be given a free rank, or use another one)"
            )
        return {"ok": True, "rank": wanted}
    free = [r for r in range(1, workers + 1) if r not in taken]
    if not free:
        return refusal(f"all {workers} worker ranks are taken (fix: restart the server with --workers {workers + 1} to add a worker)")
    return {"ok": True, "rank": free[0]}
