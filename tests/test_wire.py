"""What crosses between ranks, checked in one process or two: collectives on the group's device, JSON and
tensors instead of pickles, stores that listen on one address, the run secret, the nodes' layout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from aura_hpc.comm import collectives, stores, tensor_tree
from tests.conftest import free_port


def test_state_crosses_as_data_and_nothing_else_decodes() -> None:
    import random

    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]
    state = {
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}}, "param_groups": groups},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "scaler": {},
        "nan": float("nan"),
    }  # fmt: skip
    for back in (
        tensor_tree.from_bytes(*tensor_tree.to_bytes(state)),
        tensor_tree.from_json(json.loads(json.dumps(tensor_tree.to_json(state)))),
    ):
        assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
        assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95) and 0 in back["optimizer"]["state"]
        random.setstate(back["rng"]["python"])  # a tuple again, as random wants it
        torch.set_rng_state(back["rng"]["torch"])
        assert back["nan"] != back["nan"]
    with pytest.raises(TypeError):
        tensor_tree.to_parts({"f": print})
    for hostile in ({"__x": 1}, {"__T": "9"}, {"__m": [[[], 1]]}, {"a": 1, "b": 2}):
        with pytest.raises(ValueError):
            tensor_tree.from_parts(hostile, {})


def test_a_collective_refuses_a_tensor_off_its_groups_device_and_the_probe_sees_host_tensors() -> None:
    from aura_hpc.train.instruments.probes import RunProbe

    group = collectives.Group("world", torch.device("meta"))  # stands for a GPU: any device but the host
    with pytest.raises(RuntimeError, match="got a tensor on cpu; its collectives take tensors on meta"):
        collectives.all_reduce(torch.zeros(2), group)
    # The probe of a run (AURA_PROBE_RUN) tracks tensors made on the host by our code; here this file is "ours".
    probe = RunProbe(track_host_tensors=True, ours=("tests/test_wire.py",))
    try:
        collectives.all_reduce(torch.zeros(2))  # what link_advice.measure_link did: NCCL refuses it
        collectives.all_reduce(torch.tensor([1.0, 2.0])[:1])  # host data, through a view
        collectives.all_reduce(torch.zeros(2, device=collectives.world().device))  # made where the group's tensors live
        collectives.all_reduce(torch.zeros(2), collectives.Group("checkpoint-io", torch.device("cpu"), host_only=True))
    finally:
        probe.close()
    assert probe.calls == {"all_reduce@world": 3, "all_reduce@checkpoint-io": 1}
    assert sum(probe.host_tensors.values()) == 2 and all("test_wire.py" in k for k in probe.host_tensors), probe.host_tensors


def test_a_reseed_after_the_first_step_is_seen_unless_this_ranks_generators_are_kept() -> None:
    from aura_hpc.train.instruments.probes import RunProbe
    from aura_hpc.train.process.runtime import keep_device_rng, rng_kept

    probe = RunProbe(track_host_tensors=False)
    probe.arm_reseed_watch(rng_kept)
    try:
        before = torch.get_rng_state()
        with keep_device_rng(torch.device("cpu")):
            torch.manual_seed(123)  # what torch's PowerSGD hook does, guarded as strategies/ddp.py guards it
        assert torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(7)
    finally:
        probe.close()
    assert list(probe.reseeds) == [next(iter(probe.reseeds))] and "test_wire.py" in next(iter(probe.reseeds))
    assert torch.manual_seed.__module__ == "torch.random"  # put back


def test_a_store_listens_on_its_address_alone() -> None:
    import psutil

    server = stores.bound_server("127.0.0.1", 0, timedelta(seconds=10))
    try:
        port = server.port
        listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening
        client = stores.client("127.0.0.1", port, timedelta(seconds=10))
        client.set("k", "v")
        assert server.get("k") == b"v"
        with pytest.raises(stores.StoreAddressInUse):
            stores.bound_server("127.0.0.1", port, timedelta(seconds=5))
    finally:
        del server


def test_a_name_with_an_ipv6_address_first_binds_the_ipv4_one_every_other_step_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """--master-addr desktop.lan, whose router's DNS answers with a global IPv6 address first: the store listened there,
    while the route, `check` and the other nodes' checks took its IPv4 address (a node without IPv6 then found nothing
    listening). Here the resolver's answer for a name is made so."""
    import socket

    import psutil

    real = socket.getaddrinfo

    def dual(host: Any, port: Any, family: int = 0, type: int = 0, *args: Any) -> list[Any]:
        if host != "desktop.lan":
            return real(host, port, family, type, *args)
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", int(port or 0), 0, 0))
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port or 0)))
        return [v4] if family == socket.AF_INET else [v6, v4]

    monkeypatch.setattr(socket, "getaddrinfo", dual)
    server = stores.bound_server("desktop.lan", 0, timedelta(seconds=10))
    try:
        listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == server.port}
        assert listening == {"127.0.0.1"}, listening
        # And a client dials that address: torch's own lookup tried the IPv6 one first, until its timeout.
        stores.client("desktop.lan", server.port, timedelta(seconds=5), give_up_s=20).set("k", "v")
        assert server.get("k") == b"v"
    finally:
        del server


def test_a_single_machines_rendezvous_binds_a_free_port_itself_and_names_a_taken_one() -> None:
    """`local` on one machine no longer picks a port at plan time and binds it seconds later (a port any connection
    could take meanwhile as its local port: a failed start in the suite): its plan says port 0 and the store binds
    a free one as it starts. A port the user gave that is taken by then is named with the fix."""
    import psutil
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def params(port: int) -> RendezvousParameters:
        return RendezvousParameters(
            stores.RDZV_BACKEND, f"127.0.0.1:{port}", "t", 1, 1, local_addr="127.0.0.1", is_host=True, join_timeout=10
        )

    def listening() -> set[int]:
        me = psutil.Process().pid
        return {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid == me}

    stores.register_rendezvous()
    before = listening()
    handler = rendezvous_handler_registry.create_handler(params(0))
    try:
        new = listening() - before
        assert len(new) == 1 and 0 not in new, new
    finally:
        handler.shutdown()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousConnectionError, match=rf"127.0.0.1:{port} is already in use.*\(fix: another --master-port"):
            rendezvous_handler_registry.create_handler(params(port))


class _MakesADirectory:
    """What a stranger at node 0's port would write in place of the rendezvous state: code, once unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        import os

        return (os.mkdir, (str(self.path),))


def _short_string(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _tuple_tree(depth: int) -> bytes:
    levels = b"".join(b"h" + bytes([k]) + b"\x86\x94" for k in range(depth))  # BINGET k, TUPLE2, MEMOIZE
    return b"\x80\x04}(" + b")\x94" + levels + b"Nu."  # {tree: None}


def _node_chain(depth: int) -> bytes:
    node_class = _short_string("torch.distributed.elastic.rendezvous.dynamic_rendezvous") + _short_string("_NodeDesc") + b"\x93\x94"

    def node(addr: bytes, pid: bytes) -> bytes:  # NEWOBJ, MEMOIZE (as torch's pickle does), BUILD with its three fields
        fields = _short_string("addr") + addr + _short_string("pid") + pid + _short_string("local_id") + b"K\x00"
        return b"h\x00)\x81\x94}(" + fields + b"ub"

    chain = node(_short_string("a"), b"K\x01") + b"".join(node(b"h" + bytes([k]), b"h" + bytes([k])) for k in range(1, depth + 1))
    return b"\x80\x04\x8f(" + node_class + chain + b"\x90."  # a set of them


def _hosting_alone(port: int, run_id: str, read_timeout: int) -> Any:
    """The parameters of our rendezvous backend for node 0 of a one-node run on loopback."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend=stores.RDZV_BACKEND, endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=1, max_nodes=1,
        is_host=True, read_timeout=read_timeout, local_addr="127.0.0.1",
    )  # fmt: skip


def _past_the_cache(handler: Any) -> None:
    """What a sleep of 1.1 s did, without the wait: torch serves the rendezvous state from a 1 s cache, and
    the next read goes to the store once its last read is older than that."""
    holder = handler._state_holder
    assert isinstance(holder._last_sync_time, float | int), "torch renamed its cache's clock: this test would read the cached state"
    holder._last_sync_time = -1


def test_the_rendezvous_state_is_read_as_data_and_a_deleted_one_stops_at_once(tmp_path: Path) -> None:
    """torch's c10d rendezvous keeps its state pickled in node 0's store, and every launcher unpickles it.
    A stranger who rewrites it (code, a change to torch's classes, another object or shape, a huge value)
    or deletes it stops the run, named: nothing of it runs, and a deleted state does not hold the agent
    for the store's 60 s timeout."""
    import base64
    import datetime
    import pickle

    from torch.distributed.elastic.rendezvous import RendezvousStateError, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    from aura_hpc.comm import rendezvous_state

    stores.register_rendezvous()
    port = free_port()
    params = _hosting_alone(port, "wire", read_timeout=60)
    handler = rendezvous_handler_registry.create_handler(params)
    eq_before = _RendezvousState.__dict__.get("__eq__")
    try:
        handler.next_rendezvous()  # one node: the state now holds a round, a participant, its heartbeat
        stranger = stores.client("127.0.0.1", port, timedelta(seconds=10))
        key = "torch.rendezvous.wire"
        real = base64.b64decode(stranger.get(key))
        rendezvous_state.check(real, 1)  # what torch wrote passes
        named = f"{stores.TAMPERING_NAMED}/1"
        # Node 1's launcher, whose workers stopped, reads node 0's store too: torch's own state is no tampering.
        assert stores.tampering_at("127.0.0.1", port, "wire", 2, 1, ran=True) is None and not stranger.check([named])
        made = tmp_path / "made-by-the-state"
        extra = _RendezvousState()
        extra.round = 2**40  # type: ignore[attr-defined]
        extra.owner = "someone"  # type: ignore[attr-defined]
        on_the_class = (
            b"\x80\x04" + _short_string("torch.distributed.elastic.rendezvous.dynamic_rendezvous") + _short_string("_RendezvousState")
            + b"\x93N}" + _short_string("__eq__") + b"Ns\x86b."
        )  # fmt: skip
        naive = _RendezvousState()
        naive.last_heartbeats[next(iter(pickle.loads(real).participants))] = datetime.datetime(2026, 11, 27)  # type: ignore[attr-defined]
        rewrites = [
            ("it names posix.mkdir", pickle.dumps(_MakesADirectory(made))),
            ("not a rendezvous state", on_the_class),  # a BUILD on torch's class itself: refused, the class untouched
            ("a dict, not a rendezvous state", pickle.dumps({"round": 1})),
            ("pickle opcode EMPTY_LIST", pickle.dumps([1, 2])),
            ("fields are not torch's", pickle.dumps(extra)),
            ("heartbeats that are not torch's", pickle.dumps(naive)),
            ("a value of", b"x" * (2 << 20)),
            ("not a rendezvous state", real[: len(real) // 2]),
            ("not a rendezvous state", real[:-1] + b"N."),  # two objects left at STOP: a pile of them costs memory
            # A few bytes that stand for 2**depth leaves, hashed in C with the GIL held (Ctrl+C never ran):
            # a tuple fetched again as a dict key's halves, and nodes whose address is the node before.
            ("an object used twice that no rendezvous state shares", _tuple_tree(24)),
            ("a Node whose fields are not torch's", _node_chain(18)),
        ]
        for said, bits in rewrites:
            rendezvous_state.forget_tampering()
            stranger.set(key, base64.b64encode(bits))
            assert stranger.check([key])  # a round trip: the set has landed (a client's set does not wait for it)
            _past_the_cache(handler)
            with pytest.raises(RendezvousStateError, match="rendezvous state in the store was rewritten"):
                handler.num_nodes_waiting()
            seen = rendezvous_state.tampering_seen()
            assert seen is not None and said in str(seen), (said, seen)
            rendezvous_state.forget_tampering()  # node 1, whose agent read nothing, finds the same in node 0's store
            assert said in str(stores.tampering_at("127.0.0.1", port, "wire", 2, 1, ran=True)), said
        assert not made.exists()
        assert _RendezvousState.__dict__.get("__eq__") is eq_before  # torch's own class is never what a pickle changes
        rendezvous_state.forget_tampering()
        stranger.delete_key(key)
        _past_the_cache(handler)
        began = time.monotonic()
        with pytest.raises(RendezvousStateError, match="was deleted"):
            handler.num_nodes_waiting()
        assert time.monotonic() - began < 30  # torch's own `get` waited out read_timeout (60 s) on a missing key
        assert str(rendezvous_state.tampering_seen()) == "deleted"
        rendezvous_state.forget_tampering()
        assert str(stores.tampering_at("127.0.0.1", port, "wire", 2, 1, ran=True)) == "deleted" and stranger.check([named])
        # Node 0 keeps its store up for the others until they have named it (or its wait ends): of three nodes,
        # node 2 never does; of two, node 1 has, so node 0 goes at once.
        began = time.monotonic()
        stores.hold_for_the_other_nodes(3, wait_s=2)
        assert time.monotonic() - began >= 2
        _past_the_cache(handler)
        with pytest.raises(RendezvousStateError, match="was deleted"):
            handler.num_nodes_waiting()
        began = time.monotonic()
        stores.hold_for_the_other_nodes(2, wait_s=120)
        assert time.monotonic() - began < 60
    finally:
        stores.forget_tampering()
        handler.shutdown()


def test_the_spare_watch_reads_the_state_without_holding_the_store_on_a_deleted_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node other than 0 reads the rendezvous state every few seconds to learn whether it waits as a spare. It
    read with `get`, which on a key a stranger deleted waits the store's whole timeout holding the client's lock:
    the agent's own read, which names the deletion at once, waited behind it (in CI node 1 then outlived node 0's
    store and said it had lost node 0). It reads without waiting, and says nothing of a state that is not there."""
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous import RendezvousStateError, rendezvous_handler_registry

    from aura_hpc.comm import rendezvous_state
    from aura_hpc.launch import spare_watch

    monkeypatch.setattr(spare_watch, "POLL_S", 0.05)
    stores.register_rendezvous()
    port = free_port()
    params = _hosting_alone(port, "spare", read_timeout=8)
    plan = SimpleNamespace(node_rank=1, nnodes=2, master=f"127.0.0.1:{port}")
    with spare_watch.SpareWatch(plan, "torch.rendezvous.spare") as watch:
        handler = rendezvous_handler_registry.create_handler(params)
        try:
            assert watch._thread is not None and watch._thread.is_alive()  # the handler's hook started it
            handler.next_rendezvous()  # the state holds a round with this node a participant
            time.sleep(0.3)
            assert not watch.spare
            stores.client("127.0.0.1", port, timedelta(seconds=10)).delete_key("torch.rendezvous.spare")
            time.sleep(1.1)  # past the state's 1 s cache; the watch has read the missing key many times
            began = time.monotonic()
            with pytest.raises(RendezvousStateError, match="was deleted"):
                handler.num_nodes_waiting()
            assert time.monotonic() - began < 3, time.monotonic() - began  # before: up to read_timeout (8 s) behind the watch
            assert watch._thread.is_alive() and not watch.spare and not watch.said
        finally:
            rendezvous_state.forget_tampering()
            stores.forget_tampering()
            handler.shutdown()


def test_torchs_keep_alive_timer_stopped_on_its_own_thread_prints_nothing_and_stops() -> None:
    """A launch ended by Ctrl+C leaves torch's rendezvous handler open; its keep-alive timer is stopped by a finalizer
    the garbage collector runs, on whatever thread: on the timer's own, the finalizer's join raised, and that
    traceback was the last line under the launcher's verdict (CI: "RuntimeError: cannot join current thread").
    That one error is dropped (the timer stops all the same); any other in a finalizer is still printed."""
    script = """
import gc, sys, time, weakref
from datetime import timedelta
from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer
from aura_hpc.comm import stores
stores.register_rendezvous()
class Handler: pass
handler = Handler()
handler.cycle = handler  # freed by the collector only, as torch's handler is
handler.timer = _PeriodicTimer(timedelta(seconds=0.05), gc.collect)  # the collector runs on the timer's thread
handler.timer.start()
thread = handler.timer._thread
del handler
time.sleep(1.0)
print("timer stopped:", not thread.is_alive(), flush=True)
class Other: pass
other = Other()
weakref.finalize(other, lambda: 1 / 0)
del other
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "timer stopped: True" in run.stdout, run.stdout + run.stderr
    assert "cannot join current thread" not in run.stderr, run.stderr
    assert "ZeroDivisionError" in run.stderr, run.stderr  # another finalizer's error is still said


def _prove(rank: int, port: int, secret: str, out: str) -> None:
    store = stores.client("127.0.0.1", port, timedelta(seconds=20))
    try:
        stores.prove(store, "attempt0/auth", rank, 2, secret, 15)
        Path(out).write_text("ok")
    except stores.NotProven as exc:
        Path(out).write_text(str(exc))


def test_every_rank_proves_the_run_secret_and_a_stranger_cannot(tmp_path: Path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for name, secrets in (("same", ("s" * 20, "s" * 20)), ("wrong", ("s" * 20, "t" * 20))):
        server = stores.bound_server("127.0.0.1", 0, timedelta(seconds=30))
        procs = [ctx.Process(target=_prove, args=(r, server.port, secrets[r], str(tmp_path / f"{name}{r}"))) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        said = [(tmp_path / f"{name}{r}").read_text() for r in (0, 1)]
        if name == "same":
            assert said == ["ok", "ok"], said
        else:
            assert all("did not prove this run's secret" in s for s in said), said
            # What a stranger reading the store sees cannot be replayed: the next attempt's nonces differ.
            keys = [f"attempt0/auth/proof/{r}" for r in (0, 1)]
            assert all(len(server.get(k).partition(b"|")[0]) == 64 for k in keys)
        del server


def test_a_proof_signs_each_ranks_place_and_a_hostile_one_is_a_refusal_not_a_traceback() -> None:
    """Ranks said their place (node, local rank) in plain keys anyone could rewrite after the proof: a
    stranger renumbered the ranks or made them crash. A non-ASCII proof raised TypeError in compare_digest."""
    import hashlib
    import hmac
    import threading

    secret = "s" * 20
    for case in ("honest", "non-ASCII", "another place"):
        server = stores.bound_server("127.0.0.1", 0, timedelta(seconds=30))
        said: dict[str, Any] = {}

        def rank0(port: int = server.port, out: dict[str, Any] = said) -> None:
            client = stores.client("127.0.0.1", port, timedelta(seconds=20))
            try:
                out["claims"] = stores.prove(client, "a/auth", 0, 2, secret, 15, claim="0,0")
            except Exception as exc:  # what rank 0 meets, whatever it is
                out["error"] = exc

        thread = threading.Thread(target=rank0)
        thread.start()
        server.set("a/auth/nonce/1", "f" * 32)  # rank 1, played by the test
        server.wait(["a/auth/nonce/0"])
        transcript = (server.get("a/auth/nonce/0").decode() + "|" + "f" * 32).encode()
        signed = hmac.new(stores.key_of(secret), b"rank|1|2|1,0|" + transcript, hashlib.sha256).hexdigest().encode()
        proof = {"honest": signed + b"|1,0", "non-ASCII": b"\xff" * 64, "another place": signed + b"|0,0"}[case]
        server.set("a/auth/proof/1", proof)
        thread.join(30)
        if case == "honest":
            assert said == {"claims": ["0,0", "1,0"]}, said
        else:
            assert type(said.get("error")) is stores.NotProven and "rank(s) [1] did not prove" in str(said["error"]), (case, said)
        del server


def test_slurm_and_torchrun_layouts_are_read_into_nodes() -> None:
    from aura_hpc.train.process.dist_env import DistEnv, tasks_per_node

    assert tasks_per_node("2(x3),1") == (2, 2, 2, 1) and tasks_per_node("4") == (4,) and tasks_per_node("junk") == ()
    slurm = DistEnv.from_environ(
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]"}
    )
    assert slurm.node_ranks == [[0, 1], [2, 3]] and slurm.peer_host == "gpu008"
    equal = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "AURA_NODE_RANK": "0", "AURA_NNODES": "2"}
    torchrun = DistEnv.from_environ(equal)
    assert torchrun.rank == 1 and torchrun.node_sizes == (2, 2) and torchrun.launcher_rank == 1
    # 1 process on one node, 2 on the other: the layout is learned when the ranks meet (distributed.join).
    unequal = DistEnv.from_environ({**equal, "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert unequal.node_sizes == ()


def test_ranks_that_met_without_a_secret_where_other_machines_reach_are_told_so() -> None:
    from aura_hpc.train.process.dist_env import DistEnv
    from aura_hpc.train.process.distributed import unproven

    by_hand = DistEnv(world_size=4, master_addr="192.168.1.10", master_port=29400)
    said = unproven(by_hand, None)
    assert said and "any machine that reaches 192.168.1.10:29400 can take a rank's place" in said
    assert "fix: start every node with `python -m aura_hpc local`" in said and "AURA_RUN_SECRET" in said
    assert unproven(by_hand, "s3cret") is None
    assert unproven(DistEnv(world_size=4, master_addr="localhost"), None) is None
    assert unproven(DistEnv(world_size=1, master_addr="192.168.1.10"), None) is None


def test_diloco_replicas_follow_the_nodes_and_never_span_two() -> None:
    import dataclasses

    from aura_hpc.errors import ConfigError
    from aura_hpc.train.process.dist_env import DistEnv
    from aura_hpc.train.strategies.diloco import replica_partition

    laptop_and_desktop = dataclasses.replace(DistEnv(world_size=3), node_sizes=(1, 2))
    assert replica_partition(laptop_and_desktop, 0) == [[0], [1, 2]]
    assert replica_partition(laptop_and_desktop, 3) == [[0], [1], [2]]
    two_by_two = dataclasses.replace(DistEnv(world_size=4), node_sizes=(2, 2))
    assert replica_partition(two_by_two, 0) == [[0, 1], [2, 3]] == replica_partition(two_by_two, 2)
    with pytest.raises(ConfigError, match="across nodes"):
        replica_partition(dataclasses.replace(DistEnv(world_size=4), node_sizes=(1, 3)), 2)
    with pytest.raises(ConfigError, match="does not divide"):
        replica_partition(laptop_and_desktop, 2)


def _json_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from aura_hpc.train.process import distributed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    collectives.set_world(torch.device("cpu"))
    got = {
        "gather": collectives.gather_json({"rank": rank, "text": "ñ" * (3 + rank)}),
        "broadcast": collectives.broadcast_json(["from", rank] if rank == 1 else None, src=1),
        "bytes": collectives.broadcast_bytes(b"\x00\xff" * 5 if rank == 0 else None).hex(),
        "sum": collectives.reduce_values([1.5, float(rank)]),
        "max": collectives.reduce_values([float(rank)], op="max"),
        "flags": collectives.flags(rank == 1),
    }
    from aura_hpc.ops import link_advice

    if rank == 1:
        time.sleep(0.3)  # a rank that is slower to time must not make the ranks take different probe sizes
    link = link_advice.measure_link(2, probe_mb=0.25)
    got["probe_mb"], got["mbit"] = link.probe_mb, link.mbit
    Path(out).write_text(json.dumps(got))
    collectives.barrier()
    distributed.shutdown()  # not destroy_process_group alone: torch < 2.8's gloo could deadlock there


def test_objects_cross_as_json_between_two_ranks(tmp_path: Path) -> None:
    import multiprocessing as mp

    port = free_port()
    procs = [mp.get_context("spawn").Process(target=_json_ranks, args=(r, port, str(tmp_path / f"r{r}.json"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for r in (0, 1):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["gather"] == [{"rank": 0, "text": "ñññ"}, {"rank": 1, "text": "ññññ"}]
        assert got["broadcast"] == ["from", 1] and got["bytes"] == "00ff" * 5
        assert got["sum"] == [3.0, 1.0] and got["max"] == [1.0] and got["flags"] == [False, True]
    # The link probe grows past 0.25 MB (too small to time: 528 Mbit/s where `check` saw 9,776 on one
    # machine), and both ranks grew it alike (each step follows the slowest rank's timing).
    probes = [json.loads((tmp_path / f"r{r}.json").read_text())["probe_mb"] for r in (0, 1)]
    assert probes[0] == probes[1] > 0.25, probes


def test_nothing_listens_beyond_loopback_in_a_single_machine_run(tmp_path: Path, prepared: Path) -> None:
    """`ss -ltn` during a single-machine run: the launcher's two stores and every worker's gloo sockets
    listen on 127.0.0.1 only (before: the stores on every interface, IPv4 and IPv6)."""
    import psutil

    from tests.conftest import SMALL_MODEL, cli_env

    args = ["local", "--output-dir", str(tmp_path), "--set", f"data.path={prepared}", *SMALL_MODEL, "--set", "train.max_steps=400"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", *args], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 120
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "step 5/" in line or time.monotonic() > deadline:
                break
        family = psutil.Process(proc.pid)
        pids = {proc.pid, *(c.pid for c in family.children(recursive=True))}
        for c in psutil.net_connections("tcp"):
            if c.status == "LISTEN" and c.pid in pids:
                seen.add(c.laddr.ip)
        assert seen and seen <= {"127.0.0.1"}, (seen, "".join(lines[-20:]))
    finally:
        proc.terminate()
        proc.wait(60)
    assert socket.gethostname()


def test_an_fp16_step_is_skipped_on_the_device_without_reading_the_flag() -> None:
    """Under fp16 the agreed `bad` flag (a NaN loss on another rank) joins GradScaler's own inf flags: a
    fused optimizer skips the update with no host read (before: bool(bad) every step, a GPU sync)."""
    from aura_hpc.train.instruments.probes import StepProbe
    from aura_hpc.train.strategies.base import Wrapped

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    wrapped = Wrapped(model, model)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (True, False):
        wrapped.backward(model(torch.ones(3, 4)).sum(), scaler)
        wrapped.grad_norm(opt, scaler, 0.0)
        probe = StepProbe("all")
        with probe.watch(1, compiled=False):
            wrapped.update(opt, scaler, torch.tensor(bad))
        assert not probe.report()["syncs"], probe.report()["syncs"]
        changed = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert changed is (not bad)
    assert scaler.get_scale() < 2.0**8  # the skipped step counted as an overflow


def test_a_backend_that_cannot_start_on_one_rank_makes_every_rank_fall_back_before_any_blocks(tmp_path: Path, prepared: Path) -> None:
    """NCCL with device_id connects every rank at once: a rank that cannot start it left the others
    waiting inside it, never reaching the agreement on the fallback. The ranks now say whether they can
    start it first (through the store), then start it together or fall back together. On CPU gloo plays
    NCCL's part (AURA_FAULT_BACKEND=1: rank 1 cannot start it)."""
    from tests.conftest import SMALL_MODEL, run_cli

    t0 = time.monotonic()
    args = ["local", "--output-dir", str(tmp_path), "--set", f"data.path={prepared}", *SMALL_MODEL, "--set", "train.max_steps=4"]
    r = run_cli([*args, "--set", "dist.init_timeout_s=120"], timeout=300, AURA_FAULT_BACKEND="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "could not start (rank 1: fault injection: the backend cannot start on this rank); fallback=gloo" in r.stdout
    assert "all 2 ranks finished at step 4" in r.stdout
    assert time.monotonic() - t0 < 100  # nobody waited for dist.init_timeout_s
    # A rank whose set-up fails once the others are inside it (rank 0 waits there for rank 1): its failure, counted in the
    # store beside its answer, ends rank 0's wait within seconds, not after dist.init_timeout_s.
    t0 = time.monotonic()
    out = ["--output-dir", str(tmp_path / "connect"), "--max-restarts", "0", "--set", "dist.init_timeout_s=120"]
    r = run_cli([*args, *out], timeout=300, AURA_FAULT_BACKEND="1:connect")
    said = r.stdout + r.stderr + "".join(p.read_text() for p in (tmp_path / "connect").rglob("rank0*.log"))
    assert r.returncode != 0 and "could not connect the ranks: rank 1 failed in its set-up (fault injection" in said, said[-3000:]
    assert time.monotonic() - t0 < 100
    # A GPU this torch has no kernels for (a Pascal laptop, a recent wheel) is no NCCL problem: every rank fell back to
    # gloo, then that rank's first kernel failed anyway. Refused, naming the rank and the fix.
    out = ["--output-dir", str(tmp_path / "device")]
    r = run_cli([*args, *out], timeout=300, AURA_FAULT_BACKEND="1:device")
    said = r.stdout + r.stderr
    refused = "rank 1: its GPU cannot run this torch's kernels (fault injection) (fix: on that machine"
    assert r.returncode == 2 and refused in said, said[-3000:]
    assert "fallback=gloo" not in said and "finished at step" not in said
    # A LAN node with another torch (NCCL's bootstrap fails on its version check, gloo across releases is untested):
    # every rank refuses before the group starts, naming the node and the fix.
    out = ["--output-dir", str(tmp_path / "versions"), "--backend", "gloo"]
    r = run_cli([*args, *out], timeout=300, AURA_FAULT_TORCH_VERSION="1:2.0.0")
    said = r.stdout + r.stderr
    refused = f"the nodes run different torch versions: rank 1 (node 0, {socket.gethostname()[:64]}) runs torch 2.0.0 and rank 0"
    fix = "(fix: the same torch release on every node, e.g. pip install torch=="
    assert r.returncode == 2 and refused in said and fix in said, said[-3000:]
    assert "finished at step" not in said


def test_prepared_pieces_count_only_whole_and_a_copy_of_the_text_keys_the_same(tmp_path: Path) -> None:
    """A shard cut short (a crash, a full disk) is not a finished piece; a stream's key does not depend on
    where a node keeps its copy of the text nor on its modification time (LAN nodes copy it)."""
    import dataclasses
    import os
    import shutil as sh

    from aura_hpc.data import shards
    from aura_hpc.data.stream import _object_versions, _portable

    text = "Érase una vez un molino.\n\nY un caballero.\n\n" * 200
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "corpus.txt").write_text(text, encoding="utf-8")
    os.utime(tmp_path / "b" / "corpus.txt", (1, 1))
    keys = []
    for node in ("a", "b"):
        pieces = shards.plan([str(tmp_path / node / "corpus.txt")], {".txt": "text"}, 1024, None, False)
        keys.append(([dataclasses.asdict(p) for p in _portable(pieces)], _object_versions(pieces)))
    assert keys[0] == keys[1]
    (tmp_path / "b" / "corpus.txt").write_text(text.replace("molino", "molinx"), encoding="utf-8")
    pieces = shards.plan([str(tmp_path / "b" / "corpus.txt")], {".txt": "text"}, 1024, None, False)
    assert _object_versions(pieces) != keys[0][1]
    # A piece's record counts only while its shard files are as long as it says.
    build = tmp_path / "build"
    job = shards.Job(pieces[0], str(build), str(_tokenizer_json(tmp_path, text)), 0, "uint16", 0.1, "text")
    record = shards.encode(job)
    assert shards.finished(build, pieces[0], 0, 2) == record
    shard = build / record["train"]["file"]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    assert shards.finished(build, pieces[0], 0, 2) is None
    sh.rmtree(build)


def _tokenizer_json(root: Path, text: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    path = root / "tokenizer.json"
    tok.save(str(path))
    return path


GROUP_TIMEOUTS = """
import json, torch
from aura_hpc.comm import collectives
from aura_hpc.train.process import distributed
from aura_hpc.train.process.dist_env import DistEnv

distributed.init_process_group(DistEnv(), "gloo", torch.device("cpu"), 30, 1234)
def seconds(g):
    return g.pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
out = {"split": seconds(collectives.new_group("diloco-outer", [0])), "host": seconds(collectives.new_group("io", host_only=True))}
try:
    collectives.new_group("io", [], host_only=True)
except ValueError as exc:
    out["refused"] = str(exc)
print(json.dumps(out))
"""


def test_every_group_waits_for_a_collective_as_long_as_the_world_does() -> None:
    """torch gives a group made without a timeout its backend's default (gloo 30 min, NCCL 10), not the
    world's: a raised dist.timeout_s never reached DiLoCo's groups (NCCL ended a slow meeting at 10 min),
    and the watchdog's rule, to speak before the collective timeout, did not hold there. A host-only group
    (gloo beside the device world, waiting for background disk writes) keeps gloo's 30 min. One
    over some ranks only is refused: on an NCCL world the ranks outside it would wait in a split for ever."""
    r = subprocess.run([sys.executable, "-c", GROUP_TIMEOUTS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["split"] == 1234 and out["host"] == 1800, out  # host-only: gloo's own, for the shard writes' gathers
    assert "over every rank" in out["refused"], out


def test_the_servers_links_gone_keep_their_totals_and_a_clean_ones_pair_is_released() -> None:
    """The server kept every past worker's gloo pair: 3 threads and 6 descriptors per leave or rejoin
    (measured), until "too many open files" on a long run over a flaky Wi-Fi."""
    import torch.distributed as dist

    from aura_hpc.ps import wire

    traffic = wire.Traffic()
    links = []
    for clean in (True, False):
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
        link = wire.Link(group, 0, bytes_sent=100, bytes_received=40, round_trips=2, round_trip_s=0.5)
        traffic.add(link, release=clean)
        links.append(link)
    assert (traffic.bytes_sent, traffic.bytes_received, traffic.round_trips, traffic.round_trip_s) == (200, 80, 4, 1.0)
    assert all(link.group is None for link in links)
    assert len(traffic.kept) == 1  # the one lost mid-message: gloo may still hold its transfer


def test_what_the_ranks_agree_on_in_the_store_is_signed_and_cleaned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks decide NCCL-or-gloo and whether the data is there through plain store keys: anyone who
    reached the store could make them decide apart (one rank on gloo, the others on NCCL) or put 1,000
    characters of terminal escapes into every rank's log."""
    import torch.distributed as dist

    from aura_hpc.train.process import distributed

    store = dist.HashStore()
    key = stores.key_of("s" * 20)
    name = "aura/attempt0/agree/backend-ready/1"
    monkeypatch.setattr(distributed, "_AGREE", (store, "aura/attempt0/agree", 0, 2, key))
    store.set(name, distributed._signed(key, name, "ok"))  # rank 1, honest
    assert distributed.agree("backend-ready", "", 5) == []
    store.set(name, "ok")  # a stranger, without the secret
    assert distributed.agree("backend-ready", "", 5) == [
        "rank 1: an answer no rank of this run signed (fix: something else on the network writes to the rendezvous port: firewall it)"
    ]
    store.set(name, distributed._signed(key, name, "no\x1b]0;pwned\x07 NCCL here"))  # a rank's own text, cleaned
    assert distributed.agree("backend-ready", "", 5) == ["rank 1: no ]0;pwned  NCCL here"]


def test_a_peers_join_bytes_a_nan_loss_and_a_lying_shape_cost_one_request_never_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review's runs: a join request whose MAC held a non-ASCII character raised out of the server's
    poll (TypeError in compare_digest) and ended it; one poll read a nonce announced 3,725 times as many requests
    (each took a seat); a diverged worker's NaN loss lost its link (headers must be finite) instead of dropping
    its gradient; a peer's tensor shape was allocated whatever its bytes (2**40 elements: 1 TB)."""
    import math
    import secrets

    import torch.distributed as dist

    from aura_hpc.ps import auth, wire
    from aura_hpc.ps.join import QUEUE, JoinQueue

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    queue = JoinQueue(store, auth.key_of("s3cret"))
    odd = secrets.token_hex(16)
    store.set(f"join/req/{odd}", json.dumps({"body": "x", "mac": "é" * 64}))
    store.append(QUEUE, f"{odd}\n")
    assert queue.poll() == [] and json.loads(store.get(f"join/reply/{odd}")) == {"unauthenticated": True}
    read: list[str] = []
    monkeypatch.setattr(queue, "_read", lambda nonce: read.append(nonce))
    again = secrets.token_hex(16)
    store.append(QUEUE, f"{again}\n" * 50)
    assert queue.poll() == [] and read == [again]

    assert wire.loss_on_wire(float("nan")) == wire.loss_on_wire(float("inf")) == wire.NONFINITE_LOSS and wire.loss_on_wire(2.5) == 2.5
    based_on, loss, position, tokens = wire.grad_header([wire.GRAD, 3, wire.NONFINITE_LOSS, 8, 100], version=5)
    assert (based_on, position, tokens) == (3, 8, 100) and math.isnan(loss)
    assert wire.grad_header([wire.GRAD, 3, 2.5, 8, 100], version=5)[1] == 2.5

    sent = tensor_tree.to_json({"a": torch.arange(4, dtype=torch.int64)})
    assert torch.equal(tensor_tree.from_json(sent)["a"], torch.arange(4))
    for shape in ([2**40], [True, 3], [4, 2], "4"):
        lying = {**sent, "tensors": {"0": ["int64", shape, sent["tensors"]["0"][2]]}}
        with pytest.raises(ValueError):
            tensor_tree.from_json(lying)
    empty = {**sent, "tensors": {"0": ["int64", [2**40], ""]}}
    with pytest.raises(ValueError, match="does not match its 0 bytes"):
        tensor_tree.from_json(empty)


def test_a_flood_of_keys_is_swept_a_slice_at_a_time_so_the_serve_loop_sees_a_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """30,000 junk keys (one multi_set, 20 ms) took one sweep 4.4 s on the serve loop's thread, a stop signal
    waiting behind it; a sweep now takes its budget, and the next turns of the loop take the rest."""
    import torch.distributed as dist

    from aura_hpc.ps import sweep

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    if not hasattr(store, "list_keys"):
        pytest.skip("this torch cannot list a store's keys (the sweep needs torch 2.10 or newer)")
    junk = [f"junk/{i}" for i in range(3000)]
    store.multi_set(junk, ["x"] * len(junk))
    monkeypatch.setattr(sweep, "BUDGET_S", 0.02)
    sweeper = sweep.StoreSweeper(store, stale_s=150)
    t0 = time.monotonic()
    sweeper.sweep(set())
    assert time.monotonic() - t0 < 1.0 and 0 < sweeper.removed < len(junk), sweeper.removed
    for _ in range(1000):
        if sweeper.removed == len(junk):
            break
        sweeper.sweep(set())  # at once: the flood is not over, its rest waits for no EVERY_S
    assert sweeper.removed == len(junk) and not any(k.startswith(b"junk/") or k.startswith("junk/") for k in store.list_keys())


def test_ranks_that_see_some_of_their_nodes_gpus_are_refused_not_put_two_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """srun --gpu-bind=closest with Slurm's cyclic task layout shows each rank the 4 GPUs of its socket: local_rank % 4
    gave ranks 0 and 4 of a node GPU 0, and NCCL stopped at "Duplicate GPU detected". No GPU here: torch's device count
    answers as such a rank's does."""
    import torch

    from aura_hpc.errors import LaunchError
    from aura_hpc.train.process.dist_env import DistEnv
    from aura_hpc.train.process.distributed import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    env = DistEnv(rank=4, local_rank=4, world_size=16, local_world_size=8)
    for seen, device in ((8, 4), (1, 0)):  # every GPU of the node, or its own one
        monkeypatch.setattr(torch.cuda, "device_count", lambda seen=seen: seen)
        assert pick_device(env, "auto") == torch.device("cuda", device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(LaunchError, match=r"rank 4 sees 4 GPUs for the 8 ranks of its node, so two would share one \(fix: "):
        pick_device(env, "nccl")
    assert pick_device(env, "gloo") == torch.device("cpu")


def test_versions_are_compared_field_by_field_across_every_rank_nccl_last() -> None:
    """Under dist.backend=auto a difference in NCCL alone falls back to gloo; one in torch is refused. Compared rank by
    rank, rank 1's NCCL was met before rank 2's torch, and the run fell back to gloo across two torch releases."""
    from aura_hpc.comm.node_versions import mismatch

    base = {"node": 0, "host": "a", "aura_hpc": "0.1.0", "torch": "2.6.0", "nccl": "2.21.5"}
    nccl = base | {"node": 1, "host": "b", "nccl": "2.26.2"}
    torch_other = base | {"node": 2, "host": "c", "torch": "2.5.1"}
    field, said = mismatch([base, nccl, torch_other])
    assert field == "torch" and said.startswith("the nodes run different torch versions: rank 2 (node 2, c) runs torch 2.5.1"), said
    field, said = mismatch([base, nccl, base | {"nccl": None}])  # a node without NCCL: the backend's decision names it
    assert field == "nccl" and "rank 1 (node 1, b) runs nccl 2.26.2 and rank 0 (node 0, a) nccl 2.21.5" in said, said
    assert mismatch([base, dict(base)]) == ("", "")
