"""The hang watchdog's judgement (launch/hang_watch.py) and the progress page it reads
(train/process/progress.py), without training processes: timeouts, calibration kept across restarts,
who is named, how the nodes' watchdogs wait for each other's evidence. The whole path (a stopped rank in
a real run, named, restarted, the same bits) is in
test_faults.py::test_a_stopped_rank_is_named_within_a_minute_and_the_run_restarts_bit_identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aura_hpc.config import load_config
from aura_hpc.launch.hang_evidence import hang_line, name_culprits
from aura_hpc.launch.hang_watch import HangWatch, process_alive
from aura_hpc.train.process import progress

WAITING = """Thread 0x1 (most recent call first):
  File "/x/aura_hpc/train/worker.py", line 50 in watch
Current thread 0x2 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/x/aura_hpc/comm/collectives.py", line 121 in all_reduce
  File "/x/aura_hpc/train/loop/evaluation.py", line 40 in evaluate
  File "/x/aura_hpc/train/worker.py", line 96 in main
"""
ON_THE_GPU = """Current thread 0x2 (most recent call first):
  File "/x/torch/cuda/streams.py", line 230 in synchronize
  File "/x/aura_hpc/train/loop/step.py", line 56 in read
  File "/x/aura_hpc/train/loop/trainer.py", line 140 in _train
  File "/x/aura_hpc/train/worker.py", line 96 in main
"""
READING = """Current thread 0x2 (most recent call first):
  File "/x/s3fs/core.py", line 10 in _cat_file
  File "/x/aura_hpc/train/loop/data_feed.py", line 88 in _prepare
  File "/x/aura_hpc/train/worker.py", line 96 in main
"""


def _watch(tmp_path: Path, *sets: str) -> HangWatch:
    cfg = load_config(None, list(sets), output_dir=str(tmp_path), run_name="run")
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return HangWatch.for_run(cfg)


def _page(section: str, step: int, entered: int, beat: float, pid: int = 1) -> dict[str, Any]:
    return {"pid": pid, "section": section, "step": step, "entered": entered, "op": "all_reduce", "since": beat, "beat": beat}


def test_a_page_is_what_the_rank_wrote_and_a_torn_one_is_ignored(tmp_path: Path) -> None:
    page = progress.Progress(tmp_path / "rank3")
    page.step_done(41)
    page.collective("all_gather", [], None)
    with page.section("checkpoint"):
        inside = progress.read(tmp_path / "rank3")
    after = progress.read(tmp_path / "rank3")
    assert inside is not None and inside["section"] == "checkpoint" and inside["step"] == 41 and inside["entered"] == 1
    assert after is not None and after["section"] == "step" and after["op"] == "all_gather"
    (tmp_path / "rank4").write_bytes(b"\x00" * 10)
    (tmp_path / "rank5").write_bytes(b"\xff" * progress.LAYOUT.size)  # a section index out of range
    assert progress.read(tmp_path / "rank4") is None and progress.read(tmp_path / "rank5") is None
    # Whole in size, but its times never written (the file's zeros): not a rank that stopped in 1970.
    (tmp_path / "rank6").write_bytes(progress.page_bytes(13022, 0, 17, 65, 1, 0.0, 0.0))
    assert progress.read(tmp_path / "rank6") is None
    # Read while a write was under way: the new write's start, the old one's end (and the reverse); both ends
    # new and the step between them old (memcpy stores the ends first: seen in CI).
    old, new = progress.page_bytes(13022, 1, 16, 64, 1, 100.0, 200.0, 7), progress.page_bytes(13022, 2, 17, 65, 1, 300.0, 300.0, 8)
    for torn in (new[:24] + old[24:], old[:40] + new[40:], new[:8] + old[8:40] + new[40:]):
        (tmp_path / "rank7").write_bytes(torn)
        assert progress.read(tmp_path / "rank7") is None
    (tmp_path / "rank7").write_bytes(new)
    whole = {"pid": 13022, "section": "evaluation", "step": 17, "entered": 65, "op": "all_reduce", "since": 300.0, "beat": 300.0}
    assert progress.read(tmp_path / "rank7") == whole
    (tmp_path / "rank8").write_bytes(b"\x00" * progress.LAYOUT.size)  # made, never written
    assert progress.read(tmp_path / "rank8") is None


WRITER = """
import sys, time
from pathlib import Path
from aura_hpc.train.process import progress
page = progress.Progress(Path(sys.argv[1]))
print("ready", flush=True)
end, i = time.time() + float(sys.argv[2]), 0
while time.time() < end:
    i += 1
    page.step, page.entered = i, i - 1  # the write counts it to i: a read that mixes two writes shows them apart
    page.collective("all_reduce", [], None)
"""


def test_a_page_read_while_another_process_writes_it_is_whole_or_nothing(tmp_path: Path) -> None:
    """The watchdog reads from another process as the rank writes, many times per step. Written field by
    field (struct.pack_into zeroes the page first), about one read in twenty here saw a new step with zero
    times: read as "no progress since 1970", it declared a hang on a training rank in CI."""
    page = tmp_path / "rank0"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(page), "1.5"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        whole, torn = 0, []
        while writer.poll() is None:
            if (p := progress.read(page)) is not None:
                whole += 1
                if p["step"] != p["entered"] or p["beat"] <= 0 or p["since"] <= 0:
                    torn.append(p)
        assert writer.wait(timeout=30) == 0
    finally:
        writer.kill()
    assert whole > 1000 and not torn, (whole, torn[:3])


def test_timeouts_have_floors_follow_the_run_and_survive_a_restart(tmp_path: Path) -> None:
    w = _watch(tmp_path)
    try:
        # Start-up's 1,200 s is capped below the collective timeout (600 s), which would end the waiting ranks
        # first, by a margin (30 s), the evidence's time before the kill (65 s) and the longest step (none yet).
        assert w.timeout("step") == 30 and w.timeout("checkpoint") == 300 and w.timeout("start-up") == 505
        assert w.timeout("data") > 600  # the ranks' own patience for a data window comes first
        assert w.timeout("finished") == float("inf")
        t0 = time.time()
        w._learn(0, _page("step", 10, 5, t0))
        w._learn(0, _page("step", 12, 7, t0 + 20))  # 10 s a step: 5x is above the floor
        w._learn(0, _page("checkpoint", 12, 7, t0 + 21))
        w._learn(0, _page("step", 13, 8, t0 + 101))  # left the checkpoint after 80 s
        assert w.timeout("step") == 50 and w.timeout("checkpoint") == 400 and w.timeout("start-up") == 495
        w._learn(0, _page("checkpoint", 13, 8, t0 + 102))
        w._learn(0, _page("step", 14, 9, t0 + 252))  # a 150 s checkpoint: 5x would be 750 s, past NCCL's 600
        took = w.timeout("checkpoint")
        assert took == 495 and took + w.calibration["step"] + 15 + 30 + 20 < 600, took
    finally:
        w.close()
    slow = _watch(tmp_path / "slow", "dist.timeout_s=300")  # 120 s steps on a slow link, a short collective timeout
    try:
        t0 = time.time()
        slow._learn(0, _page("step", 10, 5, t0))
        slow._learn(0, _page("step", 11, 6, t0 + 120))
        assert slow.timeout("step") == 240  # two steps, not 300 - 95 - 120 = 85: a step is not a hang
    finally:
        slow.close()
    again = _watch(tmp_path)  # a resumed run: calibrated from the start
    try:
        assert again.timeout("step") == 50 and again.timeout("checkpoint") == 495
    finally:
        again.close()


def test_a_hang_is_when_no_rank_moved_for_longer_than_its_section_allows(tmp_path: Path) -> None:
    w = _watch(tmp_path, "health.hang_step_floor_s=10")
    try:
        now = time.time()
        assert not w.hung({0: _page("step", 5, 9, now - 9), 1: _page("step", 5, 9, now - 60)}, now)  # rank 0 moved 9 s ago
        assert w.hung({0: _page("step", 5, 9, now - 11), 1: _page("step", 5, 9, now - 60)}, now)
        assert not w.hung({0: _page("checkpoint", 5, 9, now - 200), 1: _page("step", 5, 9, now - 200)}, now)
        assert not w.hung({0: _page("finished", 5, 9, now - 999)}, now)
    finally:
        w.close()
    # Ctrl+C in a step whose time is not known yet (the first steps: compilation, a long accumulation):
    # the step's own limit, not the few seconds a stop allows a calibrated step.
    w = _watch(tmp_path, "health.hang_step_floor_s=60")
    try:
        now = time.time()
        assert not w.hung({0: _page("step", 1, 9, now - 20), 1: _page("step", 1, 9, now - 20)}, now, stopping=True)
        w._learn(0, _page("step", 10, 5, now - 30))
        w._learn(0, _page("step", 11, 6, now - 29))
        assert w.hung({0: _page("step", 12, 9, now - 20), 1: _page("step", 12, 9, now - 20)}, now, stopping=True)
    finally:
        w.close()


def test_the_culprit_is_the_silent_rank_then_the_one_not_waiting_then_the_one_behind(tmp_path: Path) -> None:
    ranks = {0: _page("step", 12, 30, 0.0), 1: _page("step", 12, 30, 0.0), 2: _page("step", 11, 29, 0.0)}
    assert name_culprits(ranks, {0: WAITING, 1: WAITING}) == ([2], "silent")
    assert name_culprits(ranks, {0: WAITING, 1: READING, 2: WAITING}) == ([1], "working")
    assert name_culprits(ranks, {0: WAITING, 1: WAITING, 2: WAITING}) == ([2], "behind")
    assert name_culprits(ranks, {0: ON_THE_GPU, 1: WAITING, 2: ON_THE_GPU}) == ([2], "behind")  # NCCL: waiting through the device
    even = {0: _page("step", 12, 30, 0.0), 1: _page("step", 12, 30, 0.0)}
    assert name_culprits(even, {0: WAITING, 1: WAITING}) == ([], "elsewhere")
    named = hang_line(ranks, {0: WAITING, 1: READING, 2: WAITING}, [1], "working", "gpu-07", 42.0, tmp_path)
    assert named.startswith("hang: rank 1 on gpu-07 is not waiting for its peers: train/loop/data_feed.py:88 in _prepare")
    assert "inside core.py:10 in _cat_file" in named and "wait at train/loop/evaluation.py:40 in evaluate" in named, named
    assert "the rank holding them up is on another node" in hang_line(even, {0: WAITING, 1: WAITING}, [], "elsewhere", "h", 31.0, tmp_path)
    computing = hang_line(even, {0: READING, 1: READING}, [], "elsewhere", "h", 31.0, tmp_path)
    assert "every rank on h is still computing" in computing and "another node" not in computing, computing
    # A silent rank says what the kernel says of it: a stopped process (a D-state one is said the same way;
    # none can be made here without a filesystem that stops answering).
    import signal
    import subprocess

    stopped = subprocess.Popen(["sleep", "60"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        ranks[2]["pid"] = stopped.pid
        silent = hang_line(ranks, {0: WAITING, 1: WAITING}, [2], "silent", "gpu-07", 31.0, tmp_path)
        assert "rank 2 on gpu-07 did not answer the request for its stack: it is stopped (state T: SIGSTOP" in silent, silent
    finally:
        stopped.kill()
        stopped.wait()
    ranks[2]["pid"] = 999999999  # gone: nothing more to say than the answer it did not give
    gone = hang_line(ranks, {}, [2], "silent", "h", 31.0, tmp_path)
    assert "did not answer the request for its stack (stuck outside Python: in native code that holds Python's GIL" in gone, gone
    # A rank whose main thread is not under worker.py's main (a stack cut short): the main thread is the last one
    # faulthandler lists (the newest first), never the dump thread, nor a helper thread busy at work.
    helpers = """Current thread 0x3 (most recent call first):
  File "/x/aura_hpc/train/process/worker_log.py", line 90 in _dump_when_asked
Thread 0x4 (most recent call first):
  File "/x/aura_hpc/data/background_shards.py", line 70 in _fetch
Thread 0x1 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/x/aura_hpc/comm/collectives.py", line 121 in all_reduce
"""
    assert name_culprits(ranks, {0: helpers, 1: READING, 2: helpers}) == ([1], "working")


def test_a_killed_launchers_progress_folder_is_removed_by_the_next_and_a_live_ones_kept(tmp_path: Path) -> None:
    from aura_hpc.launch.hang_watch import _sweep

    ns = os.stat("/proc/self/ns/pid").st_ino
    gone = tmp_path / "aura-progress-999999999-abc"  # no such process
    gone_here = tmp_path / f"aura-progress-999999999-n{ns}-abc"  # no such process in this PID namespace
    alive = tmp_path / f"aura-progress-{os.getpid()}-def"
    other = tmp_path / "aura-progress-999999999-ghi"
    # A launcher in another container's PID namespace that shares this /dev/shm: its PID means nothing here.
    elsewhere = tmp_path / f"aura-progress-999999999-n{ns + 1}-jkl"
    for f in (gone, gone_here, alive, other, elsewhere):
        f.mkdir()
        (f / "rank0").write_bytes(b"x")
    (other / "notes.txt").write_text("not ours")  # something we did not write: the folder stays
    # A launcher that exited and was never reaped (a container's PID 1 that does not reap): a zombie, not alive.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.05)
    unreaped = tmp_path / f"aura-progress-{zombie.pid}-n{ns}-zzz"
    unreaped.mkdir()
    (unreaped / "rank0").write_bytes(b"x")
    try:
        _sweep(tmp_path)
    finally:
        zombie.wait()
    assert not gone.exists() and not gone_here.exists() and (alive / "rank0").exists() and (other / "notes.txt").exists()
    assert (elsewhere / "rank0").exists() and not unreaped.exists()


def test_a_slurm_nodes_page_folder_another_user_made_first_is_refused(tmp_path: Path) -> None:
    """Its name is predictable (job, attempt, node): a folder another user made first, open to others, or a
    link in its place is not used, and no page is written through a link."""
    ours = tmp_path / "aura-progress-slurm-7-0-n1"
    assert progress.shared_folder(ours) is None and progress.shared_folder(ours) is None  # made once, then taken
    assert ours.stat().st_mode & 0o777 == 0o700
    open_to_all = tmp_path / "aura-progress-slurm-8-0-n1"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("my data")
    (open_to_all / "rank0").symlink_to(victim)
    said = progress.shared_folder(open_to_all)
    assert said and "made by another user or is open to others" in said and "mode 777" in said, said
    with pytest.raises(OSError):
        progress.Progress(open_to_all / "rank0")
    assert victim.read_text() == "my data"
    link = tmp_path / "aura-progress-slurm-9-0-n1"
    link.symlink_to(ours)
    assert "is not a folder" in (progress.shared_folder(link) or "")
    if os.getuid() == 0:  # another user's folder, as root can make one
        theirs = tmp_path / "aura-progress-slurm-10-0-n1"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        assert "owner uid 65534" in (progress.shared_folder(theirs) or "")


def test_the_board_carries_signed_verdicts_between_nodes_and_ignores_strangers(tmp_path: Path) -> None:
    """The nodes of a LAN run tell each other about a hang in node 0's store: a verdict signed with the run's
    secret is read back (its text made safe for a terminal); an unsigned, forged or oversized one is not; a
    node relaunching after a hang waits for node 0's new store, not the old one."""
    import json
    from datetime import timedelta

    from aura_hpc.comm import stores
    from aura_hpc.launch.hang_board import PREFIX, HangBoard, Verdict

    def server(port: int) -> Any:
        s = stores.bound_server("127.0.0.1", port, timedelta(seconds=10), multi_tenant=True)
        s.set(stores.ROUND_KEY, f"{time.time()}")
        return s

    store = server(0)
    port = store.port
    node0, node1 = (HangBoard("127.0.0.1", port, n, 3, "the-run-secret") for n in (0, 1))
    stranger = HangBoard("127.0.0.1", port, 2, 3, "not-the-secret")
    line = "hang: rank 1 on b \x1b[2J did not answer"
    assert node1.publish(Verdict(1, "b", line, [1], time.time(), 12))
    assert stranger.publish(Verdict(2, "c", "hang: rank 0 on a is the culprit", [0], time.time(), 12))
    [seen] = node0.others()
    assert (seen.node, seen.culprits, seen.step) == (1, [1], 12) and "\x1b" not in seen.line and "did not answer" in seen.line
    store.set(f"{PREFIX}2", json.dumps({"v": json.dumps({"node": 2}), "mac": "0" * 64}))  # forged
    store.set(f"{PREFIX}2", b"x" * 100_000)  # oversized
    assert [v.node for v in node0.others()] == [1]
    node0.mark_seen()  # the workers restarted in place (the same store): an older hang's verdict is not this one's
    assert node0.others() == []
    # A verdict published since counts whatever its clock says: node 1's, ten minutes behind node 0's, was dropped.
    assert node1.publish(Verdict(1, "b", "hang: rank 1 on b", [1], time.time() - 600, 13))
    assert [v.step for v in node0.others()] == [13]
    node1.note_round()
    assert node1.round_seen is not None
    old_verdict = store.get(f"{PREFIX}1")
    del store  # node 0's launcher ends its attempt; its next one makes the store anew on the same port
    again = server(port)
    started = time.monotonic()
    node1.wait_for_a_new_store(30)
    assert time.monotonic() - started < 10 and again.check([stores.ROUND_KEY])
    # A stranger who read node 1's signed verdict in the old store replays it in the new one: with the
    # nodes' clocks apart by minutes its time would pass, its round does not.
    node0.note_round()
    node0.new_attempt()  # what its watchdog does as the launcher starts the workers again
    again.set(f"{PREFIX}1", old_verdict)
    assert node0.others() == [] and node0.round_seen not in (None, node1._stale_round)
    # This attempt's verdicts are read both ways (node 0 kept the first store's round: each refused the other's).
    assert node1.publish(Verdict(1, "b", "hang: rank 1 on b", [1], time.time(), 30))
    assert [v.step for v in node0.others()] == [30]
    assert node0.publish(Verdict(0, "a", "hang: rank 1 on b", [1], time.time(), 30))
    assert [v.node for v in node1.others()] == [0]


def test_the_watchdog_asks_each_ranks_flight_recorder_through_its_pipe_and_keeps_the_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL's flight recorder answers on its monitor thread, which a CPU run has not: a process here plays
    that thread's part of torch's protocol (ProcessGroupNCCL's DumpPipe: read <stem><rank>.pipe, then write
    the pickle to <TORCH_FR_DUMP_TEMP_FILE><rank>, in place). What is ours is tested: the variables (a user's
    dump prefix wins, under both its names), the poke that never blocks (a pipe nobody reads, a plain file),
    a dump kept only once new and whole, and the copy into the hang's folder."""
    import subprocess
    import sys

    import torch

    from aura_hpc.launch.hang_evidence import ask_flight_recorders, keep_flight_records, prepare_flight_recorder, remove_pipes

    for v in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    mine = tmp_path / "mine" / "fr_"
    mine.parent.mkdir()
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(mine))  # the user's, under its older name
    folder, run_dir, where = tmp_path / "progress", tmp_path / "run", tmp_path / "run" / "hangs" / "now"
    folder.mkdir()
    where.mkdir(parents=True)
    prepare_flight_recorder(folder, run_dir)
    # torch 2.13's defaults record and read the pipe (the older names would only warn).
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(mine) and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    else:  # 2.6: nothing recorded, the pipe read every 8 minutes, unless told
        assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
        monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")  # the user's size, under the newer name 2.6 does not read
        prepare_flight_recorder(folder, run_dir)
        assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    (tmp_path / "mine" / "fr_0").write_bytes(b"an old dump.")  # from an earlier timeout: not this hang's
    os.mkfifo(folder / "nccl_pipe_0.pipe")  # rank 0: its monitor thread reads the pipe
    os.mkfifo(folder / "nccl_pipe_1.pipe")  # rank 1: nobody reads it (stuck outside, or gone)
    (folder / "nccl_pipe_2.pipe").write_text("not a pipe")
    monitor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)\n"
            "while not os.read(fd, 1): time.sleep(0.05)\n"
            "f = open(sys.argv[2], 'wb'); f.write(b'record of rank 0'); f.flush(); time.sleep(0.6); f.write(b' ends.'); f.close()\n",
            str(folder / "nccl_pipe_0.pipe"),
            str(mine) + "0",
        ]
    )
    try:
        time.sleep(0.5)  # the reader has the pipe open
        t0 = time.monotonic()
        asked = ask_flight_recorders([0, 1, 2, 3])
        assert list(asked) == [0] and time.monotonic() - t0 < 1, "a pipe nobody reads must not block the watchdog"
        assert keep_flight_records(asked, where, time.time() + 10) == {0: "nccl_flight_record_rank0"}
        assert (where / "nccl_flight_record_rank0").read_bytes() == b"record of rank 0 ends."  # whole, not half
    finally:
        monitor.kill()
        monitor.wait()
    remove_pipes(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["nccl_pipe_2.pipe"]  # a plain file is not ours to remove


_GLOO_RANKS = """
import os, sys, time, torch, torch.distributed as dist
from aura_hpc.train.process import flight_dump
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
assert flight_dump.serve(rank)
for _ in range(3):
    dist.all_reduce(torch.ones(4))
print("ready", flush=True)
if rank == 1:
    time.sleep(120)  # held up in Python (reading data, say): it never enters the 4th
dist.all_reduce(torch.ones(1000))
"""


@pytest.mark.skipif(
    not hasattr(__import__("torch")._C._distributed_c10d, "_dump_fr_trace"), reason="needs a torch whose gloo keeps a flight record (2.13)"
)
def test_gloo_ranks_dump_their_flight_records_on_request_and_the_one_that_never_entered_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real gloo ranks (torch's own flight recorder): rank 0 waits in its 4th all_reduce, rank 1 never
    enters it. The watchdog's pipes are answered by each rank's thread while rank 0's training thread is
    inside gloo, the dumps are kept whole, and the records name rank 1, the collective, and rank 0's line."""
    import subprocess
    import sys

    from aura_hpc.launch import flight_records
    from aura_hpc.launch.hang_evidence import ask_flight_recorders, keep_flight_records

    folder, where = tmp_path / "progress", tmp_path / "hang"
    folder.mkdir()
    where.mkdir()
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", str(folder / "nccl_pipe_"))
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "fr_"))
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    init = f"file://{tmp_path / 'rdzv'}"
    procs = [
        subprocess.Popen([sys.executable, "-c", _GLOO_RANKS, str(r), init], stdout=subprocess.PIPE, text=True, env={**os.environ})
        for r in (0, 1)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(1)  # rank 0 is inside its 4th all_reduce
        asked = ask_flight_recorders([0, 1])
        assert sorted(asked) == [0, 1]
        kept = keep_flight_records(asked, where, time.time() + 20)
        assert kept == {0: "nccl_flight_record_rank0", 1: "nccl_flight_record_rank1"}
        records = flight_records.read_kept(where, kept)
        stuck = flight_records.judge(records, [0, 1])
        assert stuck is not None and stuck.culprits == [1] and (stuck.op, stuck.seq) == ("gloo:all_reduce", 4), stuck
        assert stuck.line.startswith("rank 1 never entered gloo:all_reduce #4 of group 0 (rank 0 did, at ")
        # Rank 1 alone (rank 0 gave nothing): nothing to name from one record. (gloo marks a collective
        # completed late: on a busy machine rank 1's third may still read as unfinished, said, never named.)
        lone = flight_records.judge({1: records[1]}, [0, 1])
        assert lone is None or lone.culprits == [], lone
        alone = flight_records.judge({0: records[0]}, [0, 1])
        assert (
            alone is not None
            and alone.culprits == []
            and alone.line.endswith("rank 0 waits in gloo:all_reduce #4 of group 0; rank 1 gave no record")
        )
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_flight_record_is_read_as_plain_values_only(tmp_path: Path) -> None:
    """A dump on a shared run directory is another node's file: a pickle that names any class (here one
    that would run a command) is refused unread, as is an oversized or truncated one; NCCL's states tell a
    rank whose collective never finished on its device from those whose did."""
    import pickle

    from aura_hpc.launch import flight_records

    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {ran}",))

    (tmp_path / "evil").write_bytes(pickle.dumps({"entries": [Evil()]}))
    (tmp_path / "cut").write_bytes(pickle.dumps({"entries": []})[:-3])
    assert flight_records.load(tmp_path / "evil") is None and not ran.exists()
    assert flight_records.load(tmp_path / "cut") is None and flight_records.load(tmp_path / "absent") is None

    def nccl(seq_done: int, pg_id: int = 0, save: bool = False) -> dict[str, Any]:
        """A record shaped as NCCL writes it: its group ids are per process (here `pg_id`), the names shared."""
        entry = {"pg_id": pg_id, "process_group": ("0", "default_pg"), "collective_seq_id": 7, "profiling_name": "nccl:all_reduce"}
        done = {"last_enqueued_collective": 7, "last_started_collective": 7, "last_completed_collective": seq_done}
        status, entries = {str(pg_id): done}, [entry]
        if save:  # the save group ("5"), whose first collective this rank entered
            entries.append({"pg_id": 9, "process_group": ("5", "checkpoint-io"), "collective_seq_id": 1, "profiling_name": "nccl:barrier"})
            status["9"] = {"last_enqueued_collective": 1, "last_started_collective": 1, "last_completed_collective": 0}
        return {"entries": entries, "pg_status": status, "pg_config": {"5": {"name": "5", "desc": "checkpoint-io", "ranks": "[0, 1, 2]"}}}

    (tmp_path / "r2").write_bytes(pickle.dumps(nccl(7, pg_id=3)))
    records = {0: nccl(7), 1: nccl(6), 2: flight_records.load(tmp_path / "r2") or {}}
    stuck = flight_records.judge(records, [0, 1, 2])
    assert stuck is not None and stuck.culprits == [1]
    assert stuck.line == "rank 1 entered nccl:all_reduce #7 of group 0 and never finished it (the others did)"
    # Rank 2 never entered the save group's first collective: it has no status for that group at all.
    stuck = flight_records.judge({0: nccl(7, save=True), 1: nccl(7, save=True), 2: nccl(7)}, [0, 1, 2])
    assert stuck is not None and stuck.culprits == [2] and stuck.line.startswith("rank 2 never entered nccl:barrier #1 of group 5"), stuck


_WAITS = """
import sys, threading
from pathlib import Path
from aura_hpc.train.process import progress, worker_log
worker_log.setup(Path(sys.argv[1]).parent, 0)
worker_log.dump_stacks_on(progress.STACK_SIGNAL)
def deep(n):
    return 0 if n == 0 else deep(n - 1) + 1
def come_and_go():  # threads that start and end all the time (the parameter server's links, a loader's)
    while True:
        t = threading.Thread(target=deep, args=(20,))
        t.start()
        t.join()
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 0):
    threading.Thread(target=come_and_go, daemon=True).start()
print("ready", flush=True)
def wait_for_peer():
    threading.Event().wait()  # a rank that only waits for its peer
wait_for_peer()
"""


def test_a_rank_asked_for_its_stacks_again_and_again_while_threads_come_and_go_lives_and_answers(tmp_path: Path) -> None:
    """faulthandler's signal handler walked the other threads without the GIL: with threads starting and ending,
    a storm of stack requests killed the process asked (SIGSEGV in 8 of 8 tries of this storm; once on the
    parameter server in the suite). The dump thread answers with the GIL, while the main thread waits."""
    log = tmp_path / "logs" / "rank_0.log"
    rank = subprocess.Popen([sys.executable, "-c", _WAITS, str(log), "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        sent, end = 0, time.monotonic() + 4
        while time.monotonic() < end and rank.poll() is None:
            rank.send_signal(progress.STACK_SIGNAL)
            sent += 1
            time.sleep(0.002)
        assert rank.poll() is None, f"the rank died ({rank.returncode}) after {sent} stack requests"
        before = log.stat().st_size
        rank.send_signal(progress.STACK_SIGNAL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "in wait_for_peer" not in log.read_bytes()[before:].decode(errors="replace"):
            time.sleep(0.1)
        last = log.read_bytes()[before:].decode(errors="replace")
        assert "most recent call first" in last and "in wait_for_peer" in last, last[-3000:]
        assert rank.poll() is None
    finally:
        rank.kill()
        rank.wait()


def _old_page(folder: Path, rank: int, pid: int, step: int, idle_s: float) -> None:
    beat = time.time() - idle_s
    progress.file_for(folder, rank).write_bytes(progress.page_bytes(pid, progress.SECTIONS.index("step"), step, 60, 1, beat, beat))


def test_a_node_whose_ranks_only_wait_keeps_their_stacks_before_the_naming_node_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes' watchdogs on one board. Node 1's rank is silent (the culprit); node 0's rank waits, and
    node 0's own timeout is far off (1,000 s). Node 0 still takes its rank's stack as soon as it reads node
    1's verdict, and node 1 kills only after node 0's verdict is on the board: a kill first would have ended
    node 0's rank on a broken connection, with no stack. (The waits scaled down, in order: node 0 reads the board
    after 2 s without progress, node 1 names its rank after 3, and gives it 1.5 s to answer for its stack.)"""
    import subprocess
    import sys
    from datetime import timedelta

    from aura_hpc.comm import stores
    from aura_hpc.launch import hang_watch
    from aura_hpc.launch.hang_board import HangBoard

    monkeypatch.setattr(hang_watch, "PEER_POLL_IDLE_S", 2.0)
    monkeypatch.setattr(hang_watch, "ANSWER_WAIT_S", 1.5)
    store = stores.bound_server("127.0.0.1", 0, timedelta(seconds=10), multi_tenant=True)
    watches = [_watch(tmp_path / "n0", "health.hang_step_floor_s=1000"), _watch(tmp_path / "n1", "health.hang_step_floor_s=3")]
    log0 = watches[0].cfg.run_dir / "logs" / "rank_0.log"
    log0.parent.mkdir(exist_ok=True)
    waits = subprocess.Popen([sys.executable, "-c", _WAITS, str(log0)], stdout=subprocess.PIPE, text=True)
    silent = subprocess.Popen(["sleep", "600"])  # SIGWINCH is ignored: it never answers for its stack
    try:
        assert waits.stdout is not None and waits.stdout.readline().strip() == "ready"
        for node, (w, proc) in enumerate(zip(watches, (waits, silent), strict=True)):
            w.board, w.poll_s = HangBoard("127.0.0.1", store.port, node, 2, "the-run-secret"), 0.2
            _old_page(w.folder, node, proc.pid, 12, idle_s=20)
        for w in watches:
            w.start()
        deadline = time.monotonic() + 60
        while not all(w.hangs for w in watches) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(w.hangs for w in watches), [w.hangs for w in watches]
        here, named = watches[0].hangs[0], watches[1].hangs[0]
        assert named.culprits == [1] and here.culprits == [1] and "named by node 1" in here.line, (here.line, named.line)
        stack = (here.folder / "rank0.txt").read_text()
        assert "most recent call first" in stack and "in wait" in stack, stack
        [verdict0] = watches[1].board.others() if watches[1].board else []
        assert verdict0.node == 0 and named.killed_at >= verdict0.declared_at, (named.killed_at, verdict0)
        assert waits.wait(10) == -9 and silent.wait(10) == -9  # each node killed its own
    finally:
        for w in watches:
            w.close()
        for proc in (waits, silent):
            proc.kill()
            proc.wait()


def test_a_slurm_node_takes_its_evidence_on_another_nodes_record_and_the_naming_node_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on Slurm, where the nodes meet in the shared RUN_DIR/hangs/ (the requeue ends every node's
    ranks): another node's record of this attempt with a culprit makes a node whose ranks wait declare now;
    its own, an older attempt's or a torn record do not; the naming node waits for the other nodes' records,
    EVIDENCE_WAIT_S at most."""
    import json

    from aura_hpc.slurm import watch as slurm_watch

    cfg = load_config(None, ["health.hang_step_floor_s=1000"], output_dir=str(tmp_path), run_name="run")
    (tmp_path / "progress").mkdir()
    w = slurm_watch.SlurmHangWatch(cfg, tmp_path / "progress")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")

    def record(folder: str, host: str, culprits: list[int], at: float) -> None:
        (cfg.run_dir / "hangs" / folder).mkdir(parents=True)
        body = {"host": host, "line": f"hang: on {host}", "culprits": culprits, "declared_at": at}
        (cfg.run_dir / "hangs" / folder / "hang.json").write_text(json.dumps(body))

    record("old-n2", "n2", [1], time.time() + 100)  # an earlier attempt's, from a node whose clock ran ahead
    w.nodes, w.started = 3, time.time()
    w.note_earlier_records()
    now = time.time()
    ranks = {0: _page("step", 12, 60, now - 20, pid=os.getpid())}
    record("mine-n1", "n1", [0], now)  # this node's own
    (cfg.run_dir / "hangs" / "torn-n3").mkdir()
    (cfg.run_dir / "hangs" / "torn-n3" / "hang.json").write_text('{"host": "n3", "cul')
    w.peer_hangs = w.peer_verdicts()
    assert w.peer_hangs == [] and not w.named_elsewhere(ranks, now)
    monkeypatch.setattr(slurm_watch, "EVIDENCE_WAIT_S", 1.5)
    t0 = time.monotonic()
    w._wait_for_evidence_elsewhere()  # nobody else has spoken: it gives up after EVIDENCE_WAIT_S
    assert 1.4 <= time.monotonic() - t0 < 5
    record("now-n2", "n2", [2], now - 90)  # this attempt's, from a node whose clock runs 90 s behind this one's
    w.peer_hangs = w.peer_verdicts()
    assert [(v.host, v.culprits) for v in w.peer_hangs] == [("n2", [2])] and w.named_elsewhere(ranks, now)
    assert not w.named_elsewhere({0: _page("step", 12, 60, now - 2, pid=os.getpid())}, now)  # it still moves: not waiting
    record("now-n3", "n3", [], now)  # every other node has its record: no wait
    t0 = time.monotonic()
    w._wait_for_evidence_elsewhere()
    assert time.monotonic() - t0 < 1
    # The hang budget: counted once per hang, not again by a node acting alone after the naming node did, nor by
    # each node of a job where none named a culprit (each acts after ELSEWHERE_WAIT_S: 3 nodes spent a budget of 2).
    w.restarts = 0
    assert w._within_budget(12) == (True, "hang restart 1 of at most 2 in a row without progress")
    assert w._within_budget(12) == w._within_budget(12) == (True, "hang restart 1 of at most 2 in a row without progress")
    assert w._within_budget(12, count=False)[0]
    w.restarts = 1  # the requeued job hangs again at the same step
    assert w._within_budget(12)[1] == "hang restart 2 of at most 2 in a row without progress"
    w.restarts = 2
    assert not w._within_budget(12)[0] and not w._within_budget(12, count=False)[0]
    w.job_id, w.restarts = w.job_id + 1, 0  # the same command submitted again, hanging at that step once more
    assert not w._within_budget(12)[0] and "it hung 4 times in a row" in w._within_budget(12)[1]


def test_a_slurm_watch_whose_run_directory_stops_answering_still_requeues_and_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slurm's act read the other nodes' records, the hang budget and the nodes to leave out in the shared RUN_DIR: on
    a mount that stopped answering it waited there forever, the job neither requeued nor its ranks killed until its
    time limit. Here every file it reads there is a FIFO nobody writes (a read that never returns)."""
    import contextlib

    from aura_hpc.launch.hang_watch import Hang
    from aura_hpc.ops import excluded_nodes
    from aura_hpc.slurm import exclude
    from aura_hpc.slurm import watch as slurm_watch

    cfg = load_config(None, [], output_dir=str(tmp_path), run_name="run")
    (tmp_path / "progress").mkdir()
    w = slurm_watch.SlurmHangWatch(cfg, tmp_path / "progress")
    w.nodes, w.job_id, w.restarts = 2, 4242, 1
    (cfg.run_dir / "hangs" / "n2").mkdir(parents=True)
    fifos = [cfg.run_dir / "hangs" / "n2" / "hang.json", cfg.run_dir / "hangs" / slurm_watch.BUDGET_FILE, cfg.run_dir / excluded_nodes.FILE]
    for fifo in fifos:
        os.mkfifo(fifo)
    monkeypatch.setattr(slurm_watch, "RUN_DIR_S", 1.0)
    asked: list[str] = []
    monkeypatch.setattr(exclude, "why_stopped", lambda job_id, restarts=None: exclude.Stopped())  # scontrol: no such job here
    monkeypatch.setattr(exclude, "requeue", lambda job_id: asked.append(f"requeue {job_id}"))
    monkeypatch.setattr(w, "kill", lambda ranks: asked.append(f"kill {sorted(ranks)}"))
    was = signal.getsignal(signal.SIGTERM)  # the act ignores SIGTERM to outlive its requeue
    try:
        t0 = time.monotonic()
        hang = Hang("hang: rank 1 is the culprit", tmp_path / "progress", [1], 12, time.time() - 100)
        assert w.act(hang, {0: {"pid": 0}, 1: {"pid": 0}})
        assert time.monotonic() - t0 < 10 and asked == ["requeue 4242", "kill [0, 1]"], asked
        out = capsys.readouterr().out
        assert f"{cfg.run_dir} did not answer within 1 s (a mount that hangs?): acting without it" in out, out
        assert "(the job's requeue 2 of at most slurm.max_requeues=10: the run directory's count of hangs in a row unread)" in out, out
        w.restarts, w.run_dir_hung, asked[:] = 10, False, []  # its requeues past slurm.max_requeues: not requeued, still killed
        assert w.act(hang, {0: {"pid": 0}}) and asked == ["kill [0]"], asked
        assert "not requeued: it would be the job's requeue 11, past slurm.max_requeues=10 (the run" in capsys.readouterr().out
    finally:
        signal.signal(signal.SIGTERM, was)
        for fifo in fifos:  # the reads still waiting end (EOF)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_laptop_resumed_from_sleep_or_a_clock_stepped_forward_is_no_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idleness was measured on the wall clock, which counts a laptop's sleep (its ranks did not run either) and
    jumps with NTP: the first look after a resume saw minutes without progress, and the ranks were killed and
    restarted from their last checkpoint. It is the watchdog's own monotonic time since a page last moved."""
    import subprocess

    w = _watch(tmp_path, "health.hang_step_floor_s=10")
    live = subprocess.Popen(["sleep", "600"])
    try:
        w.poll_s = 0.2
        _old_page(w.folder, 0, live.pid, 12, idle_s=0)
        w.start()
        time.sleep(1)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 600)  # the wall clock after a 10-minute sleep
        time.sleep(1)
        _old_page(w.folder, 0, live.pid, 13, idle_s=0)  # the rank's next step, on the woken wall clock
        time.sleep(1)
        monkeypatch.undo()
        # Nor is the sleep a step's time: five times it became the run's step timeout (the calibration file).
        assert w.calibration.get("step", 0.0) < 10, w.calibration
        declared = list((w.cfg.run_dir / "hangs").glob("*")) if (w.cfg.run_dir / "hangs").exists() else []
        assert declared == [] and not w._busy.is_set() and w.hangs == [] and live.poll() is None, declared
    finally:
        live.kill()
        w.close()
        live.wait()


def test_a_verdict_of_an_earlier_attempt_does_not_stop_the_restarted_workers(tmp_path: Path) -> None:
    """The elastic agent restarts the workers in place: node 1's verdict from before that restart stays on the
    board, and the new workers' pages (quiet for more than 10 s in their start-up) must not be read as
    waiting for it."""
    import subprocess
    from datetime import timedelta

    from aura_hpc.comm import stores
    from aura_hpc.launch.hang_board import HangBoard, Verdict

    store = stores.bound_server("127.0.0.1", 0, timedelta(seconds=10), multi_tenant=True)
    w = _watch(tmp_path, "health.hang_step_floor_s=1000")
    old, new = subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"])
    try:
        w.board, w.poll_s = HangBoard("127.0.0.1", store.port, 0, 2, "the-run-secret"), 0.2
        _old_page(w.folder, 0, old.pid, 12, idle_s=0)
        w.start()
        time.sleep(0.5)
        HangBoard("127.0.0.1", store.port, 1, 2, "the-run-secret").publish(Verdict(1, "b", "hang: rank 1 on b", [1], time.time(), 12))
        _old_page(w.folder, 0, new.pid, 10, idle_s=20)  # the restarted worker, quiet in its start-up
        time.sleep(3)
        declared = list((w.cfg.run_dir / "hangs").glob("*")) if (w.cfg.run_dir / "hangs").exists() else []
        assert declared == [] and w.hangs == [] and new.poll() is None, declared
    finally:
        w.close()
        for proc in (old, new):
            proc.kill()
            proc.wait()


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (the kernel's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_slurm_attempts_pages_are_its_own_and_leave_with_it(tmp_path: Path) -> None:
    """A controller restarted without its state hands job ids out again: the page a killed task left under
    the same job, attempt and node (here: a finished rank 0) is not read as this attempt's, which would end
    the watchdog before the first step. Slurm's SIGTERM at the attempt's end (a requeue, the time limit)
    takes the attempt's folder out of the node's /dev/shm with the watchdog; its USR2 before the time limit (which
    Slurm sends to every process of the step) leaves the watchdog watching the ranks stop."""
    cfg = load_config(None, [], output_dir=str(tmp_path), run_name="run")
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml())
    job, node = 900_000 + os.getpid() % 90_000, "n-test"
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    folder = base / f"aura-progress-slurm-{job}-0-{node}"
    folder.mkdir(mode=0o700)
    env = {**os.environ, "SLURMD_NODENAME": node, "SLURM_LOCALID": "0"}
    env.pop(progress.ENV, None)
    leave_finished = (
        "import sys, pathlib; from aura_hpc.train.process import progress; progress.Progress(pathlib.Path(sys.argv[1])).enter('finished')"
    )
    subprocess.run([sys.executable, "-c", leave_finished, str(folder / "rank0")], check=True, env=env)
    assert progress.read(folder / "rank0")["section"] == "finished"
    task = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from aura_hpc.slurm.job import _start_watchdog; import sys, time; "
            "w = _start_watchdog(sys.argv[1], int(sys.argv[2]), 0); print(w.pid, flush=True); time.sleep(120)",
            str(cfg.run_dir / "config.yaml"),
            str(job),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert task.stdout is not None
        watchdog = int(task.stdout.readline())
        assert not (folder / "rank0").exists(), "the stale page is still there"
        time.sleep(3)
        assert process_alive(watchdog), "the watchdog left at once: it read the stale page as this attempt's"
        deadline = time.monotonic() + 60  # its start on a busy machine: until it catches Slurm's signals
        while not _catches(watchdog, signal.SIGUSR2) or not _catches(watchdog, signal.SIGTERM):
            assert time.monotonic() < deadline and process_alive(watchdog), "the watchdog never caught SIGUSR2 and SIGTERM"
            time.sleep(0.1)
        os.kill(watchdog, signal.SIGUSR2)  # Slurm's pre-timeout warning reaches every process of the step
        time.sleep(1.5)
        assert process_alive(watchdog), "Slurm's USR2 ended the watchdog: the ranks' checkpoint and stop went unwatched"
        assert folder.exists()
        os.kill(watchdog, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not folder.exists(), f"{folder} stayed in the node's {base} after Slurm's SIGTERM"
        assert task.poll() is None  # the watchdog left on the signal, not because its task did
    finally:
        task.kill()
        task.wait()
        for f in folder.glob("*") if folder.exists() else []:
            f.unlink()
        if folder.exists():
            folder.rmdir()


def test_a_stop_signal_is_timed_when_it_comes_not_when_the_agent_next_asks() -> None:
    """The launcher's verdict (exit 75, or 130 'before a checkpoint could be written') compares the checkpoint's
    time with the signal's: taken when the agent polled, after its workers had exited, a checkpoint they wrote
    for the stop seemed older than the signal."""
    import signal as signals

    from aura_hpc.launch.stop_signals import StopSignals

    previous = signals.signal(signals.SIGUSR2, lambda *_: None)
    stops = StopSignals()
    try:
        stops.install()
        sent = time.time()
        os.kill(os.getpid(), signals.SIGUSR2)
        time.sleep(1.5)  # the agent busy with its workers' exit
        first = stops.poll()
        assert first is not None and first[0] == signals.SIGUSR2 and first[1] - sent < 0.7, (first, sent)
    finally:
        stops.close()
        signals.signal(signals.SIGUSR2, previous)


def test_every_signal_the_launcher_forwards_stops_the_workers_with_a_checkpoint() -> None:
    """The agent forwards SIGQUIT (Ctrl+\\) as a stop, and torch < 2.8 forwards it whatever it is told: the workers
    had no handler for it, so every rank dumped core at once, with no checkpoint."""
    import signal as signals

    from aura_hpc.launch.agent import FORWARDED_SIGNALS
    from aura_hpc.train.process import stop as stops

    forwarded = [getattr(signals, name) for name in FORWARDED_SIGNALS.split(",")]
    before = {sig: signals.getsignal(sig) for sig in forwarded}
    last = stops.last_signal
    try:
        signals.signal(signals.SIGHUP, signals.SIG_DFL)  # as a terminal's shell leaves it (under nohup it stays ignored)
        for sig in forwarded:
            stop = stops.StopRequest()
            stop.install()
            handler = signals.getsignal(sig)
            assert callable(handler), signals.Signals(sig).name
            handler(sig, None)  # what the signal's delivery calls: a flag for the next step boundary
            assert stop.signal_name == signals.Signals(sig).name
        # A Slurm step's watch keeps watching the ranks stop on each of them (SIGTERM ends the attempt).
        from aura_hpc.slurm.watch import STOP_ASKED

        assert set(stops.STOP_SIGNALS) - {signals.SIGTERM} == set(STOP_ASKED)
    finally:
        stops.last_signal = last
        for sig, handler in before.items():
            signals.signal(sig, handler)


def test_under_nohup_a_hangup_stops_neither_the_launcher_nor_the_workers() -> None:
    """nohup leaves SIGHUP ignored; the agent (torch >= 2.8 handles what it is told to) and the workers' stop
    handler would have replaced that, so a logout stopped a run started with `nohup python -m aura_hpc local`."""
    import signal as signals

    from aura_hpc.launch.agent import agent_options
    from aura_hpc.train.process.stop import StopRequest

    before = {sig: signals.getsignal(sig) for sig in (signals.SIGTERM, signals.SIGINT, signals.SIGUSR1, signals.SIGUSR2, signals.SIGHUP)}
    signals.signal(signals.SIGHUP, signals.SIG_IGN)
    try:
        options, notes = agent_options(60)
        if "signals_to_handle" in options:
            assert "SIGHUP" not in options["signals_to_handle"] and "SIGUSR2" in options["signals_to_handle"]
            assert not any("hangup" in n for n in notes)
        else:  # torch < 2.8 (the floor): its agent handles SIGHUP regardless, and the user is told the fix
            assert any("hangup even under nohup" in n and "setsid" in n for n in notes), notes
        StopRequest().install()
        assert signals.getsignal(signals.SIGHUP) == signals.SIG_IGN
        signals.signal(signals.SIGHUP, signals.SIG_DFL)
        options, _ = agent_options(60)
        assert "SIGHUP" in options.get("signals_to_handle", "SIGHUP")
    finally:
        for sig, handler in before.items():
            signals.signal(sig, handler)


def test_a_run_directory_that_stops_answering_holds_up_neither_the_watch_nor_its_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RUN_DIR lives on shared storage, and a mount that stops answering is a common hang: ranks stuck in state D on
    it. The watch wrote its calibration there from its polling loop, and its evidence before any kill, and waited
    with them forever: no hang named, nothing killed. Here every write there blocks until the test lets it go."""
    import threading

    from aura_hpc.launch import hang_calibration, hang_watch

    mount = threading.Event()
    real_replace = os.replace

    def hung_replace(src: Any, dst: Any) -> None:
        mount.wait()
        real_replace(src, dst)

    from types import SimpleNamespace

    monkeypatch.setattr(hang_calibration, "os", SimpleNamespace(replace=hung_replace, getpid=os.getpid))  # its writes alone
    w = _watch(tmp_path)
    try:
        t0 = time.time()
        started = time.monotonic()
        w._learn(0, _page("step", 10, 5, t0))
        w._learn(0, _page("step", 12, 7, t0 + 20))  # a new longest step: the calibration is written
        w._learn(0, _page("step", 13, 8, t0 + 50))  # and again, while the first write still hangs
        assert time.monotonic() - started < 2 and w.calibration["step"] == 30.0
        monkeypatch.setattr(hang_watch, "INVESTIGATE_S", 1.0)
        monkeypatch.setattr(w, "investigate", lambda *args: mount.wait() and None)  # its first write into RUN_DIR hangs
        hang = hang_watch.investigate_in_time(w, {0: _page("step", 13, 8, t0 + 50), 1: _page("step", 12, 8, t0 + 40)})
        assert time.monotonic() - started < 5
        assert "its evidence could not be kept: " in hang.line and f"{w.cfg.run_dir} did not answer within 1 s" in hang.line
        # Where it was and when: the restart budget counts a hang without progress, the goodput ledger its time.
        assert hang.folder == w.folder and not hang.culprits and (hang.progress_step, hang.last_progress) == (12, t0 + 50)

        def slow_writes(ranks: dict, late: Any, named: list) -> None:  # the stacks read, the culprit named; then the files hang
            named.append(hang_watch.Hang("hang: rank 1 is the culprit", w.folder, [1], 12, t0 + 50))
            mount.wait()

        monkeypatch.setattr(w, "investigate", slow_writes)
        hang = hang_watch.investigate_in_time(w, {0: _page("step", 13, 8, t0 + 50), 1: _page("step", 12, 8, t0 + 40)})
        assert hang.culprits == [1] and hang.line.startswith("hang: rank 1 is the culprit; its evidence could not all be kept")
        # A write that fails (a full disk) is said as it was.
        monkeypatch.setattr(w, "investigate", lambda *args: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        assert (
            "could not be kept: [Errno 28] No space left on device" in hang_watch.investigate_in_time(w, {0: _page("step", 13, 8, t0)}).line
        )
    finally:
        mount.set()
        w.close()
    # Once the mount answers, the newest values are what the file holds.
    assert json.loads((w.cfg.run_dir / hang_calibration.CALIBRATION).read_text()) == {"step": 30.0}


def test_a_watch_thread_busy_past_its_stop_does_not_watch_on_beside_the_next_one(tmp_path: Path) -> None:
    """stop() waits 30 s for the thread; one still busy with a hang (a slow webhook) outlived it, and start() cleared the
    one stop flag both threads shared: two watches of the next attempt, two verdicts and two kills of one hang."""
    import threading

    w = _watch(tmp_path)
    w.poll_s = 0.05
    gate, calls = threading.Event(), []

    def read() -> dict:
        calls.append(1)
        if len(calls) == 1:
            gate.wait(10)  # the first attempt's thread, busy
        return {}

    w.read = read  # type: ignore[method-assign]
    try:
        w.start()
        first = w._thread
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        w._stop.set()  # stop(), whose wait for the busy thread ran out
        w.start()
        gate.set()
        assert first is not None and first is not w._thread
        first.join(5)
        assert not first.is_alive()  # it stopped at its next poll
        assert w._thread is not None and w._thread.is_alive()
    finally:
        gate.set()
        w.close()
