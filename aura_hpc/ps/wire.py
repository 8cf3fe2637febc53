"""The parameter server's transport: torch.distributed's TCPStore for joining, and one gloo
process group of two (server = 0, worker = 1) per worker for the tensors.

Why not one process group for all: its size is fixed when it is made, so nobody could join
late, and one lost member breaks every collective. Why not torch RPC: it is in maintenance
(pytorch #149393) and its parameter-server example hangs beyond two workers (pytorch/examples
#780). A pair group per worker is torch's own point-to-point send/recv over gloo; a worker that
dies breaks only its own pair, and a new pair is made for each one that joins.

A message is a float64 header (HEADER_LEN numbers: kind, version, ...), where the kind says so
one flat tensor of every parameter in the wire dtype, and an HMAC of both under the session key
the two ends derived when they proved the run's secret to each other (ps/auth.py, `handshake`).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aura_hpc.comm import collectives
from aura_hpc.errors import LaunchError
from aura_hpc.ps import auth

HEADER_LEN = 8
# Header kinds. Worker -> server: GRAD (a gradient follows), BYE (leaving). Server -> worker:
# WEIGHTS (weights follow), STOP (training is over or the server is stopping: exit).
GRAD, BYE, WEIGHTS, STOP, PROBE = 1.0, 2.0, 3.0, 4.0, 5.0

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# pybind11 keeps every C++ object it hands to Python in one process-wide map that has no lock of its
# own on GIL builds, and torch's TCPStore and ProcessGroupGloo constructors register their object
# with the GIL released (pybind11 #5473, pytorch #143593). A thread that makes or drops any pybind
# object at that moment (a p2p Work, a store clone) corrupts the map, and the process aborts later
# with "Tried to deallocate unregistered instance": seen on torch 2.6 in a `ps` server pairing with
# a late worker while two others trained. So the pybind objects the server's threads make or drop
# are made and dropped under this lock, and a pair's constructor runs under it only once its peer
# is known to be constructing too, so it holds the lock for milliseconds.
REGISTRY_LOCK = threading.RLock()


@contextmanager
def registry_quiet(*also: Any) -> Iterator[None]:
    """Hold REGISTRY_LOCK, after the locks in `also` (the server's own, so no update, evaluation or
    checkpoint makes pybind objects meanwhile): the order is always theirs first."""
    with ExitStack() as stack:
        for lock in also:
            stack.enter_context(lock)
        stack.enter_context(REGISTRY_LOCK)
        yield


def drop_frames(exc: BaseException) -> None:
    """Clear the tracebacks of `exc` and of the errors it chains, under REGISTRY_LOCK: the pybind
    objects their frames hold (a failed pair's group, its Work) go now, not wherever the error is
    finally dropped."""
    with REGISTRY_LOCK:
        todo, seen = [exc], set()
        while todo:
            e = todo.pop()
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            e.__traceback__ = None
            todo += [e.__cause__, e.__context__]


def host_store(port: int, timeout_s: float) -> dist.TCPStore:
    """The server's store on every interface of this machine (its workers are on the LAN), `port`; a
    clear error when it is taken."""
    try:
        return dist.TCPStore("0.0.0.0", port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        text = str(exc)
        if "in use" in text.lower() or getattr(exc, "errno", None) == errno.EADDRINUSE:
            raise LaunchError(
                f"port {port} is already in use on this machine (another `ps` server?) "
                f"(fix: stop the program using it, or pass --port {port + 1} here and --server ADDR:{port + 1} to the workers)"
            ) from None
        raise LaunchError(f"cannot listen on port {port} ({text.splitlines()[0][:160]}) (fix: --port another free port)") from None


def connect_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise LaunchError(
            f"the parameter server at {addr}:{port} accepted a connection but its store did not answer "
            f"({str(exc).splitlines()[0][:160]}) (fix: check that `python -m aura_hpc ps` runs there on that port)"
        ) from None


def another_client(store: dist.TCPStore, host: str, port: int, timeout_s: float, quiet: Any = ()) -> dist.TCPStore:
    """A second connection to the same store. A pair group's rendezvous waits on its store for the
    peer's keys, and a TCPStore client serves one request at a time: on the shared client, one peer
    that never completes its pair would hold every other store call (the join queue) for the whole
    timeout."""
    clone = getattr(store, "clone", None)
    with registry_quiet(*quiet):  # the store is on this machine: this returns in milliseconds
        if clone is not None:
            return clone()  # type: ignore[no-any-return]
        return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


# The longest one read of the server's own may wait on its store. A key can be deleted by anyone
# between the server's `check` and its `get`, and a TCPStore `get` waits for the key for the client's
# whole timeout (ps.join_timeout_s): on the serve loop's client that held every join and stop signal.
QUICK_S = 5.0


def quick_client(store: dist.TCPStore, port: int) -> dist.TCPStore:
    """A client of the server's store of its own whose reads give up after QUICK_S (the store is on
    this machine: a read of a key that is there answers in milliseconds)."""
    client = another_client(store, "127.0.0.1", port, QUICK_S)
    client.set_timeout(timedelta(seconds=QUICK_S))  # a clone keeps the timeout of the store it was made from
    return client


# The most a pair's constructor may take once both ends said they are there: it runs under
# REGISTRY_LOCK, which every link's message takes, so a peer that stalls it (one that died right
# then, or a stranger who wrote a gloo address into the pair's keys) holds every link this long.
CONSTRUCT_S = 15.0


def pair_group(store: dist.Store, prefix: str, rank: int, my_addr: str, timeout_s: float, quiet: Any = ()) -> dist.ProcessGroup:
    """The two-member gloo group of one worker and the server, on the interface of `my_addr`.
    Both ends first say they are there (waiting up to `timeout_s`, outside any lock), then construct
    under REGISTRY_LOCK (and the locks in `quiet`), bounded by CONSTRUCT_S; messages then wait
    `timeout_s` each (Link)."""
    timeout = timedelta(seconds=timeout_s)
    construct = timedelta(seconds=min(timeout_s, CONSTRUCT_S))
    with REGISTRY_LOCK:
        prefixed = dist.PrefixStore(prefix, store)
    try:
        prefixed.set(f"aura/here/{rank}", "1")
        prefixed.wait([f"aura/here/{1 - rank}"], timeout)
        with registry_quiet(*quiet):
            options_type = getattr(dist.ProcessGroupGloo, "_Options", None)
            if options_type is None:  # an older or newer torch without the options object: default device
                return dist.ProcessGroupGloo(prefixed, rank, 2, construct)
            options = options_type()
            options._timeout = construct
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=my_addr)]
            group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
            del options  # dropped here, under the lock
            return group
    finally:
        with REGISTRY_LOCK:
            del prefixed


@dataclass
class Traffic:
    """The totals of the links gone (stats.add_link_totals reads it as one link). A link that ended
    cleanly (a goodbye, the server's stop) is released, its gloo pair's threads and sockets with it:
    kept, each cost 3 threads and 6 descriptors until "too many open files". One lost mid-message is
    kept: gloo may still hold the transfer it waited for, and dropping a pair then can abort."""

    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    round_trip_s: float = 0.0
    kept: list[Any] = field(default_factory=list)

    def add(self, link: Link, release: bool, drop: bool = True) -> None:
        """`drop=False`: the caller drops the group itself with drop_group, outside a lock of its own (taking
        REGISTRY_LOCK waits for a pair being made, up to CONSTRUCT_S)."""
        self.bytes_sent += link.bytes_sent
        self.bytes_received += link.bytes_received
        self.round_trips += link.round_trips
        self.round_trip_s += link.round_trip_s
        if not release:
            self.kept.append(link.group)
        if drop:
            drop_group(link)


def drop_group(link: Link) -> None:
    with REGISTRY_LOCK:  # the group's destructor is a pybind object's (see REGISTRY_LOCK)
        link.group = None  # type: ignore[assignment]


# A live server answers a message in a round trip (its evaluations and checkpoints run beside the links): a stop this
# much older than the wait's answer finds the server silent (a dropped network, a stopped process).
STOP_GRACE_S = 10.0


class StopOutlasted(Exception):
    """A stop (Ctrl+C, SIGTERM) asked for while a message waited on a silent server for longer than STOP_GRACE_S."""


class LinkLost(RuntimeError):
    """The other end of a pair closed or fell silent (gloo's first line), or failed to prove the run's
    secret; told apart from errors of the model or the optimizer, which are not a lost peer."""


CHALLENGE, WORKER_PROOF, SERVER_PROOF, MAC_TAG = 10, 11, 12, 2


@dataclass
class Link:
    """One end of a worker's pair group, counting what crosses it."""

    group: dist.ProcessGroup
    rank: int
    timeout_s: float = 120.0  # each message: a peer silent this long is gone (ps.worker_timeout_s)
    session: bytes = b""  # set by handshake(); every message after it carries an HMAC under it
    sent_seq: int = 0
    received_seq: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    round_trip_s: float = 0.0
    _header: torch.Tensor = field(default_factory=lambda: torch.zeros(HEADER_LEN, dtype=torch.float64))
    stopping: Callable[[], bool] | None = None  # a worker's stop flag: a wait it outlasts by the grace is left
    stop_seen: float | None = None  # when a wait first saw the stop (monotonic): the grace counts across the waits
    slowest_wait_s: float = 0.0  # the longest wait that ended, on the stopping path: the grace is at least 3 times it

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def _p2p(self, op: Any, tensor: torch.Tensor, tag: int) -> int:
        work = None
        try:
            with REGISTRY_LOCK:  # gloo's send/recv only queue the transfer: the wait is outside
                work = op(self.group, tensor, self.peer, tag)
            if self.stopping is None:
                work.wait(timedelta(seconds=self.timeout_s))
            else:
                held, work = [work], None  # moved, not dropped: the waiting thread drops it, under the lock
                self._wait_unless_stopped(held)
        except RuntimeError as exc:
            raise LinkLost(failure(exc)) from None
        finally:
            with REGISTRY_LOCK:
                del work
        return tensor.numel() * tensor.element_size()

    def _wait_unless_stopped(self, held: list[Any]) -> None:
        """gloo's wait on a thread of its own: in the main thread it held off the stop handler for as long as the
        server stayed silent (ps.worker_timeout_s, 120 s), and a gloo Work can be neither polled (is_completed turns
        true only inside wait) nor aborted. A stop that the waits outlast by the grace leaves the last one behind (a
        daemon thread, blocked until the timeout or the process's end). The thread holds the Work alone (in `held`)
        and nothing of the link, and drops it under the lock."""
        failed: list[BaseException] = []
        done = threading.Event()
        timeout = timedelta(seconds=self.timeout_s)

        def wait() -> None:
            try:
                held[0].wait(timeout)
            except BaseException as exc:  # handed to the waiting thread, which raises it there, without the frames of
                failed.append(exc.with_traceback(None))  # this thread (a Python-level wait's frame holds the Work)
            finally:
                with REGISTRY_LOCK:
                    held.clear()
                done.set()

        began = time.monotonic()
        threading.Thread(target=wait, name="aura-ps-wait", daemon=True).start()
        while not done.wait(0.2):
            if self.stopping is not None and self.stopping():
                now = time.monotonic()
                self.stop_seen = self.stop_seen if self.stop_seen is not None else now
                # A large message on a slow link (a model's weights over Wi-Fi) may take longer than STOP_GRACE_S.
                grace = min(max(STOP_GRACE_S, 3 * self.slowest_wait_s), self.timeout_s)
                if now - self.stop_seen > grace:
                    raise StopOutlasted(f"the server did not answer within {grace:.0f} s of the stop")
        self.slowest_wait_s = max(self.slowest_wait_s, time.monotonic() - began)
        if failed:
            raise failed.pop()  # not kept in a list the raising frame holds: no cycle keeps the error's frames

    def _mac(self, direction: int, seq: int, header: torch.Tensor, payload: torch.Tensor | None) -> torch.Tensor:
        mac = hmac.new(self.session, digestmod=hashlib.sha256)
        mac.update(f"msg|{direction}|{seq}|".encode())
        mac.update(header.numpy().tobytes())
        if payload is not None:
            mac.update(memoryview(payload.contiguous().view(torch.uint8).numpy()))
        return torch.frombuffer(bytearray(mac.digest()), dtype=torch.uint8)

    def send(self, header: list[float], payload: torch.Tensor | None = None) -> None:
        h = torch.zeros(HEADER_LEN, dtype=torch.float64)
        h[: len(header)] = torch.tensor(header, dtype=torch.float64)
        self.bytes_sent += self._p2p(collectives.send, h, 0)
        if payload is not None:
            self.bytes_sent += self._p2p(collectives.send, payload, 1)
        self.bytes_sent += self._p2p(collectives.send, self._mac(self.rank, self.sent_seq, h, payload), MAC_TAG)
        self.sent_seq += 1

    def recv(self, buffers: dict[float, torch.Tensor]) -> tuple[list[float], torch.Tensor | None]:
        """One message: its header, and its tensor received into buffers[kind] when the kind has one.
        A message whose HMAC does not check out (or a header that is not numbers) loses the link."""
        self.bytes_received += self._p2p(collectives.recv, self._header, 0)
        header = [float(x) for x in self._header.tolist()]
        if not all(math.isfinite(x) for x in header):
            raise LinkLost("a message header that is not finite numbers")
        payload = buffers.get(header[0])
        if payload is not None:
            self.bytes_received += self._p2p(collectives.recv, payload, 1)
        got = torch.empty(auth.TAG_BYTES, dtype=torch.uint8)
        self.bytes_received += self._p2p(collectives.recv, got, MAC_TAG)
        expected = self._mac(self.peer, self.received_seq, self._header, payload)
        if not hmac.compare_digest(got.numpy().tobytes(), expected.numpy().tobytes()):
            raise LinkLost("a message failed its HMAC check (not from the run's peer, altered, or replayed)")
        self.received_seq += 1
        return header, payload

    def timed_round_trip(self, started: float) -> None:
        self.round_trips += 1
        self.round_trip_s += time.perf_counter() - started

    @property
    def mean_round_trip_ms(self) -> float:
        return 1000.0 * self.round_trip_s / self.round_trips if self.round_trips else 0.0


def handshake(link: Link, key: bytes, nonce: str) -> None:
    """Both ends prove the run's secret over the new pair (the server challenges, the worker answers,
    the server answers back), then share a session key for the messages' HMACs."""

    def raw(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def proof(who: str, challenge: bytes) -> bytes:
        return hmac.new(key, f"{who}|{nonce}|".encode() + challenge, hashlib.sha256).digest()

    buf = torch.empty(32, dtype=torch.uint8)
    if link.rank == 0:
        challenge = secrets.token_bytes(32)
        link._p2p(collectives.send, raw(challenge), CHALLENGE)
        link._p2p(collectives.recv, buf, WORKER_PROOF)
        if not hmac.compare_digest(buf.numpy().tobytes(), proof("worker", challenge)):
            raise LinkLost("the peer on this pair did not prove the run's secret")
        link._p2p(collectives.send, raw(proof("server", challenge)), SERVER_PROOF)
    else:
        link._p2p(collectives.recv, buf, CHALLENGE)
        challenge = buf.numpy().tobytes()
        link._p2p(collectives.send, raw(proof("worker", challenge)), WORKER_PROOF)
        link._p2p(collectives.recv, buf, SERVER_PROOF)
        if not hmac.compare_digest(buf.numpy().tobytes(), proof("server", challenge)):
            raise LinkLost("the peer on this pair did not prove the run's secret (not the parameter server)")
    link.session = proof("session", challenge)


NONFINITE_LOSS = -1.0  # a loss that is NaN or inf, as sent: a header must be finite numbers (recv), a loss never is negative


def loss_on_wire(loss: float) -> float:
    return loss if math.isfinite(loss) else NONFINITE_LOSS


def grad_header(header: list[float], version: int) -> tuple[int, float, int, int]:
    """(based on version, loss, shard position, tokens) of a GRAD message, each in range (else the
    peer is dropped: these numbers index the server's state). A diverged worker's loss is NaN: its
    gradient is dropped, the worker stays (sent as it was, its header lost the link and the worker
    recomputed the same batches after its timeout, for ever when the data made the NaN)."""
    _, based_on, loss, position, tokens = header[:5]
    if not (0 <= based_on <= version and 0 <= position < 2**53 and 0 < tokens <= 2**40):
        raise LinkLost(f"a gradient header out of range (version {based_on:g}, position {position:g}, tokens {tokens:g})")
    return int(based_on), loss if loss >= 0 else math.nan, int(position), int(tokens)


def failure(exc: BaseException) -> str:
    """The first line of a gloo error without its source-file prefix: '[.../pair.cc:537] Connection closed
    by peer [10.0.0.2]:4011' -> 'Connection closed by peer [10.0.0.2]:4011'."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". This is typically")[0][:160]


def timed_out(first_line: str) -> bool:
    """A silent peer (a Wi-Fi drop, a frozen PC) rather than a closed connection (a process gone)."""
    return "imed out" in first_line
