"""Asynchronous parameter-server training (`ps` + `worker`): real processes on 127.0.0.1 and in
network namespaces, the tiny model on the built-in corpus, gloo pair groups over TCP."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aura_hpc.errors import EXIT_RESUMABLE
from tests.conftest import SMALL_MODEL, cli_env, free_port, run_cli, run_cli_together

# conftest's small model, learning fast enough that a few hundred updates show the loss falling.
MODEL = [*SMALL_MODEL, "--set", "train.warmup_steps=10", "--set", "train.lr=3e-3"]
# The run's secret, handed to the server and every worker as `ps` tells users to (AURA_PS_SECRET).
SECRET = "test-secret-" + uuid.uuid4().hex
WITH_SECRET = {"AURA_PS_SECRET": SECRET}


class Proc:
    """A `python -m aura_hpc` process whose output goes to a file (readable while it runs)."""

    def __init__(self, args: list[str], log: Path, netns: str | None = None, **env: str) -> None:
        env = {**WITH_SECRET, **env}
        cmd = [sys.executable, "-m", "aura_hpc", *args]
        if netns:
            cmd = ["nsenter", f"--net=/run/netns/{netns}", *cmd]
        self.log = log
        self._f = open(log, "w", encoding="utf-8")
        self.p = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, text=True, env=cli_env(**env))

    @property
    def text(self) -> str:
        return self.log.read_text(encoding="utf-8")

    # The waits for a process to be ready are long: a process that died ends them at once (poll), and
    # one that is alive is only slow (beside the 30 processes of test_users_shapes, a server once took over
    # 60 s to listen on 2 cores). Waits that assert the product's speed pass their own timeout.
    def wait_for(self, needle: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never appeared (exit {self.p.poll()}):\n{self.text}")
            time.sleep(0.1)

    def finish(self, timeout: float = 120) -> int:
        try:
            code = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError(f"still running after {timeout}s:\n{self.text}") from None
        finally:
            self._f.close()
        return code

    def signal(self, sig: int) -> None:
        self.p.send_signal(sig)


def _version(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["version"] for r in rows), default=0)


def _wait_version(run_dir: Path, at_least: int, server: Proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while _version(run_dir) < at_least:
        if server.p.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the server never reached version {at_least}:\n{server.text}")
        time.sleep(0.1)


def _listening(port: int, server: Proc, host: str = "127.0.0.1", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if server.p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server never listened on {port}:\n{server.text}") from None
            time.sleep(0.2)


@pytest.fixture
def base(tmp_path: Path, prepared: Path) -> list[str]:
    return ["--output-dir", str(tmp_path / "runs"), "--run-name", "ps", "--set", f"data.path={prepared}", *MODEL]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_worker_back_from_a_drop_replaces_its_own_old_seat_only_once_its_new_link_is_proven() -> None:
    """A rejoin that arrives before the server's side of the old connection timed out: the old seat
    holds the rank until the new connection has proved the secret (a replayed rejoin, which cannot
    prove it, never drops a live worker's seat)."""
    from aura_hpc.ps.join import Request
    from aura_hpc.ps.server import Seat, returning_seat, take_seat
    from aura_hpc.ps.wire import LinkLost

    def seats() -> dict:
        return {2: Seat(2, "pc-salon", "10.0.0.3", 4242, "a" * 32), 1: Seat(1, "pc-cocina", "10.0.0.2", 99, "b" * 32)}

    def req(host: str, pid: int, rejoin: bool = True) -> Request:
        return Request("c" * 32, "e" * 32, host, "10.0.0.3", pid, 2, rejoin, False, {})

    same = seats()
    old = same[2]
    assert returning_seat(same, req("pc-salon", 4242)) is old
    assert same[2] is old and not old.replaced  # nothing given up before the proof
    new = Seat(2, "pc-salon", "10.0.0.3", 4242, "c" * 32, True, pending=True)
    take_seat(same, new)
    assert same[2] is new and old.replaced and 1 in same
    for other in (
        req("pc-salon", 4243),  # another process on that PC
        req("pc-patio", 4242),  # another PC
        req("pc-salon", 4242, rejoin=False),  # a first join asking for a taken rank
    ):
        kept = seats()
        assert returning_seat(kept, other) is None and set(kept) == {1, 2} and not kept[2].replaced, other
    # The old connection timed out while the new one was being proven, and another PC took the rank:
    # the returning worker does not take it from that PC (both trained on one shard).
    taken = seats()
    del taken[2]
    taken[2] = Seat(2, "pc-patio", "10.0.0.9", 7, "d" * 32)
    with pytest.raises(LinkLost, match="its rank 2 went to pc-patio meanwhile"):
        take_seat(taken, Seat(2, "pc-salon", "10.0.0.3", 4242, "c" * 32, True, pending=True))
    assert taken[2].host == "pc-patio" and not taken[2].replaced


# The worker's end of a pair, in a process of its own as on a worker PC: it echoes one message doubled.
_WORKER_END = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from aura_hpc.ps import wire
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=30))
link = wire.Link(wire.pair_group(store, "pair", 1, "127.0.0.1", 30), 1)
print("paired", flush=True)
buf = torch.zeros(6)
link.recv({wire.GRAD: buf})
link.send([wire.GRAD], buf * 2)
print("echoed", flush=True)
"""


def test_pybind_objects_of_pairs_are_made_and_dropped_only_while_the_others_keep_still(tmp_path: Path) -> None:
    """torch's TCPStore and ProcessGroupGloo constructors register their object with the GIL released
    (pybind11 #5473): beside a thread making or dropping a p2p Work, the process aborts later ("Tried
    to deallocate unregistered instance", once in CI on torch 2.6, a late worker pairing while two
    trained). The server's end of a pair is constructed only under the server's lock and
    REGISTRY_LOCK, and every message's Work is made and dropped under REGISTRY_LOCK."""
    import threading
    import weakref
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from aura_hpc.ps import wire

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    server_lock = threading.Lock()

    def in_thread(fn, *args, **kw) -> tuple[threading.Event, dict]:  # type: ignore[no-untyped-def]
        done, out = threading.Event(), {}

        def run() -> None:
            try:
                out["value"] = fn(*args, **kw)
            except BaseException as exc:  # shown by the assertions below
                out["error"] = exc
            done.set()

        threading.Thread(target=run, daemon=True).start()
        return done, out

    def still_waits(done: threading.Event, lock, seconds: float = 1.0) -> None:  # type: ignore[no-untyped-def]
        assert not done.wait(seconds), "went ahead while the lock was held"
        lock.release()
        assert done.wait(30), "never finished once the lock was free"

    server_lock.acquire()
    client, _ = in_thread(wire.another_client, master, "127.0.0.1", port, 30, (server_lock,))
    still_waits(client, server_lock)

    log = tmp_path / "worker.log"
    with open(log, "w", encoding="utf-8") as out:
        worker = subprocess.Popen([sys.executable, "-c", _WORKER_END, str(port)], stdout=out, stderr=subprocess.STDOUT, env=cli_env())
    try:
        # The worker's end is there, so ours waits only for the server's lock (no update, evaluation
        # or checkpoint beside the constructor); the worker meanwhile waits in its constructor.
        server_lock.acquire()
        ours = in_thread(wire.pair_group, master, "pair", 0, "127.0.0.1", 30, (server_lock,))
        deadline = time.monotonic() + 240  # the worker imports torch first
        while not master.check(["pair/aura/here/1"]):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        still_waits(ours[0], server_lock, seconds=1.5)
        assert "error" not in ours[1], ours[1]
        link = wire.Link(ours[1]["value"], 0)

        # A message's Work is made under REGISTRY_LOCK: nothing leaves while another thread holds it.
        wire.REGISTRY_LOCK.acquire()
        sending = in_thread(link.send, [wire.GRAD, 1.0], torch.arange(6, dtype=torch.float32))
        still_waits(sending[0], wire.REGISTRY_LOCK)
        back = torch.zeros(6)
        header, _ = link.recv({wire.GRAD: back})
        assert header[0] == wire.GRAD and torch.equal(back, torch.arange(6, dtype=torch.float32) * 2)
        assert worker.wait(30) == 0 and "echoed" in log.read_text()
    finally:
        worker.kill()
        worker.wait()

    # A failed pair's objects, held by the frames of its error, go when drop_frames says so.
    class Held:
        pass

    def fail(held: Held) -> None:
        try:
            raise RuntimeError("gloo: Connection closed by peer")
        except RuntimeError as exc:
            raise wire.LinkLost(wire.failure(exc)) from None

    held = Held()
    alive = weakref.ref(held)
    try:
        fail(held)
    except wire.LinkLost as exc:
        del held
        assert alive() is not None  # the traceback's frame still holds it
        wire.drop_frames(exc)
        assert alive() is None


def test_three_workers_one_killed_one_late_and_the_loss_falls(tmp_path: Path, base: list[str]) -> None:
    port = free_port()
    run_dir = tmp_path / "runs" / "ps"
    # Long enough that a late worker (~5 s to start) joins well before the end on a faster machine.
    end = 400
    common = [*base, "--set", f"train.max_steps={end}", "--set", "train.log_every=20", "--set", f"train.eval_every={end // 5}"]
    # gloo once (in ~60 CI runs) left the server's send to the killed worker waiting though its socket had closed;
    # ps.worker_timeout_s is the bound the server promises for that case, so it is short here.
    common += ["--set", f"train.checkpoint_every={end // 5}", "--set", "ps.worker_timeout_s=15"]
    server = Proc(["ps", "--workers", "3", "--port", str(port), *common], tmp_path / "ps.log")
    _listening(port, server)
    assert "worker --server" in server.text and f":{port}" in server.text  # the exact command for the workers
    w1 = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w1.log")
    w2 = Proc(["worker", "--server", f"127.0.0.1:{port}", "--worker-rank", "3", *common], tmp_path / "w2.log")
    _wait_version(run_dir, 40, server)
    late = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "late.log")  # joins a running run
    late.wait_for("gradient 20:")  # it joined, built its model and trains
    assert "3 connected" in server.text
    version_at_join = _version(run_dir)
    _wait_version(run_dir, version_at_join + 40, server)
    version_before_kill = _version(run_dir)  # the rows after it, until the server sees the loss, may hold two workers
    w2.p.kill()  # a crash (or the PC switched off) with three workers training
    assert w2.finish() < 0
    try:
        server.wait_for("worker 3 (", timeout=45)
    except AssertionError as exc:  # where the server's threads are: the seat of worker 3 was never given up
        server.signal(signal.SIGWINCH)
        time.sleep(2)
        raise AssertionError(f"{exc}\n--- logs/ps.log:\n{(run_dir / 'logs' / 'ps.log').read_text()[-12000:]}") from None
    version_at_kill = _version(run_dir)
    assert server.finish() == 0, server.text
    assert w1.finish() == 0 and late.finish() == 0, w1.text + late.text

    log = server.text
    assert re.search(r"worker 3 \([^)]*\) (lost|timed out)", log) and "still connected" in log, log
    assert "joined from" in log and log.count("joined from") == 3
    assert f"training finished at version {end}" in log
    assert re.search(r"training finished at version \d+; best eval loss (\d+\.\d{4}|none \(no evaluation ran\))$", log, re.M), log[-2000:]
    assert f"the server ended training at version {end}" in w1.text and "as worker 2 of 3" in late.text, late.text
    assert "; training on the CPU" in late.text, late.text  # where a worker trains, said (a GPU's index and name)
    rows = _rows(run_dir)
    assert rows[-1]["version"] == end
    # Each row's lr is the one its version's update was taken at, as `local` logs it (it was the next update's).
    from aura_hpc.config import load_config
    from aura_hpc.train.parts.schedule import lr_factor

    t = load_config(str(run_dir / "config.yaml")).train
    trained_with = [t.lr * lr_factor(r["version"] - 1, t.warmup_steps, end, t.schedule, t.min_lr_ratio) for r in rows]
    assert [r["lr"] for r in rows] == pytest.approx(trained_with)
    first_loss = next(r["loss"] for r in rows if r["loss"] is not None)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 5 and evals[-1] < first_loss - 1.0, (first_loss, evals)
    # Three contributed together; after the kill, the killed one's rank never again.
    together = [r for r in rows if version_at_join + 20 < r["version"] <= version_before_kill]
    assert together and all(len(r["contributions"]) == 3 for r in together[1:]), together
    after = [r for r in rows if r["version"] > version_at_kill + 40]
    assert sum(r["contributions"].get("2", 0) for r in after) > 0, after
    assert all(r["contributions"].get("3", 0) == 0 for r in after)
    hist = rows[-1]["staleness_hist"]
    assert sum(v for k, v in hist.items() if k.isdigit()) == end  # every applied gradient's staleness counted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["step"] == end
    assert os.readlink(run_dir / "checkpoints" / "last") == f"step_{end:08d}"
    assert (run_dir / "checkpoints" / "best").resolve().name.startswith("step_")
    stats = {p.name.split("_")[1]: json.loads(p.read_text()) for p in (run_dir / "stats").glob("*.json")}
    assert {"ps", "worker1", "worker2", "worker3"} <= set(stats), sorted(stats)
    assert stats["ps"]["steps"] == end and stats["ps"]["bytes_received"] > 0 and stats["ps"]["end_time"]
    for name in ("worker1", "worker2"):
        s = stats[name]
        assert s["steps"] > 0 and s["bytes_sent"] > 0 and s["mean_round_trip_ms"] > 0 and s["end_time"], s
    assert stats["worker3"]["end_time"] is None  # killed: its last periodic stats, not a final one


def test_ctrl_c_on_the_server_saves_and_resumes_then_a_killed_server_stops_the_workers(tmp_path: Path, base: list[str]) -> None:
    port = free_port()
    run_dir = tmp_path / "runs" / "ps"
    common = [*base, "--set", "train.max_steps=5000", "--set", "train.log_every=10", "--set", "train.checkpoint_every=0"]
    common += ["--set", "train.eval_every=0"]
    server = Proc(["ps", "--port", str(port), *common], tmp_path / "ps.log")
    _listening(port, server)
    workers = [Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / f"w{i}.log") for i in (1, 2)]
    for w in workers:
        w.wait_for("gradient 10:")  # both have trained: both shards have a position to resume
    server.signal(signal.SIGWINCH)  # every thread's stack into its log, and it goes on
    deadline = time.monotonic() + 30
    while "_serve_worker" not in (run_dir / "logs" / "ps.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "_serve_worker" in (run_dir / "logs" / "ps.log").read_text(), "no stacks in logs/ps.log on SIGWINCH"
    server.signal(signal.SIGINT)
    assert server.finish() == 75, server.text
    for w in workers:
        assert w.finish(timeout=60) == 0, w.text
        assert "the server is stopping" in w.text
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert not stopped["finished"] and stopped["step"] >= 20
    assert os.readlink(run_dir / "checkpoints" / "last") == f"step_{stopped['step']:08d}"
    assert "Re-run the same command to resume" in server.text
    # Resumed with another number of workers, each shard's saved position would count another shard's sequences.
    other = run_cli(["ps", "--port", str(port), "--workers", "3", *common], timeout=120, **WITH_SECRET)
    assert other.returncode != 0 and "was written with --workers 2" in other.stderr and "fix: resume with --workers 2" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr

    server = Proc(["ps", "--port", str(port), *common], tmp_path / "ps2.log")
    server.wait_for(f"resumed from step_{stopped['step']:08d}: version {stopped['step']}")
    _listening(port, server)
    workers = [Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / f"v{i}.log") for i in (1, 2)]
    _wait_version(run_dir, stopped["step"] + 20, server)
    for w in workers:
        w.wait_for("joined the parameter server")
    assert "from sequence 0" not in workers[0].text + workers[1].text  # each shard goes on where it stopped
    killed_at = time.monotonic()
    server.p.kill()
    server.finish()
    for w in workers:
        code = w.finish(timeout=45)
        assert code == 1 and "lost the parameter server at 127.0.0.1" in w.text and "fix: re-run this worker" in w.text, w.text
    assert time.monotonic() - killed_at < 60  # they notice a closed connection, not a timeout (120 s)


def test_ctrl_c_on_a_worker_whose_server_fell_silent_leaves_in_seconds(tmp_path: Path, base: list[str]) -> None:
    """The server stopped answering (SIGSTOP: its connections open, as over a dropped Wi-Fi), then Ctrl+C on the worker.
    The worker's main thread sat in gloo's wait, where no Python handler runs, for ps.worker_timeout_s (120 s) and
    exited 1 saying it had lost the server; it leaves STOP_GRACE_S after the stop, and says so."""
    port = free_port()
    common = [*base, "--set", "train.max_steps=100000", "--set", "train.log_every=5", "--set", "train.checkpoint_every=0"]
    common += ["--set", "train.eval_every=0"]
    server = Proc(["ps", "--port", str(port), "--workers", "1", *common], tmp_path / "ps.log")
    worker = None
    try:
        _listening(port, server)
        worker = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w.log")
        worker.wait_for("gradient 5:")
        server.signal(signal.SIGSTOP)
        time.sleep(1)
        asked = time.monotonic()
        worker.signal(signal.SIGINT)
        assert worker.finish(timeout=70) == 0, worker.text
        assert time.monotonic() - asked < 45, time.monotonic() - asked
        assert re.search(r"the server did not answer within \d+ s of the stop; left the run after", worker.text), worker.text
        assert "without a goodbye" in worker.text and "lost the parameter server" not in worker.text, worker.text
    finally:
        server.signal(signal.SIGCONT)
        server.signal(signal.SIGINT)
        server.finish(timeout=120)
        if worker is not None and worker.p.poll() is None:
            worker.p.kill()


def test_a_worker_slower_than_the_servers_timeout_stops_with_the_fix_instead_of_rejoining_forever(tmp_path: Path, base: list[str]) -> None:
    """A laptop whose gradient takes longer than ps.worker_timeout_s: the server drops it as silent, and it said "lost
    the parameter server (fix: re-run once the server runs again)" of a server that ran on, or, where the link only
    timed out, rejoined and was dropped again without end."""
    port = free_port()
    common = [*base, "--set", "train.max_steps=100000", "--set", "train.checkpoint_every=0", "--set", "train.eval_every=0"]
    common += ["--set", "ps.worker_timeout_s=3"]
    server = Proc(["ps", "--workers", "1", "--port", str(port), *common], tmp_path / "ps.log")
    _listening(port, server)
    slow = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w.log", AURA_FAULT_SLOW="1:+5")  # 5 s more each
    try:
        assert slow.finish(timeout=180) == 1, slow.text
        assert re.search(
            r"a gradient took \d+ s on this PC, and the parameter server drops a worker silent for ps\.worker_timeout_s", slow.text
        )
        assert "(fix: re-run the server and every worker with --set ps.worker_timeout_s=" in slow.text, slow.text
        assert slow.text.count("rejoined the parameter server") <= 1, slow.text
    finally:
        server.signal(signal.SIGINT)
        server.finish()


def test_an_evaluation_longer_than_the_workers_timeout_holds_up_no_worker(tmp_path: Path, base: list[str]) -> None:
    """Evaluations and checkpoints ran under the lock every worker's thread takes: gpt2-small's evaluation on a CPU
    server (minutes) outlasted ps.worker_timeout_s, every worker timed out, its rejoin waited on the same lock, and
    every worker left. Here each evaluation takes 6 s more, past the workers' timeout."""
    port = free_port()
    common = [*base, "--set", "train.max_steps=120", "--set", "train.eval_every=40", "--set", "train.log_every=10"]
    common += ["--set", "train.checkpoint_every=40", "--set", "ps.worker_timeout_s=4"]
    server = Proc(["ps", "--workers", "1", "--port", str(port), *common], tmp_path / "ps.log", AURA_FAULT_SLOW_EVAL="6")
    _listening(port, server)
    # A worker of 0.1 s a gradient: the run outlasts an evaluation, whose loss goes into a later row.
    worker = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w.log", AURA_FAULT_SLOW="1:+0.1")
    assert worker.finish(timeout=240) == 0 and server.finish(timeout=240) == 0, server.text + worker.text
    assert "timed out" not in server.text and "rejoined" not in worker.text, server.text + worker.text
    rows = _rows(tmp_path / "runs" / "ps")
    # Evaluated off the lock: in a later row, with the version whose weights it measured; the rows' versions in order.
    assert any(r.get("eval_version", r["version"]) < r["version"] for r in rows if "eval_loss" in r), rows
    assert [r["version"] for r in rows] == sorted({r["version"] for r in rows}), rows
    assert rows[-1]["version"] == rows[-1]["eval_version"] == 120 and rows[-1]["tokens_per_s"] > 0, rows[-1]
    kept = sorted(p.name for p in (tmp_path / "runs" / "ps" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept[-1] == "step_00000120", kept
    # Ctrl+C while an evaluation runs (here 600 s): it is cut short at its next batch, the checkpoint written, exit 75
    # (a stop waited for the whole evaluation: minutes for a large model on the server's CPU).
    again = [*base, "--run-name", "ps2", "--set", "train.max_steps=100000", "--set", "train.eval_every=40", "--set", "train.log_every=10"]
    again += ["--set", "train.checkpoint_every=0"]
    server = Proc(["ps", "--workers", "1", "--port", str(port + 1), *again], tmp_path / "ps2.log", AURA_FAULT_SLOW_EVAL="600")
    _listening(port + 1, server)
    worker = Proc(["worker", "--server", f"127.0.0.1:{port + 1}", *again], tmp_path / "w2.log")
    try:
        _wait_version(tmp_path / "runs" / "ps2", 50, server)
        server.signal(signal.SIGINT)
        assert server.finish(timeout=120) == EXIT_RESUMABLE, server.text
    finally:
        worker.signal(signal.SIGINT)
        worker.finish(timeout=120)
    assert "the evaluation of version 40 was cut short by the stop" in server.text, server.text


def test_a_token_budget_counts_every_batch_a_pushed_gradient_carries() -> None:
    """Each version carries ps.push_every batches of a worker: max_tokens=1,048,576 with push_every=4 ran 1,024
    versions, 4,194,304 tokens."""
    from aura_hpc.errors import ConfigError
    from aura_hpc.ps.commands import load_ps_config

    sets = ["train.max_tokens=1048576", "data.seq_len=128", "train.batch_size=8", "train.grad_accum=1", "model.n_positions=128"]
    assert load_ps_config(None, [*sets, "ps.push_every=4"], "/tmp/aura-unused", "ps", None, 1).train.max_steps == 256
    assert load_ps_config(None, sets, "/tmp/aura-unused", "ps", None, 1).train.max_steps == 1024
    # fp16 was refused as "needs a CUDA GPU" on a server PC that has one: the server's copy trains on the CPU, and the
    # workers' gradients have no loss scaling.
    with pytest.raises(ConfigError, match=r"fp16 is not for the parameter server.*--set train.precision=bf16"):
        load_ps_config(None, [*sets, "train.precision=fp16"], "/tmp/aura-unused", "ps", None, 1)


def test_a_workers_first_gradient_explains_one_drop_at_most_and_its_later_ones_are_its_pace() -> None:
    """A drop after a gradient slower than 0.8 x ps.worker_timeout_s ends the worker (a rejoin would be as slow). Its
    first gradient holds torch.compile's and the device's set-up: it made a worker that trains fast leave for good at
    any later network timeout. Now that gradient explains one drop, answered with a rejoin; the next gradient tells."""
    from aura_hpc.config import load_config
    from aura_hpc.ps.worker import PsWorker

    def worker(*took: float) -> PsWorker:
        w = PsWorker.__new__(PsWorker)  # its pace alone: no model, no server
        w.cfg, w.slowest_gradient_s, w.slowest_later_s, w.gradients_timed, w.first_excused = cfg, 0.0, 0.0, 0, False
        for t in took:
            w._timed_gradient(t)
        return w

    cfg = load_config(None, ["ps.worker_timeout_s=120"])
    fast = worker(110.0, 2.0, 3.0)
    assert fast._pace() == "" and fast._pace() == ""  # a network timeout, as often as it comes: rejoined
    dropped_at_first = worker(110.0)
    assert dropped_at_first._pace() == "first"
    dropped_at_first._timed_gradient(2.0)
    assert dropped_at_first._pace() == ""
    slow_pc = worker(110.0)
    assert slow_pc._pace() == "first"
    slow_pc._timed_gradient(100.0)
    assert slow_pc._pace() == "slow" and "a gradient took 100 s on this PC" in str(slow_pc._too_slow())
    again = worker(110.0)  # lost again before a second gradient was timed: not that gradient's doing (the network's)
    assert again._pace() == "first" and again._pace() == ""


def test_a_worker_whose_gradients_are_mostly_too_stale_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    """Its position in the shard moves on with each dropped gradient: a slow worker's whole shard could pass untrained,
    said only by a `dropped` count in the rows."""
    import types
    from collections import Counter

    from aura_hpc.ps.server import Seat, _dropped_as_stale

    seat, hist, interval = Seat(2, "laptop", "192.168.1.7", 1, "n"), Counter(), types.SimpleNamespace(dropped=0)
    with caplog.at_level(logging.WARNING, logger="aura_hpc"):
        for _ in range(40):
            _dropped_as_stale(seat, hist, interval, 4)
    assert hist["dropped"] == interval.dropped == seat.dropped == 40
    assert caplog.text.count("worker 2's gradients arrive too stale to apply (20 of 20 dropped, staleness above 4)") == 1
    assert "(fix: --set ps.max_staleness=10 on the server and every worker, or fewer workers)" in caplog.text


def test_bad_inputs_of_a_parameter_server_run(tmp_path: Path, base: list[str]) -> None:
    """Each refused in one line naming the problem and the fix; all run at once against one server."""
    port = free_port()
    common = [*base, "--set", "train.max_steps=100000", "--set", "train.log_every=1000", "--set", "train.checkpoint_every=0"]
    common += ["--set", "train.eval_every=0"]
    server = Proc(["ps", "--port", str(port), *common], tmp_path / "ps.log")
    _listening(port, server)
    # Slowed down (idle 90% of each step): it only has to hold rank 1 while the others start.
    first = Proc(["worker", "--server", f"127.0.0.1:{port}", "--worker-rank", "1", *common], tmp_path / "w1.log", AURA_FAULT_SLOW="1:0.9")
    try:
        first.wait_for("joined the parameter server")
        # A join timeout far beyond the wait below: a case that waited for a timeout instead of being
        # refused at start-up fails there, on any machine (a wall-clock limit measured a busy machine's load).
        worker = ["worker", "--server", f"127.0.0.1:{port}", *common, "--set", "ps.join_timeout_s=900"]
        cases = [
            ([*worker, "--worker-rank", "1"], "worker rank 1 is already taken by", "omit --worker-rank"),
            ([*worker, "--set", "model.n_embd=32"], "has model.n_embd=32 but the server has model.n_embd=64", "the same --config/--set"),
            (
                [*worker, "--set", "train.batch_size=4"],
                "has train.batch_size=4 but the server has train.batch_size=8",
                "the same --config/--set",
            ),
            ([*worker, "--set", "train.lr=0.01"], "has train.lr=0.01 but the server has train.lr=0.003", "the same --config/--set"),
            # Another sample order: the "disjoint" shards overlapped (a quarter of the sequences read twice).
            ([*worker, "--set", "data.shuffle_window=64"], "has data.shuffle_window=64 but the server has", "the same --config/--set"),
            ([*worker, "--worker-rank", "7"], "--worker-rank 7 is outside 1..2", "omit --worker-rank"),
            (["ps", "--port", str(port), *common, "--run-name", "ps2"], f"port {port} is already in use", f"--port {port + 1}"),
            (
                ["worker", "--server", f"127.0.0.1:{free_port()}", *common, "--set", "ps.join_timeout_s=3"],
                "cannot reach the parameter server",
                "start `python -m aura_hpc ps`",
            ),
            # A tracker the server would never start was taken in silence.
            (
                ["ps", "--port", str(free_port()), *common, "--run-name", "ps3", "--set", "tracking.backends=tensorboard,wandb"],
                "logs to metrics.jsonl and TensorBoard only; tracking.backends asks for wandb",
                "--set tracking.backends=tensorboard",
            ),
        ]
        results = run_cli_together([c[0] for c in cases], timeout=420, **WITH_SECRET)
        for (args, problem, fix), r in zip(cases, results, strict=True):
            assert r.returncode == 2 and problem in r.stderr and fix in r.stderr, (args[-2:], r.stdout, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        # The busy port is refused before the worker command (with its secret) is printed and the run folder made.
        assert "AURA_PS_SECRET=" not in results[6].stdout and not (tmp_path / "runs" / "ps2").exists()
        assert "worker 1 joined" in server.text and "refused a worker" in server.text
        probe = run_cli(["check", "--server", f"127.0.0.1:{port}", "--json"], timeout=120, **WITH_SECRET)
        findings = {f["name"]: f for f in json.loads(probe.stdout)["findings"]}
        assert probe.returncode == 0 and findings["round trip"]["ok"] and "MB there and back" in findings["round trip"]["detail"]
        first.signal(signal.SIGINT)  # Ctrl+C on a worker: it says goodbye, the server goes on
        assert first.finish() == 0, first.text
        assert "left the run after" in first.text
        server.wait_for("worker 1 (")
        assert "left (stopped by its user)" in server.text and "0 still connected" in server.text
    finally:
        server.signal(signal.SIGINT)
        assert server.finish() == 75, server.text
        if first.p.poll() is None:
            first.p.kill()
            first.finish()


def test_a_full_disk_on_the_server_stops_the_run_with_the_fix_and_keeps_nothing_broken(tmp_path: Path, base: list[str]) -> None:
    port = free_port()
    run_dir = tmp_path / "runs" / "ps"
    common = [*base, "--set", "train.max_steps=400", "--set", "train.log_every=10", "--set", "train.checkpoint_every=20"]
    common += ["--set", "train.eval_every=0"]
    # The first checkpoint's save fails as a full disk would (train/instruments/faults.py).
    server = Proc(["ps", "--port", str(port), *common], tmp_path / "ps.log", AURA_FAULT_CKPT="enospc:model")
    _listening(port, server)
    worker = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / "w.log")
    assert server.finish() == 1, server.text
    assert worker.finish() == 1, worker.text  # 0 read as a finished run to a script over the workers
    assert "error: no space left on" in server.text and "while writing checkpoint step 20" in server.text, server.text
    assert "(fix: free space there" in server.text, server.text
    assert "the server stopped on an error" in worker.text
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]  # no half-written folder left


# ---- three PCs: a server and two workers in network namespaces on one bridge ---------------


@pytest.fixture(scope="module")
def lan() -> Iterator[list[str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root)")
    tag = uuid.uuid4().hex[:5]
    hub = f"aura-hub-{tag}"
    names = [f"aura-pc{i}-{tag}" for i in range(3)]
    cmds = [["ip", "netns", "add", hub], ["nsenter", f"--net=/run/netns/{hub}", "ip", "link", "add", "br0", "type", "bridge"]]
    cmds.append(["nsenter", f"--net=/run/netns/{hub}", "ip", "link", "set", "br0", "up"])
    for i, ns in enumerate(names):
        pc, port_dev = f"p{i}{tag}", f"h{i}{tag}"
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", pc, "type", "veth", "peer", "name", port_dev],
            ["ip", "link", "set", pc, "netns", ns],
            ["ip", "link", "set", port_dev, "netns", hub],
            ["nsenter", f"--net=/run/netns/{hub}", "ip", "link", "set", port_dev, "master", "br0", "up"],
            ["nsenter", f"--net=/run/netns/{ns}", "ip", "addr", "add", f"10.78.1.{i + 1}/24", "dev", pc],
            ["nsenter", f"--net=/run/netns/{ns}", "ip", "link", "set", pc, "up"],
            ["nsenter", f"--net=/run/netns/{ns}", "ip", "link", "set", "lo", "up"],
        ]
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True, timeout=20)
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in [hub, *names]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc}")
    yield names
    for ns in [hub, *names]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_server_and_workers_on_three_lan_addresses_and_a_wifi_drop(tmp_path: Path, base: list[str], lan: list[str]) -> None:
    port = 30005  # the default: every namespace has its own ports
    run_dir = tmp_path / "runs" / "ps"
    # No end of its own: once the drops are seen, Ctrl-C ends it (a fixed version count cost minutes of training on
    # busy cores after the last assertion, 193 s in all against 57 s idle).
    common = [*base, "--set", "train.max_steps=100000", "--set", "train.log_every=20", "--set", "train.eval_every=0"]
    # The dropped worker tries to rejoin for ps.join_timeout_s: longer than the other worker's versions below take on a
    # busy machine before the link comes back.
    common += ["--set", "ps.worker_timeout_s=4", "--set", "ps.join_timeout_s=15"]
    server = Proc(["ps", *common], tmp_path / "ps.log", netns=lan[0])
    server.wait_for("worker --server 10.78.1.1:30005")  # its LAN address, in the command it prints
    probe = subprocess.run(
        ["nsenter", f"--net=/run/netns/{lan[1]}", sys.executable, "-m", "aura_hpc", "check", "--server", "10.78.1.1", "--json"],
        capture_output=True,
        text=True,
        env=cli_env(**WITH_SECRET),
        timeout=120,
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    workers = [Proc(["worker", "--server", "10.78.1.1", *common], tmp_path / f"w{i}.log", netns=lan[i]) for i in (1, 2)]
    try:
        _wait_version(run_dir, 40, server)
        server.wait_for("joined from")
        # Worker 2's PC drops off the network (its switch port goes down) for longer than
        # ps.worker_timeout_s: the server lets it go and trains on with worker 1.
        dropped = workers[1]  # the PC at 10.78.1.3
        switch_port = f"h2{lan[2].rsplit('-', 1)[1]}"
        hub = f"/run/netns/aura-hub-{lan[2].rsplit('-', 1)[1]}"
        subprocess.run(["nsenter", f"--net={hub}", "ip", "link", "set", switch_port, "down"], check=True, timeout=20)
        server.wait_for("timed out (no message for ps.worker_timeout_s)", timeout=30)
        dropped.wait_for("the network may have dropped", timeout=30)
        at_drop = _version(run_dir)
        _wait_version(run_dir, at_drop + 10, server)  # the other worker keeps the run going
        subprocess.run(["nsenter", f"--net={hub}", "ip", "link", "set", switch_port, "up"], check=True, timeout=20)
        dropped.wait_for("rejoined the parameter server at 10.78.1.1:30005 as worker", timeout=60)
        _wait_version(run_dir, _version(run_dir) + 40, server)
        # Off the network for good: after ps.worker_timeout_s + ps.join_timeout_s it gives up in one line.
        rejoined_at = _version(run_dir)
        subprocess.run(["nsenter", f"--net={hub}", "ip", "link", "set", switch_port, "down"], check=True, timeout=20)
        # The run ends now, not after the dropped worker's 19 s of tries (two processes training on busy cores the
        # while): off the network, that worker cannot tell a stopped server from a lost link, and says the same.
        server.signal(signal.SIGINT)
        assert server.finish() == 75, server.text
        assert workers[0].finish() == 0 and "the server is stopping" in workers[0].text, workers[0].text
        assert dropped.finish(timeout=60) == 1, dropped.text
        last = dropped.text.strip().splitlines()[-1]
        assert "lost the parameter server at 10.78.1.1:30005" in last and "could not rejoin" in last and "fix:" in last, last
    finally:
        for proc in (server, *workers):
            if proc.p.poll() is None:
                proc.p.kill()
    assert "joined from" in server.text and "(10.78.1.2)" in server.text and "(10.78.1.3)" in server.text, server.text
    assert "rejoined from" in server.text, server.text
    rows = _rows(run_dir)
    assert rows[-1]["version"] >= rejoined_at and {"1", "2"} <= {k for r in rows for k in r["contributions"]}
    rank = dropped.text.split("rejoined the parameter server at 10.78.1.1:30005 as worker ")[1][0]
    after = [r for r in rows if at_drop + 40 < r["version"] <= rejoined_at]
    assert any(int(r["contributions"].get(rank, 0)) > 0 for r in after), "the dropped worker never contributed again"
    assert port == 30005


def test_push_every_cuts_the_traffic_per_token_by_its_factor(tmp_path: Path, prepared: Path) -> None:
    """ps.push_every=4: each push carries four local steps' mean gradient (issue 21): a quarter of the
    bytes per trained token, the same staleness rules, and the loss still falls."""
    sent = {}
    for k in (1, 4):
        port = free_port()
        common = ["--output-dir", str(tmp_path / f"k{k}"), "--run-name", "ps", "--set", f"data.path={prepared}", *MODEL]
        common += ["--set", "train.max_steps=40", "--set", "train.log_every=10", "--set", "train.eval_every=40"]
        common += ["--set", "train.checkpoint_every=0", "--set", f"ps.push_every={k}"]
        server = Proc(["ps", "--workers", "1", "--port", str(port), *common], tmp_path / f"ps{k}.log")
        _listening(port, server)
        worker = Proc(["worker", "--server", f"127.0.0.1:{port}", *common], tmp_path / f"w{k}.log")
        assert server.finish() == 0, server.text
        assert worker.finish() == 0, worker.text
        run_dir = tmp_path / f"k{k}" / "ps"
        stats = [json.loads(p.read_text()) for p in (run_dir / "stats").glob("*_worker1_*.json")]
        assert stats, list((run_dir / "stats").iterdir())
        sent[k] = stats[0]["bytes_sent"] / stats[0]["tokens"]
        rows = _rows(run_dir)
        assert rows[-1]["version"] == 40 and rows[-1]["tokens_per_s"] > 0
    assert 0.2 < sent[4] / sent[1] < 0.3, sent


def test_a_late_gradient_counts_its_staleness_weight_after_clipping() -> None:
    """The weight 1/(1+s) was applied before train.grad_clip: a late gradient over the limit was clipped
    back to the size of a fresh one, and its lateness counted for nothing (docs: it counts 1/(1+s))."""
    import torch

    from aura_hpc.ps.model_copy import ModelCopy

    def update(scale: float) -> torch.Tensor:
        model = torch.nn.Linear(1000, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        copy = ModelCopy(None, None, model, model, None)  # type: ignore[arg-type]
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        copy.apply(torch.full((1000,), 0.5), scale, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0), 1.0)
        return model.weight.detach().clone()

    fresh, late = update(1.0), update(1 / 5)  # a gradient of norm 15.8, clipped to 1; four versions late
    assert abs(fresh.norm().item() - 1.0) < 1e-5 and abs(late.norm().item() - 0.2) < 1e-5


def test_a_stop_asked_for_while_waiting_for_the_server_ends_the_wait_at_once() -> None:
    """A worker rejoining after a drop waits for the server's port and then its answer (up to
    ps.join_timeout_s each): Ctrl+C there was answered only when those waits ended. Both waits now ask
    whether a stop was asked for, and the join takes its request back from the store."""
    from datetime import timedelta

    import torch.distributed as dist

    from aura_hpc.launch.local import wait_for_master
    from aura_hpc.ps import auth
    from aura_hpc.ps.join import StoppedWaiting, request_join

    started = time.monotonic()
    asked = lambda: time.monotonic() - started > 1  # noqa: E731  # Ctrl+C a second into each wait
    wait_for_master("127.0.0.1", free_port(), 120, stopping=asked)  # nothing listens there
    assert time.monotonic() - started < 10
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))  # a store no server answers on
    started = time.monotonic()
    with pytest.raises(StoppedWaiting):
        request_join(store, auth.key_of("s" * 32), {"host": "pc", "pid": 1, "addr": "127.0.0.1"}, "127.0.0.1:1", 120, asked)
    assert time.monotonic() - started < 10
    nonce = store.get("join/queue").decode().split()[0]
    assert not store.check([f"join/req/{nonce}"]), "the request stays behind for a server that comes back"


def test_a_stale_gradient_takes_a_smaller_step_under_adamw() -> None:
    """The weight 1/(1+s) scaled the gradient, which AdamW divides by its running size: a stale gradient moved the
    weights as far as a fresh one. Now the step's learning rate is scaled, and restored for the schedule."""
    import types

    import torch

    from aura_hpc.ps.model_copy import ModelCopy

    moved = []
    for scale in (1.0, 0.5):
        fake = types.SimpleNamespace(params=[torch.nn.Parameter(torch.ones(4))])
        fake.set_grads = lambda flat, s, fake=fake: setattr(fake.params[0], "grad", flat.clone())
        opt = torch.optim.AdamW(fake.params, lr=0.1, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        ModelCopy.apply(fake, torch.full((4,), 3.0), scale, opt, sched, 0.0)  # type: ignore[arg-type]
        moved.append(float((1 - fake.params[0].detach()).abs().mean()))
        assert opt.param_groups[0]["lr"] == 0.1
    assert abs(moved[1] / moved[0] - 0.5) < 1e-3, moved


def test_the_server_checkpoints_by_time_and_a_leaving_worker_never_blocks_it(tmp_path: Path, prepared: Path) -> None:
    """train.checkpoint_every_s (600 s by default) was ignored by the server: with checkpoint_every=0, or a slow
    run, hours went by without a checkpoint, and a kill lost them. (One server, two checks: see the helper.)"""
    from aura_hpc.config import load_config
    from aura_hpc.ps.server import ParameterServer

    sets = [kv for kv in MODEL if kv != "--set"] + [f"data.path={prepared}", "train.checkpoint_every=0", "train.checkpoint_every_s=0.5"]
    cfg = load_config(None, [*sets, "train.log_every=1000", "train.eval_every=0"], output_dir=str(tmp_path), run_name="ps")
    from aura_hpc.ps.off_lock import OffLock, Shadow

    server = ParameterServer(cfg, b"k" * 32)
    server.shadow, server.off_lock = Shadow(server.model_copy), OffLock(server._evaluate_and_save)  # as serve() makes them
    _a_leaving_worker_never_holds_the_servers_lock_while_a_pair_is_made(server)
    server.saved_at = time.monotonic()  # the check above took its time: the cadence counts from here
    server.version = 1
    server._after_update()
    server.off_lock.drain()
    assert server.saved_version == -1  # not yet due
    time.sleep(0.6)
    server.version = 2
    server._after_update()
    server.off_lock.drain()  # written off the lock, on the snapshot taken at version 2
    assert server.saved_version == 2 and (cfg.run_dir / "checkpoints").is_dir()


def _a_leaving_worker_never_holds_the_servers_lock_while_a_pair_is_made(server: Any) -> None:
    """A pair being made holds REGISTRY_LOCK (up to 15 s); a worker leaving then held the server's lock while it
    waited for it to drop its pair, and joins, updates and the stop path waited behind it."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from aura_hpc.ps import wire
    from aura_hpc.ps.server import Seat

    seat = Seat(0, "laptop", "10.0.0.2", 1, "0" * 32, replaced=True)
    seat.link = wire.Link(dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5)), 0, bytes_sent=100)
    server.seats[0] = seat
    with wire.REGISTRY_LOCK:  # a pair being made
        leaving = threading.Thread(target=server._leave, args=(seat, "left"))
        leaving.start()
        deadline = time.monotonic() + 30
        while 0 in server.seats and time.monotonic() < deadline:  # its seat is gone: it is at its pair now
            time.sleep(0.01)
        time.sleep(0.1)
        free = server.lock.acquire(timeout=2)
        if free:
            server.lock.release()
    leaving.join(10)
    assert free and not leaving.is_alive() and seat.link.group is None and 0 not in server.seats
    assert server.closed.bytes_sent == 100


def test_a_resumed_server_trains_at_the_configs_learning_rate(tmp_path: Path, prepared: Path) -> None:
    """The server loaded the checkpoint's optimizer and schedule as they were: a re-run with a lower train.lr (what a
    divergence's fix says) went on at the old one, without a word (local's resume applies the config's)."""
    from aura_hpc.config import load_config
    from aura_hpc.ps import ledger
    from aura_hpc.ps.server import ParameterServer

    sets = [kv for kv in MODEL if kv != "--set"] + [f"data.path={prepared}", "train.max_steps=100", "train.warmup_steps=0"]
    first = load_config(None, [*sets, "train.lr=1e-3"], output_dir=str(tmp_path), run_name="ps")
    server = ParameterServer(first, b"k" * 32)
    for _ in range(50):
        server.scheduler.step()
    meta = ledger.meta(0, {}, None, Counter(), 100, first.ps.workers, None)
    ledger.save(first, server.model_copy, server.optimizer, server.scheduler, 50, meta)
    lower = load_config(None, [*sets, "train.lr=1e-4"], output_dir=str(tmp_path), run_name="ps")
    again = ParameterServer(lower, b"k" * 32)
    again.resume()
    factor = again.scheduler.lr_lambdas[0](again.scheduler.last_epoch)
    assert again.version == 50 and math.isclose(again.optimizer.param_groups[0]["lr"], 1e-4 * factor, rel_tol=1e-9)
