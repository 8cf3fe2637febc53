"""A hostile peer on the parameter server's port: it speaks the TCPStore protocol by hand (torch's own
client, as anyone on the LAN could) and tries what issue 19 reproduced against the old server —
path-traversal and absolute file names, malformed joins, joins without the secret, the old join
counter raised by 10**12, a flooded queue, a peer that joins and never completes its pair group.
The server must write nothing outside its run directory, log each attempt, and keep serving:
a real worker that comes afterwards joins and trains."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, run_cli
from tests.test_ps import SECRET, Proc, _listening


@pytest.fixture
def base(tmp_path: Path, prepared: Path) -> list[str]:
    from tests.test_ps import MODEL

    return ["--output-dir", str(tmp_path / "runs"), "--run-name", "ps", "--set", f"data.path={prepared}", *MODEL]


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_a_hostile_peer_writes_nothing_outside_the_run_and_cannot_stop_or_block_the_server(tmp_path: Path, base: list[str]) -> None:
    import torch.distributed as dist

    from aura_hpc.errors import LaunchError
    from aura_hpc.ps import auth
    from aura_hpc.ps.join import request_join

    port = free_port()
    run_dir = tmp_path / "runs" / "ps"
    common = [*base, "--set", "train.max_steps=100000", "--set", "train.log_every=20", "--set", "train.checkpoint_every=0"]
    # A join blocked by the silent peer below would wait out ps.worker_timeout_s (600 s here): far beyond the
    # 300 s a busy machine may take to start a worker and train 20 steps.
    common += ["--set", "train.eval_every=0", "--set", "ps.worker_timeout_s=600"]
    server = Proc(["ps", "--port", str(port), *common], tmp_path / "ps.log")
    _listening(port, server)
    server.wait_for("keep this line private")
    outside_before = _files(tmp_path) - _files(run_dir)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    pwned = Path(f"/tmp/aura-pwned-{uuid.uuid4().hex}.pth")

    # 1. The old stats hole: a file name from the store (traversal, absolute) for any ticket.
    for i, name in enumerate(["../../../escape.json", str(pwned), "../../.bashrc"]):
        store.set(f"stats/{i + 1}/name", name)
        store.set(f"stats/{i + 1}", json.dumps({"role": "worker", "steps": 1}))
        store.set(f"stats/{i + 1}/final", "1")
    store.add("join/count", 10**12)  # the old ticket counter: it held every later join

    # 2. Malformed traffic on the join queue, without the secret.
    def announce(payload: bytes | str) -> str:
        nonce = uuid.uuid4().hex
        store.set(f"join/req/{nonce}", payload)
        store.append("join/queue", nonce + "\n")
        return nonce

    for payload in (b"not json", b"[1, 2]", json.dumps({"body": "{}", "mac": "00"}), b"\xff\xfe"):
        announce(payload)
    store.append("join/queue", "../../etc/passwd\n")
    wrong_key = auth.key_of("not-the-secret-" + uuid.uuid4().hex)
    with pytest.raises(LaunchError, match="does not hold the run's secret"):
        request_join(store, wrong_key, {"host": "intruso", "pid": 1, "addr": "127.0.0.1"}, f"127.0.0.1:{port}", 20)

    # 3. With the secret (a buggy or hostile client): values of the wrong type or out of range.
    key = auth.key_of(SECRET)
    for bad in ({"rank": "abc"}, {"rank": 1e400}, {"rank": [1]}, {"pid": -5}, {"addr": "; rm -rf /"}, {"settings": [1, 2]}):
        nonce = uuid.uuid4().hex
        body = json.dumps({"nonce": nonce, "host": "pc", "pid": 1, "addr": "127.0.0.1", "rank": 0, **bad})
        store.set(f"join/req/{nonce}", json.dumps({"body": body, "mac": auth.tag(key, "join", body)}))
        store.append("join/queue", nonce + "\n")

    # 4. A flood of the queue.
    store.append("join/queue", "x" * 300_000)
    time.sleep(2)

    # 5. A peer with the secret that joins and never sets up its pair group: it holds its own seat
    # until ps.worker_timeout_s, never the joins of the others.
    from aura_hpc.ps.commands import load_ps_config
    from aura_hpc.ps.join import settings

    sets = [common[i + 1] for i, a in enumerate(common) if a == "--set"]
    cfg = load_ps_config(None, sets, None, None, port, None)
    slow = {"host": "pc-lento", "pid": 77, "addr": "127.0.0.1", "rank": 1, "settings": settings(cfg, cfg.data.path)}
    _, reply = request_join(store, key, slow, f"127.0.0.1:{port}", 30)
    assert reply["ok"] and reply["rank"] == 1
    t0 = time.monotonic()
    worker = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w.log")
    try:
        worker.wait_for("gradient 20:", timeout=300)
        assert time.monotonic() - t0 < 300
        # 6. A worker without the secret is refused in one line; the server goes on.
        r = run_cli(["worker", "--server", f"127.0.0.1:{port}", *common], timeout=120, AURA_PS_SECRET="")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "no secret for the run" in r.stderr and "AURA_PS_SECRET" in r.stderr
        r = run_cli(["worker", "--server", f"127.0.0.1:{port}", *common], timeout=120, AURA_PS_SECRET="x" * 24)
        assert r.returncode == 2 and "does not hold the run's secret" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert SECRET not in r.stderr + r.stdout
        assert worker.p.poll() is None and server.p.poll() is None
    finally:
        server.signal(signal.SIGINT)
        code = server.finish()
        worker.finish(timeout=60)
    assert code == 75, server.text
    log = server.text
    assert "Traceback" not in log
    for seen in (
        "refused a malformed join request",
        "refused a join announcement that is not a nonce",
        "does not prove the run's secret",
        "with the secret but a malformed request: rank is not a whole number",
        "addr",
        "the join queue was flooded",
    ):
        assert seen in log, (seen, log)
    assert "checkpoint step_" in log  # Ctrl+C after the attacks: the run saved as always
    # Nothing was written outside the run directory, and inside it the server named every file itself.
    assert not pwned.exists()
    logs = {tmp_path / "ps.log", tmp_path / "w.log"}
    assert _files(tmp_path) - _files(run_dir) - logs == outside_before - logs
    stats = sorted(p.name for p in (run_dir / "stats").iterdir())
    assert stats and all(n.endswith(".json") and ("_ps_" in n or "_worker2_" in n) for n in stats), stats
    # The secret is on the terminal once, in the worker command the user copies, and in no file of the run.
    assert log.count(SECRET) == 1 and f"AURA_PS_SECRET={SECRET} python -m aura_hpc worker" in log
    assert (run_dir / "logs" / "ps.log").exists() and all(SECRET not in p.read_text(errors="replace") for p in _files(run_dir))


def test_the_server_keeps_a_secret_of_its_own_for_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aura_hpc.errors import ConfigError
    from aura_hpc.ps import auth

    monkeypatch.delenv("AURA_PS_SECRET", raising=False)
    first, origin = auth.server_secret(tmp_path, None)
    assert origin.endswith("ps.secret (new)") and len(first) >= auth.MIN_LEN
    assert (tmp_path / "ps.secret").stat().st_mode & 0o777 == 0o600  # the owner's alone
    assert auth.server_secret(tmp_path, None)[0] == first  # a resumed server keeps the workers' command valid
    monkeypatch.setenv("AURA_PS_SECRET", "short")
    with pytest.raises(ConfigError, match="too short"):
        auth.server_secret(tmp_path, None)
    given = tmp_path / "secret.txt"
    given.write_text("a-secret-from-a-file-0123\n")
    assert auth.server_secret(tmp_path, str(given))[0] == "a-secret-from-a-file-0123"
    with pytest.raises(ConfigError, match="no secret for the run"):
        monkeypatch.delenv("AURA_PS_SECRET")
        auth.worker_secret(None)


def test_replays_huge_values_and_deletes_never_free_a_seat_nor_hold_the_server(tmp_path: Path, base: list[str]) -> None:
    """A peer without the secret that can list, read, write and delete every key of the server's store:
    - a request is gone from the store once read, a reply once believed, a pair's keys once it is up;
    - a joined client's signed request replayed, with 4,200 junk announcements between the replays, gets
      its old reply and nothing more (before: the junk pushed it out of the server's memory and the
      replay took a new rank, whose pair then froze the server under its lock), and one signed for an
      earlier start of the server is ignored;
    - keys the protocol did not write are deleted (before: 64 x 8 MB raised the server's memory by 0.5 GB),
      and whatever C++ trace the store prints goes to the run's log, not the terminal;
    - the epoch and the queue deleted: the next worker still joins;
    - a client holding a seat whose pair never comes does not hold the server: Ctrl+C saves and stops."""
    import secrets as pysecrets

    import torch.distributed as dist

    from aura_hpc.ps import auth
    from aura_hpc.ps.commands import load_ps_config
    from aura_hpc.ps.join import EPOCH, QUEUE, request_join, settings

    port = free_port()
    common = [*base, "--set", "train.max_steps=100000", "--set", "train.log_every=20", "--set", "train.checkpoint_every=0"]
    common += ["--set", "train.eval_every=0"]
    server = Proc(["ps", "--port", str(port), "--workers", "3", *common], tmp_path / "ps.log")
    _listening(port, server)
    first = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w1.log")
    try:
        first.wait_for("gradient 20:")
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        keys = [k for k in store.list_keys() if not k.startswith("stats/")]
        assert sorted(k for k in keys if k not in (EPOCH, QUEUE)) == [], keys  # no request, reply or pair address left

        # A client with the secret joins (rank 2) and never makes its pair; its signed request is kept.
        key = auth.key_of(SECRET)
        sets = [common[i + 1] for i, a in enumerate(common) if a == "--set"]
        cfg = load_ps_config(None, sets, None, None, port, None)
        nonce, reply = request_join(
            store, key, {"host": "pc-x", "pid": 9, "addr": "127.0.0.1", "settings": settings(cfg, cfg.data.path)}, "", 30
        )
        assert reply["ok"] and reply["rank"] == 2
        epoch = store.get(EPOCH).decode()
        body = json.dumps(
            {"host": "pc-x", "pid": 9, "addr": "127.0.0.1", "settings": settings(cfg, cfg.data.path), "nonce": nonce, "epoch": epoch},
            sort_keys=True,
        )
        replay = json.dumps({"body": body, "mac": auth.tag(key, "join", body)})
        old = pysecrets.token_hex(16)
        stale = json.dumps({"host": "pc-y", "pid": 8, "addr": "127.0.0.1", "settings": {}, "nonce": old, "epoch": "0" * 32}, sort_keys=True)
        store.set(f"join/req/{old}", json.dumps({"body": stale, "mac": auth.tag(key, "join", stale)}))
        store.append(QUEUE, old + "\n")

        time.sleep(1.0)  # its note comes before the junk's fill the log's quota
        for round_ in range(3):
            for _ in range(1400):
                junk = pysecrets.token_hex(16)
                store.set(f"join/req/{junk}", b"junk")
                store.append(QUEUE, junk + "\n")
            store.set(f"join/req/{nonce}", replay)
            store.append(QUEUE, nonce + "\n")
            time.sleep(1.0)
            replied = json.loads(json.loads(store.get(f"join/reply/{nonce}"))["body"])
            assert replied["rank"] == 2, (round_, replied)
        # Keys the protocol never writes, as large as the store takes: gone within seconds.
        blob = b"x" * (8 << 20)
        for i in range(16):
            store.set(f"junk/{i}", blob)
        with contextlib.suppress(Exception):
            store.set("junk/huge", b"y" * (200 << 20))  # the store closes this connection: a new one for the rest
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        store.delete_key(EPOCH)
        store.delete_key(QUEUE)
        deadline = time.monotonic() + 20
        while any(k.startswith("junk/") for k in store.list_keys()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [k for k in store.list_keys() if k.startswith("junk/")]
        second = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w2.log")
        try:
            second.wait_for("gradient 20:")
        finally:
            second.signal(signal.SIGINT)
            second.finish(timeout=60)
        assert first.p.poll() is None and server.p.poll() is None
    finally:
        # Seat 2's pair never came (its thread waits in the pair's set-up): Ctrl+C is still honoured.
        t0 = time.monotonic()
        server.signal(signal.SIGINT)
        code = server.finish(timeout=90)
        first.finish(timeout=60)
    assert code == 75 and time.monotonic() - t0 < 60, server.text[-3000:]
    log = server.text
    assert "worker 3 joined" in log and "worker 2 joined" not in log  # the replays never made a second seat
    assert "reconnected before its old connection timed out" not in log  # no live seat was given up
    assert "signed for another start of the server" in log and "checkpoint step_" in log
    assert "frame #" not in log and "Exception raised from" not in log, log[-3000:]


class _StrangerInTheGap:
    """A client of the server's store with a stranger's delete landing between each `check` it answers
    and the read that follows: the timing a stranger on the port aims for, here every time."""

    def __init__(self, client: Any, stranger: Any) -> None:
        self.client, self.stranger = client, stranger

    def check(self, keys: list[str]) -> bool:
        found = self.client.check(keys)
        for key in keys:
            self.stranger.delete_key(key)
        return bool(found)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_key_deleted_between_the_servers_check_and_its_read_costs_seconds_not_the_join_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCPStore `get` waits for its key for its client's whole timeout: a key deleted after the server
    checked it held the serve loop, its joins and its stop signals for ps.join_timeout_s (60 s by default;
    the server's store here has 300). The join queue and the workers' stats are read on clients of their
    own (made as `ps` makes them) that give up after seconds, and each read's failure is a note. (Those
    seconds are 2 here, not 5: the test waits for them twice.)"""
    import torch.distributed as dist

    from aura_hpc.ps import wire
    from aura_hpc.ps.join import QUEUE, JoinQueue
    from aura_hpc.ps.stats import copy_worker_stats

    assert wire.QUICK_S > 2
    monkeypatch.setattr(wire, "QUICK_S", 2.0)
    port = free_port()
    store = wire.host_store(port, 300.0)  # the server's, with --set ps.join_timeout_s=300
    stranger = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    joins = JoinQueue(_StrangerInTheGap(wire.quick_client(store, port), stranger), b"k" * 32)
    joins.publish_epoch()
    stranger.append(QUEUE, "0" * 32 + "\n")
    t0 = time.monotonic()
    assert joins.poll() == []  # the epoch deleted under it: its read gave up, the poll is empty
    took = time.monotonic() - t0
    assert wire.QUICK_S * 0.8 <= took < wire.QUICK_S + 5, took

    nonce = "1" * 32
    store.set(f"stats/{nonce}", "{}")
    t0 = time.monotonic()
    problem = copy_worker_stats(_StrangerInTheGap(wire.quick_client(store, port), stranger), b"k" * 32, nonce, "pc", 1, 0.0, tmp_path)
    took = time.monotonic() - t0
    assert problem and wire.QUICK_S * 0.8 <= took < wire.QUICK_S + 5, (problem, took)
    assert not list(tmp_path.iterdir()), "nothing written from a read that failed"


def test_a_forged_refusal_does_not_turn_away_a_worker_that_holds_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The join queue is readable by anyone, and the refusal for a worker without the secret cannot be
    signed: a stranger wrote it for a real worker's nonce, and that worker quit with "does not hold the
    run's secret". Now it is a hint: the worker announces again and takes the server's signed answer; a
    refusal that stands (nothing signed comes) is still the one line. (The worker's waits scaled down: an
    announce every second, not 3, and a refusal stands after 4 s unsigned, not 9.)"""
    import threading

    from aura_hpc.comm import stores
    from aura_hpc.errors import LaunchError
    from aura_hpc.ps import auth, join
    from aura_hpc.ps.join import EPOCH, QUEUE, request_join

    assert join.ANNOUNCE_EVERY_S > 1 and join.UNSIGNED_GRACE_S > 4
    monkeypatch.setattr(join, "ANNOUNCE_EVERY_S", 1.0)
    monkeypatch.setattr(join, "UNSIGNED_GRACE_S", 4.0)
    key = auth.key_of(SECRET)
    for server_answers in (True, False):
        store = stores.bound_server("127.0.0.1", 0, timedelta(seconds=30))
        store.set(EPOCH, uuid.uuid4().hex)
        got: dict[str, Any] = {}

        def worker(port: int = store.port, out: dict[str, Any] = got) -> None:
            client = stores.client("127.0.0.1", port, timedelta(seconds=30))
            try:
                out["reply"] = request_join(client, key, {"host": "pc", "pid": 1, "addr": "127.0.0.1"}, "server", 40)[1]
            except LaunchError as exc:
                out["error"] = str(exc)

        thread = threading.Thread(target=worker)
        began = time.monotonic()
        thread.start()
        store.wait([QUEUE])
        nonce = store.get(QUEUE).decode().split()[0]
        store.set(f"join/reply/{nonce}", json.dumps({"unauthenticated": True}))  # the stranger, first
        if server_answers:  # the server, at the worker's next announce
            time.sleep(1.5)
            body = json.dumps({"ok": True, "rank": 1})
            store.set(f"join/reply/{nonce}", json.dumps({"body": body, "mac": auth.tag(key, "reply", nonce, body)}))
        thread.join(60)
        if server_answers:
            assert got == {"reply": {"ok": True, "rank": 1}}, got
        else:
            assert "does not hold the run's secret" in got.get("error", ""), got
            assert time.monotonic() - began < 30  # the grace, not the 40 s join timeout
        del store


def test_a_worker_whose_data_connection_never_comes_says_so_in_one_line(tmp_path: Path, base: list[str]) -> None:
    """A server that answers the join but whose gloo port a firewall blocks (docs/parameter-server.md's most
    common LAN failure, played here by a server that never makes the pair): a traceback ending in
    DistStoreError before; now the one line with the fix."""
    import threading

    from aura_hpc.ps import auth, wire
    from aura_hpc.ps.join import JoinQueue

    port = free_port()
    store = wire.host_store(port, 60)
    queue = JoinQueue(wire.quick_client(store, port), auth.key_of(SECRET))
    queue.publish_epoch()
    done = threading.Event()

    def answer_and_never_pair() -> None:
        while not done.is_set():
            for req in queue.poll():
                queue.reply(req.nonce, {"ok": True, "rank": 1, "workers": 2, "wire_dtype": "fp32", "version": 0, "position": 0})
            time.sleep(0.05)

    thread = threading.Thread(target=answer_and_never_pair, daemon=True)
    thread.start()
    try:
        args = ["worker", "--server", f"127.0.0.1:{port}", *base, "--set", "ps.worker_timeout_s=5"]
        r = run_cli(args, timeout=180, AURA_PS_SECRET=SECRET)
    finally:
        done.set()
        thread.join(10)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "the data connection failed" in r.stderr and "GLOO_SOCKET_IFNAME" in r.stderr, r.stderr
