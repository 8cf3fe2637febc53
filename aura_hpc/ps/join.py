"""Joining a parameter-server run through the server's TCPStore.

A worker picks a random nonce, writes its request (host, address, wanted rank, settings, and the
server's epoch: a random value each start of the server publishes at `join/epoch`) with an HMAC under
the run's secret to `join/req/<nonce>`, announces the nonce on the `join/queue` list and waits for
`join/reply/<nonce>`, which it believes only with the server's HMAC over that nonce. It announces
again every few seconds while it waits, so a request someone overwrote or a queue someone reset
costs a retry, not the join. The server reads the queue in order (one place decides ranks) and
treats every byte of it as hostile: sizes are bounded, types checked, requests without a valid HMAC
refused with a logged line, and nothing read there ever names a file. A request is deleted once
read, a reply once believed. A replayed request (its nonce answered already, for as long as the
server runs) gets its old reply and nothing else; one signed for an earlier start of the server is
refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from aura_hpc.config import RunConfig, per_machine
from aura_hpc.errors import ConfigError, LaunchError, one_line
from aura_hpc.ps import auth

log = logging.getLogger("aura_hpc")

QUEUE = "join/queue"
EPOCH = "join/epoch"
ANNOUNCE_EVERY_S = 3.0
COMPACT_BYTES = 64 * 1024  # a queue read this far is started afresh (those still waiting announce again)
_EPOCH = re.compile(r"^[0-9a-f]{32}$")
MAX_QUEUE_BYTES = 256 * 1024  # a flooded queue is dropped (legitimate workers announce again)
MAX_REQUEST_BYTES = 64 * 1024
NOTE_WINDOW_S, NOTES_PER_WINDOW = 10.0, 20
_NONCE = re.compile(r"^[0-9a-f]{32}$")


class StoppedWaiting(Exception):
    """A stop (Ctrl+C, SIGTERM) asked for while the join waited for the server's answer."""


def request_join(
    store: dist.Store,
    key: bytes,
    request: dict[str, Any],
    server: str,
    timeout_s: float,
    stopping: Callable[[], bool] | None = None,
) -> tuple[str, dict[str, Any]]:
    """(nonce, the server's reply); a refusal is raised with the server's one-line reason, a stop asked
    for meanwhile (`stopping()`) as StoppedWaiting."""
    nonce = secrets.token_hex(16)
    reply_key = f"join/reply/{nonce}"
    deadline = time.monotonic() + timeout_s
    announced, refused_unsigned = 0.0, None
    while True:
        now = time.monotonic()
        if refused_unsigned is not None and now > min(deadline, refused_unsigned + UNSIGNED_GRACE_S):
            raise LaunchError(
                f"the parameter server refused this worker: it does not hold the run's secret (fix: start the worker with "
                f"{auth.SECRET_ENV}=... exactly as `ps` printed it, or --secret-file with the server's secret)"
            )
        if now - announced > ANNOUNCE_EVERY_S:
            # Signed for the server's current start, read again each time (a server restarted meanwhile).
            body = json.dumps({**request, "nonce": nonce, "epoch": _server_epoch(store)}, sort_keys=True)
            store.set(f"join/req/{nonce}", json.dumps({"body": body, "mac": auth.tag(key, "join", body)}))
            store.append(QUEUE, nonce + "\n")
            announced = now
        if store.check([reply_key]):
            reply = _believed_reply(store.get(reply_key), key, nonce)
            if reply is UNSIGNED_REFUSAL:
                # Anyone who reads the queue can write this for our nonce: the server re-answers each announce,
                # signed if we share its secret; only a refusal that stands decides.
                refused_unsigned = refused_unsigned if refused_unsigned is not None else now
                with contextlib.suppress(RuntimeError, ValueError):
                    store.delete_key(reply_key)
                reply = None
            if reply is not None:
                break
        if stopping is not None and stopping():
            for left in (reply_key, f"join/req/{nonce}"):
                with contextlib.suppress(RuntimeError, ValueError):
                    store.delete_key(left)
            raise StoppedWaiting(server)
        if now > deadline:
            raise LaunchError(
                f"the parameter server at {server} took the join request but did not answer within {timeout_s:.0f}s "
                "(fix: look at the server's terminal; it may be saving or stopping — start the worker again)"
            )
        time.sleep(0.1)
    for done in (reply_key, f"join/req/{nonce}"):
        with contextlib.suppress(RuntimeError, ValueError):
            store.delete_key(done)
    if not reply.get("ok"):
        error = ConfigError if reply.get("kind") == "config" else LaunchError
        raise error(str(reply.get("error")))
    return nonce, reply


def _server_epoch(store: dist.Store) -> str:
    """The server's epoch, or "" before it has published one (the server then refuses and the worker
    announces again)."""
    if not store.check([EPOCH]):
        return ""
    value = store.get(EPOCH)[:64].decode("ascii", "replace")
    return value if _EPOCH.match(value) else ""


UNSIGNED_REFUSAL: dict[str, Any] = {"ok": False, "unsigned": True}
UNSIGNED_GRACE_S = 3 * ANNOUNCE_EVERY_S  # the server answers each announce: a signed reply comes within one


def _believed_reply(raw: bytes, key: bytes, nonce: str) -> dict[str, Any] | None:
    """The server's signed reply, UNSIGNED_REFUSAL (the server's for a worker without the secret, or a
    stranger's), or None (not from the server)."""
    try:
        outer = json.loads(raw[:MAX_REQUEST_BYTES])
        if outer.get("unauthenticated") is True:
            return UNSIGNED_REFUSAL  # the server cannot sign for a worker that does not share its secret; nor can a stranger
        body = outer["body"]
        if not auth.valid(key, outer.get("mac"), "reply", nonce, body):
            return None
        reply = json.loads(body)
        return reply if isinstance(reply, dict) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# ---- the server's side ------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    nonce: str
    epoch: str
    host: str
    addr: str
    pid: int
    rank: int
    rejoin: bool
    probe: bool
    settings: dict[str, Any]


def _fail(what: str) -> ValueError:
    return ValueError(what)


def parse_request(nonce: str, body: str) -> Request:
    """A verified request's fields, type- and range-checked (a ValueError names the first bad one)."""
    d = json.loads(body, parse_constant=lambda c: (_ for _ in ()).throw(_fail(f"{c} is not a number here")))
    if not isinstance(d, dict) or d.get("nonce") != nonce:
        raise _fail("not a request object for this nonce")
    epoch = d.get("epoch", "")
    if not isinstance(epoch, str) or (epoch and not _EPOCH.match(epoch)):
        raise _fail("epoch is not the server's kind of value")
    host, addr, pid, rank = d.get("host"), d.get("addr"), d.get("pid"), d.get("rank", 0)
    if not isinstance(host, str) or not 0 < len(host) <= 64 or not host.isprintable():
        raise _fail("host is not a short printable string")
    if not isinstance(addr, str) or len(addr) > 64:
        raise _fail("addr is not a string")
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise _fail(f"addr {addr[:40]!r} is not an IP address") from None
    for name, value, top in (("pid", pid, 2**31), ("rank", rank, 1 << 20)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise _fail(f"{name} is not a whole number in range")
    flags = {k: d.get(k, False) for k in ("rejoin", "probe")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise _fail("rejoin/probe are not true/false")
    settings = d.get("settings", {})
    if not isinstance(settings, dict) or len(settings) > 400:
        raise _fail("settings is not a mapping")
    for k, v in settings.items():
        if not isinstance(k, str) or len(k) > 80 or not (v is None or isinstance(v, (str, int, float, bool))):
            raise _fail("settings holds something other than plain values")
        if isinstance(v, str) and len(v) > 1000:
            raise _fail(f"setting {k[:40]} is too long")
    return Request(nonce, epoch, host, addr, pid, rank, flags["rejoin"], flags["probe"], settings)


class JoinQueue:
    """The server's view of the join queue: verified requests in order, everything else refused."""

    def __init__(self, store: dist.Store, key: bytes) -> None:
        self.store, self.key = store, key
        self.epoch = secrets.token_hex(16)  # this start of the server: requests signed for another are refused
        self.offset = 0
        # nonce -> the signed reply, for as long as the server runs (written again when announced again).
        # Only requests that proved the secret get here: nothing a stranger sends can push one out.
        self.answered: dict[str, str] = {}
        self.refused_unauth: OrderedDict[str, None] = OrderedDict()  # the newest 4,096, each logged once
        self._window_start = 0.0
        self._notes = 0
        self._quiet = 0

    def _note(self, message: str) -> None:
        """Each refusal of hostile or broken traffic is logged, up to NOTES_PER_WINDOW lines per
        window (a flood then becomes one count, so it cannot fill the disk through the log)."""
        now = time.monotonic()
        if now - self._window_start > NOTE_WINDOW_S:
            if self._quiet:
                log.warning("... and %d more refused join attempts in the last %.0fs", self._quiet, NOTE_WINDOW_S)
            self._window_start, self._notes, self._quiet = now, 0, 0
        if self._notes >= NOTES_PER_WINDOW:
            self._quiet += 1
            return
        self._notes += 1
        log.warning("%s", one_line(message)[:300])

    def publish_epoch(self) -> None:
        self.store.set(EPOCH, self.epoch)

    def poll(self) -> list[Request]:
        """Verified requests announced since the last poll. A store error (someone sent it a value it
        refuses, or it deleted a key under us) is a logged line and an empty poll, never the server's end."""
        try:
            return self._poll()
        except Exception as exc:  # whatever a peer's bytes provoke: one poll lost, never the server (and its run)
            self._note(f"the store answered a read of the join queue with an error ({one_line(str(exc))[:120]}); reading it afresh")
            self.offset = 0
            return []

    def _poll(self) -> list[Request]:
        if not self.store.check([EPOCH]) or self.store.get(EPOCH)[:64].decode("ascii", "replace") != self.epoch:
            self.store.set(EPOCH, self.epoch)  # deleted or rewritten by someone: workers sign what they read there
        if not self.store.check([QUEUE]):
            self.offset = 0
            return []
        raw = self.store.get(QUEUE)
        if len(raw) < self.offset:
            self._note("the join queue was reset by someone; reading it afresh (workers announce themselves again)")
            self.offset = 0
        flooded = len(raw) > MAX_QUEUE_BYTES
        if flooded:  # what fits is still read; the rest is dropped, and legitimate workers announce again
            self._note(f"the join queue was flooded ({len(raw)} bytes); starting it afresh (workers announce themselves again)")
            raw = raw[:MAX_QUEUE_BYTES]
            self.store.delete_key(QUEUE)
        end = raw.rfind(b"\n", self.offset) + 1
        lines, self.offset = raw[self.offset : end].split(b"\n"), 0 if flooded else max(end, self.offset)
        if self.offset > COMPACT_BYTES and len(raw) == end:  # read to its end: started afresh, kept small
            self.store.delete_key(QUEUE)
            self.offset = 0
        found, read = [], set()
        for line in lines:
            nonce = line.decode("ascii", "replace").strip()
            if not nonce or nonce in read:  # one request read once a poll: a replay announced 4,000 times took 4,000 seats
                continue
            read.add(nonce)
            req = self._read(nonce)
            if req is not None:
                found.append(req)
        return found

    def _read(self, nonce: str) -> Request | None:
        if not _NONCE.match(nonce):
            self._note(f"refused a join announcement that is not a nonce ({nonce[:40]!r})")
            return None
        if nonce in self.answered:  # announced again: its reply may have been overwritten
            self.store.set(f"join/reply/{nonce}", self.answered[nonce])
            return None
        key = f"join/req/{nonce}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        self.store.delete_key(key)  # read once: it leaves the store (a stranger listing keys sees less)
        try:
            if len(raw) > MAX_REQUEST_BYTES:
                raise ValueError(f"{len(raw)} bytes")
            outer = json.loads(raw)
            body, mac = outer["body"], outer["mac"]
            if not isinstance(body, str):
                raise ValueError("no body")
        except (ValueError, KeyError, TypeError):
            self._note(f"refused a malformed join request {nonce[:8]}… (not the protocol of this aura_hpc)")
            return None
        if not auth.valid(self.key, mac, "join", body):
            if nonce not in self.refused_unauth:
                self.refused_unauth[nonce] = None
                if len(self.refused_unauth) > 4096:
                    self.refused_unauth.popitem(last=False)
                self._note(f"refused a join {nonce[:8]}… that does not prove the run's secret")
                self.store.set(f"join/reply/{nonce}", json.dumps({"unauthenticated": True}))
            return None
        try:
            req = parse_request(nonce, body)
            if req.epoch != self.epoch:
                # Signed for an earlier start of this server (a replay), or before the worker read the
                # epoch: not answered, so the worker signs again with the epoch it reads next time.
                self._note(f"ignored a join {nonce[:8]}… signed for another start of the server (a replay, or a worker catching up)")
                return None
            return req
        except (ValueError, TypeError, RecursionError) as exc:
            self._note(f"refused a join {nonce[:8]}… with the secret but a malformed request: {exc}")
            self.reply(
                nonce, refusal(f"the server could not read this worker's request ({exc}) (fix: the same aura_hpc version on every PC)")
            )
            return None

    def reply(self, nonce: str, reply: dict[str, Any]) -> None:
        body = json.dumps(reply)
        signed = json.dumps({"body": body, "mac": auth.tag(self.key, "reply", nonce, body)})
        self.answered[nonce] = signed
        self.store.set(f"join/reply/{nonce}", signed)


def refusal(message: str, kind: str = "launch") -> dict[str, Any]:
    return {"ok": False, "kind": kind, "error": message}


def settings(cfg: RunConfig, data_path: str) -> dict[str, Any]:
    """What the server and every worker must agree on, key by key, so a mismatch is named."""
    manifest = json.loads((Path(data_path) / "manifest.json").read_text(encoding="utf-8"))
    out: dict[str, Any] = {"data.sha256": str(manifest.get("data_sha256", "")), "data.seq_len": cfg.data.seq_len}
    out["data.shuffle_window"] = cfg.data.shuffle_window  # the sample order: the shards are disjoint only under one
    free = per_machine.PER_PS_WORKER | {"model.preset"}  # a preset's name: its values are compared one by one
    out.update(per_machine.shared(cfg, ("model", "train"), free))
    for name in ("wire_dtype", "max_staleness", "staleness_weight", "push_every"):
        if hasattr(cfg.ps, name):
            out[f"ps.{name}"] = getattr(cfg.ps, name)
    return out


def _shown(value: Any) -> str:
    text = one_line(repr(value) if isinstance(value, str) else str(value))
    return text if len(text) <= 40 else text[:37] + "..."


def decide(req: Request, ours: dict[str, Any], workers: int, taken: dict[int, str], stopping: bool) -> dict[str, Any]:
    """The server's answer to one verified join request; `taken` describes the connected worker of each rank."""
    if req.probe:  # `check --server`: no rank, no training
        return {"ok": True, "rank": -1}
    host = one_line(req.host)
    theirs = req.settings
    for name in sorted(set(ours) | set(theirs)):
        if name in per_machine.PER_PS_WORKER or theirs.get(name) == ours.get(name):
            continue
        if name == "data.sha256":
            return refusal(
                f"worker {host} has other prepared data than the server (fix: copy the server's prepared directory "
                "(data.path) to the worker)",
                "config",
            )
        return refusal(
            f"worker {host} has {name}={_shown(theirs.get(name, '(not set)'))} but the server has {name}={_shown(ours.get(name))} "
            "(fix: start the worker with the same --config/--set as the server; the server prints the exact command)",
            "config",
        )
    if stopping:
        return refusal("the parameter server is stopping (fix: start the worker again after the server restarts)")
    wanted = req.rank
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
        return refusal(
            f"all {workers} worker ranks are taken (fix: stop one of them first; a run with more workers is a new server "
            f"with --workers {workers + 1} and its own --run-name: a checkpoint splits the data in {workers})"
        )
    return {"ok": True, "rank": free[0]}
