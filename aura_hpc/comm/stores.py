"""The key-value stores ranks meet in, listening only where they must, and the run secret ranks prove there.

torch's TCPStore listens on every interface (IPv4 and IPv6) whatever host it is given, and anyone
who reaches it can list, read and write every key. So a store we host is bound to one address (a
socket we bind, handed over as `master_listen_fd`): loopback for a run on one machine, the master's
address for a LAN or Slurm run. The elastic agent's two stores (the c10d rendezvous, and the one its
workers share) are made through `aura-c10d`, a rendezvous backend registered here that binds both.

Reaching a store proves nothing: before any collective every rank proves the run's secret there
(`prove`): each publishes a fresh nonce, then an HMAC over every rank's nonce; a stranger who reaches
the port can stop a run, but cannot stand in for a rank.

torch's rendezvous keeps its state pickled in node 0's store, and every launcher unpickles it. Ours reads
it first as data (comm/rendezvous_state.py): a state rewritten by a stranger stops the run instead of
running code on every node, and a deleted one stops it at once instead of after three of the store's
60 s timeouts.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from aura_hpc.comm import rendezvous_state
from aura_hpc.comm.store_sockets import NotAStore, StoreAddressInUse, bound_server, client  # where one listens, how it is dialled

log = logging.getLogger("aura_hpc")

RDZV_BACKEND = "aura-c10d"
SECRET_ENV = "AURA_RUN_SECRET"
# Set by node 0's launcher in each rendezvous store it makes: after a hang, the other nodes relaunch once it differs.
ROUND_KEY = "aura-round"
NNODES_KEY = "aura-nnodes"  # node 0's --nnodes: a node started with another count is refused, not left waiting or trained short
SECRET_FILE = "run.secret"  # in the run directory, mode 600 (Slurm jobs; LAN node 0 keeps its own)
MIN_SECRET = 16


# ---- the elastic agent's rendezvous ------------------------------------------------------


# Called with each rendezvous handler made (and its store) while a launch runs.
HANDLER_HOOKS: list[Callable[[Any, Any], None]] = []


def register_rendezvous() -> None:
    """`aura-c10d`: torch's c10d rendezvous with both of the agent's stores bound to an address (once per process)."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    if getattr(register_rendezvous, "done", False):
        return
    _quiet_a_keep_alive_timers_self_join()

    class BoundBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return RDZV_BACKEND

        def __init__(self, store: Any, run_id: str, max_nodes: int, hosted: bool = False) -> None:
            super().__init__(store, run_id)
            self.max_nodes = max_nodes
            self.hosted = hosted

        def _still_there(self) -> None:
            # Every backend writes torch's sentinel under the key when it is made, so a key that is gone was
            # deleted: torch's `get` would wait on it for the store's whole timeout, three times on the way out,
            # and its compare_set on a missing key answers with the old state, as if nothing had happened.
            if not self._call_store("check", [self._key]):
                raise self._tampered(rendezvous_state.StateTampered("deleted"))

        def get_state(self) -> Any:
            self._still_there()
            return super().get_state()

        def set_state(self, state: bytes, token: Any = None) -> Any:
            self._still_there()
            return super().set_state(state, token)

        def _decode_state(self, base64_state: bytes) -> Any:
            # Both get_state and set_state (compare_set answers with what the store holds) come through here,
            # and torch unpickles what this returns.
            what = _tampering_in(base64_state, self.max_nodes)
            if what is not None:
                raise self._tampered(what)
            return super()._decode_state(base64_state)

        def _tampered(self, what: rendezvous_state.StateTampered) -> Exception:
            rendezvous_state.record(what)  # torch's close swallows the error: the launcher reads the record (launch/agent.py)
            if self.hosted:  # node 0: the state as the stranger left it stays readable for the other nodes
                _EVIDENCE[:] = [self._store]
            return RendezvousStateError(f"the rendezvous state in the store was {what}")

    def create(params: Any) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
        timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
        try:
            if params.get_as_bool("is_host", False):
                store = bound_server(host, port, timeout, multi_tenant=True)
                store.set(NNODES_KEY, str(params.max_nodes))
                store.set(ROUND_KEY, f"{time.time():.6f}-{os.getpid()}")
            else:
                store = client(host, port, timeout, give_up_s=float(params.get_as_int("join_timeout", 600) or 600))
                _same_node_count(store, params.max_nodes, host, port)
        except NotAStore as exc:
            raise RendezvousConnectionError(
                f"{exc} (fix: --master-addr and --master-port of node 0's `local`, which prints them; another port if that one is taken)"
            ) from None
        except StoreAddressInUse:
            raise RendezvousConnectionError(
                f"{host}:{port} is already in use, so the rendezvous cannot listen there (fix: another --master-port, or omit "
                "it on a single machine so a free one is taken)"
            ) from None
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise RendezvousConnectionError(
                    f"{host} is not an address of this machine, so the rendezvous cannot listen there (fix: --master-addr this "
                    "machine's own LAN address, as `ip -4 addr` shows it)"
                ) from None
            raise RendezvousConnectionError(f"the connection to the rendezvous store at {host}:{port} failed: {exc}") from exc
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"the connection to the rendezvous store at {host}:{port} failed: {exc}") from exc
        hosted = params.get_as_bool("is_host", False)
        handler = create_handler(store, BoundBackend(store, params.run_id, params.max_nodes, hosted), params)
        for hook in HANDLER_HOOKS:  # the launch's own seam between two attempts (launch/final_status.py)
            hook(handler, store)
        own = params.local_addr or host
        if hasattr(handler, "_create_tcp_store_server"):  # the store the workers share (torch >= 2.6)
            handler._create_tcp_store_server = lambda _addr, p: bound_server(own, p, timeout, multi_tenant=True)
        else:
            log.warning("this torch makes the store its workers share on every interface (fix: torch 2.6 or newer)")
        return handler

    rendezvous_handler_registry.register(RDZV_BACKEND, create)
    register_rendezvous.done = True  # type: ignore[attr-defined]


def _quiet_a_keep_alive_timers_self_join() -> None:
    """torch's rendezvous handler stops its keep-alive timer with a finalizer that sets the timer's stop event, then
    joins its thread. A launch ended by a signal leaves the handler open (torch keeps the rendezvous for the other
    nodes), so the garbage collector runs that finalizer on whichever thread it runs: on the timer's own thread the
    join fails after the stop was set (the thread ends at its next tick), and that traceback was the last line a
    Ctrl+C printed, under the verdict. Only that error is dropped."""
    import sys
    import traceback

    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        # Not by the finalizer object: from Python 3.14 a weakref callback's error is said without it.
        frames = [frame.f_code for frame, _ in traceback.walk_tb(unraisable.exc_traceback)]
        if (
            unraisable.exc_type is RuntimeError
            and str(unraisable.exc_value) == "cannot join current thread"
            and any(c.co_name == "_stop_thread" and Path(c.co_filename).parts[-2:] == ("rendezvous", "utils.py") for c in frames)
        ):
            return
        before(unraisable)

    sys.unraisablehook = hook


# compare_set of a value no key of ours holds: the store answers with what the key holds and writes nothing; on a
# missing key it answers with this at once (libuv's server also wakes a `get` waiting on that key, with b"").
_ABSENT = b"aura: no value"


def read_now(store: Any, key: str) -> bytes | None:
    """The value under `key`, or None where there is none, without waiting: `check` then `get` leaves a window in
    which a stranger's delete makes `get` wait the store's whole timeout holding the client's lock, and torch's
    keep-alive shares the handler's client (its heartbeats stop, and the other nodes drop this one)."""
    held = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if held == _ABSENT else held


# NCCL's watchdog tells every rank's monitor thread of a failed or timed-out collective under these keys at the
# store's root, past any prefix (ProcessGroupNCCL's globalStore; remote_error only with TORCH_NCCL_PROPAGATE_ERROR).
# The workers' store of a `local` launch outlives an attempt: left there, every rank of the restarted attempt read
# the old signal and NCCL's monitor aborted it (SIGABRT) a heartbeat timeout later, healthy, its restarts spent.
NCCL_SIGNALS = ("exception_dump", "remote_error")


def forget_nccl_signals(store: Any, rank: int) -> None:
    """On an attempt's first rank, before any rank proves itself there (so before any group exists): the signals of
    the attempt before. AURA_FAULT_NCCL_SIGNAL (tests): one left, as NCCL's watchdog leaves it, for the next attempt."""
    cleared = [key for key in NCCL_SIGNALS if read_now(store, key) is not None and store.delete_key(key)]
    if cleared:
        print(f"[rank{rank}] cleared {', '.join(cleared)}: NCCL's signal of a failed collective of the attempt before", flush=True)
    elif os.environ.get("AURA_FAULT_NCCL_SIGNAL") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        store.set(NCCL_SIGNALS[0], rank.to_bytes(4, "little"))


def _same_node_count(store: Any, nnodes: int, host: str, port: int) -> None:
    """Node 0's --nnodes against this node's. Torch's rendezvous completes at its own max_nodes: node 0 with 3 and
    node 1 with 2 trained on 2 machines, and the third waited for ever on a full rendezvous, without a word."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    try:
        # Node 0 writes it, then ROUND_KEY (as older releases did, without it): once the round is there, its absence
        # says an older node 0 (torch's own checks only), never a node 0 not done yet.
        store.wait([ROUND_KEY], timedelta(seconds=10))  # a node 0 of a release before it: this long, then on
        if not store.check([NNODES_KEY]):
            return
        said = store.get(NNODES_KEY).decode("ascii", "replace")
    except (RuntimeError, TimeoutError, OSError):
        return
    if said.isdigit() and int(said) != nnodes:
        raise RendezvousConnectionError(
            f"node 0 at {host}:{port} started this run with --nnodes {said}, this node with --nnodes {nnodes} "
            f"(fix: the same --nnodes on every node)"
        )


def _tampering_in(base64_state: bytes, max_nodes: int) -> rendezvous_state.StateTampered | None:
    """What is wrong with a value of the state's key, read as data; None: torch's own (its state, or the
    sentinel every backend writes when it is made)."""
    import base64
    import binascii

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    if base64_state == C10dRendezvousBackend._NULL_SENTINEL.encode():
        return None
    if len(base64_state) > 2 * rendezvous_state.max_bytes(max_nodes):
        return rendezvous_state.StateTampered(f"rewritten (a value of {len(base64_state):,} bytes)")
    try:
        state = base64.b64decode(base64_state)  # as torch decodes it: not validating
    except binascii.Error:
        return rendezvous_state.StateTampered("rewritten (not base64)")
    try:
        rendezvous_state.check(state, max_nodes)
    except rendezvous_state.StateTampered as exc:
        return exc
    return None


# Node 0's rendezvous store, kept past its agent once the state in it was found tampered with: the other
# nodes' launchers, whose workers then stop without their own agent having read the state, read it there and
# name it too (else they could only say that node 0 went away). Each writes TAMPERING_NAMED/<its node> when it has.
_EVIDENCE: list[Any] = []
TAMPERING_NAMED = "aura-tampering-named"
NAMING_WAIT_S = 15.0


def tampering_at(addr: str, port: int, run_id: str, nnodes: int, node: int, ran: bool) -> rendezvous_state.StateTampered | None:
    """What this launcher's agent found tampered with; on a node other than 0 whose workers ran and stopped,
    else what node 0's store holds under the state's key, and node 0 is told this node has named it."""
    what = rendezvous_state.tampering_seen()
    if node == 0 or nnodes < 2 or not ran:
        return what
    try:
        socket.create_connection((addr, port), timeout=2.0).close()  # refused at once where node 0 is gone (a client retries)
        store = client(addr, port, timedelta(seconds=5), give_up_s=3.0)
        key = f"torch.rendezvous.{run_id}"
        if what is None and not store.check([key]):
            # Node 0 relaunching after a hang makes a new store, then writes torch's sentinel: absent twice is deleted.
            time.sleep(0.5)
            what = None if store.check([key]) else rendezvous_state.StateTampered("deleted")
        elif what is None:
            what = _tampering_in(store.get(key), nnodes)
        if what is not None:
            store.set(f"{TAMPERING_NAMED}/{node}", "1")
    except Exception:  # node 0's store gone (or never reached): nothing more to learn there
        return what
    return what


def forget_tampering() -> None:
    """Before a launch: nothing found yet, and no store of an earlier launch held (its port is this one's)."""
    rendezvous_state.forget_tampering()
    _EVIDENCE.clear()


def hold_for_the_other_nodes(nnodes: int, wait_s: float = NAMING_WAIT_S) -> None:
    """Node 0, having found the state tampered with: its store stays up until every other node has read it
    and named it (or wait_s), then goes. A stranger who writes those keys only shortens the wait."""
    if not _EVIDENCE:
        return
    store = _EVIDENCE[0]
    keys = [f"{TAMPERING_NAMED}/{n}" for n in range(1, nnodes)]
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(Exception):
        while keys and not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.2)
    _EVIDENCE.clear()


# ---- the run secret ----------------------------------------------------------------------


def key_of(secret: str) -> bytes:
    return hashlib.sha256(b"aura_hpc run v1|" + secret.encode()).digest()


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def strong_enough(secret: str, node_rank: int = 0) -> str:
    """A secret someone chose, refused when short: anyone reading the store sees the nonces and every
    rank's HMAC over them, enough to try a short secret's every value offline (`k9`: 0.01 s). On a node other
    than node 0 it is node 0's, pasted: one made anew there could never match."""
    if len(secret) < MIN_SECRET:
        from aura_hpc.errors import LaunchError

        made = "unset it on node 0 to have one made, or use e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`"
        fix = f"paste the whole {SECRET_ENV}=... line node 0 printed (also in its run folder, {SECRET_FILE})" if node_rank else made
        raise LaunchError(
            f"{SECRET_ENV} is {len(secret)} characters, under the {MIN_SECRET} a run's secret needs: a stranger who reads the "
            f"rendezvous store could guess it (fix: {fix})"
        )
    return secret


class NotProven(RuntimeError):
    """A rank did not prove the run's secret (a stranger at the store, or a node started without it)."""


def prove(store: Any, prefix: str, rank: int, world: int, secret: str, timeout_s: float, who: str = "", claim: str = "") -> list[str]:
    """Every rank proves it holds the run's secret before the first collective. Each publishes a fresh
    nonce, then an HMAC over its rank, its claim (where it sits: node and local rank), its own identity
    and every rank's nonce; each checks every other rank's HMAC over the nonces as it read them. A
    replayed proof (old nonces), a rank that does not hold the secret, nonces someone rewrote between
    ranks, or a claim rewritten after it was signed all fail here, on every rank. Returns every rank's
    claim as proven."""
    key = key_of(secret)
    nonce = secrets.token_hex(16)
    store.set(f"{prefix}/nonce/{rank}", nonce)
    nonces = _read_all(store, [f"{prefix}/nonce/{r}" for r in range(world)], timeout_s)
    if any(len(n) != 32 for n in nonces) or nonces[rank] != nonce:
        raise NotProven("the rendezvous store holds nonces this run's ranks did not write (someone else is writing there)")
    transcript = "|".join(nonces).encode()

    def signed(r: int, said: str) -> bytes:
        return hmac.new(key, f"rank|{r}|{world}|{said}|".encode() + transcript, hashlib.sha256).hexdigest().encode()

    store.set(f"{prefix}/proof/{rank}", signed(rank, claim) + b"|" + claim.encode())
    proofs = _read_all(store, [f"{prefix}/proof/{r}" for r in range(world)], timeout_s)
    claims = [p.partition("|")[2] for p in proofs]
    # Bytes, not text: a stranger's non-ASCII value read as text made compare_digest raise TypeError.
    bad = [r for r, p in enumerate(proofs) if not hmac.compare_digest(p.partition("|")[0].encode(), signed(r, claims[r]))]
    if bad:
        raise NotProven(
            f"rank(s) {bad} did not prove this run's secret{who} (fix: start every node with the {SECRET_ENV}=... that node 0 "
            "printed; if you did, something else on the network is talking to the rendezvous port: stop it, or firewall the "
            "port to the training machines)"
        )
    return claims


def _read_all(store: Any, keys: list[str], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
            raise NotProven(f"rank(s) {', '.join(missing)} did not take part in proving the run's secret within {timeout_s:.0f} s")
        time.sleep(0.02)
    try:
        return [store.get(k)[:256].decode("ascii", "replace") for k in keys]
    except RuntimeError:  # DistStoreError: deleted between check and get (anyone who reaches the store can)
        raise NotProven("the ranks' proofs were deleted from the rendezvous store as they were read (someone else writes there)") from None
