"""The exit statuses README.md documents for `local` are the ones the command produces.

0 is every finished run in test_training.py; 75 (stopped by a signal, checkpointed) is
test_faults.py::test_stop_signal_checkpoints_once_and_exits_resumable; 74 (data storage
unreachable, checkpointed) is test_s3.py; 76 (GPU circuit breaker)
is test_health.py; 1 (a rank killed past --max-restarts) and 3 (the loss non-finite past its rollbacks) are
test_faults.py's test_beyond_max_restarts_says_how_to_resume_and_rerun_resumes and
test_nan_forever_stops_with_a_clear_error; 2 for a checkpoint the worker refuses is its
test_a_checkpoint_the_worker_refuses_exits_2. 2 for a refused node and 77 are produced here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from aura_hpc import errors
from tests.conftest import REPO, SMALL_MODEL, cli_env, run_cli


def _documented() -> dict[int, str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    sentence = text[text.index("Exit statuses of `local`:") :].split("\n\n")[0]
    return {int(code): what.strip() for code, what in re.findall(r"`(\d+)`\s*([^,`]+)", sentence)}


def test_readme_lists_the_statuses_the_code_defines() -> None:
    doc = _documented()
    assert set(doc) == {
        errors.EXIT_OK,
        errors.EXIT_TRAIN_FAILED,
        errors.EXIT_USER_ERROR,
        errors.EXIT_DIVERGED,
        errors.EXIT_RESUMABLE,
        errors.EXIT_DATA_UNAVAILABLE,
        errors.EXIT_GPU_FAULT,
        errors.EXIT_HUNG,
        errors.EXIT_SCREEN,
    }, doc
    assert "failed" in doc[1] and "bad input" in doc[2] and "non-finite" in doc[3]


def _args(tmp_path: Path, prepared: Path, *extra: str) -> list[str]:
    return [
        "local",
        "--nproc-per-node",
        "2",
        "--output-dir",
        str(tmp_path),
        "--set",
        f"data.path={prepared}",
        *SMALL_MODEL,
        "--set",
        "train.max_steps=8",
        "--set",
        "train.warmup_steps=1",
        *extra,
    ]


def test_a_reader_gone_from_the_pipe_or_terminal_keeps_the_commands_own_status() -> None:
    """`local ... | tee run.log` stopped by Ctrl+C: tee dies with it, and rich's answer to the broken pipe of the last
    lines was exit 1, not the run's 75 (a script that requeues on 75 did not). A terminal gone (EIO) raised instead."""
    import subprocess
    import sys

    code = (
        "import os, sys\nfrom aura_hpc import console\n"
        "console.info('stopped by SIGINT: a checkpoint was written')\nconsole.table('run', [('status', 'stopped')])\n"
        "console.error('re-run the same command to resume')\nprint('and a last line', flush=True)\nsys.exit(75)\n"
    )
    # A full disk under `> file` is an error still: the file is not whole.
    with open("/dev/full", "wb") as no_room:
        full = subprocess.run([sys.executable, "-c", code], env=cli_env(), stdout=no_room, stderr=subprocess.PIPE, timeout=60)
    assert full.returncode not in (0, 75) and b"No space left on device" in full.stderr, full.stderr[-2000:]
    for gone in ("stdout", "both"):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line
        proc = subprocess.run(
            [sys.executable, "-c", code], env=cli_env(), stdout=write, stderr=write if gone == "both" else subprocess.PIPE, timeout=60
        )
        os.close(write)
        assert proc.returncode == errors.EXIT_RESUMABLE, (gone, proc.stderr)
        if gone == "stdout":
            assert b"re-run the same command to resume" in proc.stderr and b"Traceback" not in proc.stderr, proc.stderr


def test_bad_input_exits_2(tmp_path: Path) -> None:
    r = run_cli(["local", "--set", "model.n_layer=0", "--output-dir", str(tmp_path)], timeout=60)
    assert r.returncode == errors.EXIT_USER_ERROR == 2, r.stderr


def test_a_node_whose_worker_refused_its_settings_says_so_even_when_node_0_left_first(tmp_path: Path) -> None:
    """Node 0 and node 1 both refuse a setting that differs between them; node 0's launcher may close
    the rendezvous before node 1's reads its worker's status. Node 1 then names the refusal (status 2),
    not a lost master; a worker that only lost its peers is still a lost master."""
    from types import SimpleNamespace

    from aura_hpc.launch.worker_logs import refused_here as _refused_here

    plan = SimpleNamespace(cfg=SimpleNamespace(run_dir=tmp_path), node_rank=1, nproc=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    start = "[rank1] 2026-11-25 22:43:13 INFO start rank=1 local_rank=0 world_size=2 node_rank=1 host=vm backend=gloo"
    refusal = "rank 0 runs a different config than rank 1: train.lr is 0.001 there and 0.01 here (fix: pass the same --set on every node)"
    earlier = f"{start}\n[rank1] 2026-11-25 22:40:00 ERROR an earlier attempt's refusal\n[rank1] x INFO {errors.EXITING_LINE}2\n"
    (logs / "rank_1.log").write_text(
        f"{earlier}{start}\n[rank1] 2026-11-25 22:43:13 ERROR {refusal}\n[rank1] x INFO {errors.EXITING_LINE}2\n"
    )
    assert _refused_here(plan) == refusal  # type: ignore[arg-type]
    (logs / "rank_1.log").write_text(f"{earlier}{start}\n[rank1] 2026-11-25 22:43:13 ERROR lost the connection to the rank(s) at x\n")
    assert _refused_here(plan) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_hang_with_no_restart_left_exits_77_naming_the_rank_and_tells_the_webhook(tmp_path: Path, prepared: Path) -> None:
    """health.hang_restarts=0: the first hang ends the run, with the watchdog's line, its own status and
    a `training.hang` event to the webhook."""
    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hook = f"health.webhook_url=http://127.0.0.1:{server.server_address[1]}/hook"
    try:
        extra = ("--set", "health.hang_restarts=0", "--set", "health.hang_step_floor_s=5", "--set", hook)
        r = run_cli(_args(tmp_path, prepared, *extra), AURA_FAULT_STOP="0:3")
    finally:
        server.shutdown()
    assert r.returncode == errors.EXIT_HUNG, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "hang: rank 0 on " in last and "training after step 3" in last and "health.hang_restarts" in last, last
    assert "to resume" in last, last
    assert len(received) == 1 and received[0]["event"] == "training.hang" and received[0]["culprits"] == [0], received
    assert received[0]["line"] in last


# torch's own lines (c10's `[rankN]:` prefix, ProcessGroupNCCL's watchdog), as it logs its abort after a timeout,
# after a peer gone (NCCL's words) and after a CUDA error, each before its SIGABRT; among them the lines our
# workers write as an attempt starts and once its rank is known. Node 1 of 2 runs ranks 1-5 (local ranks 0-4).
def _started(local: int) -> str:
    return f"[aura_hpc] aura_hpc worker started: local rank {local}\n[rank{local + 1}]: aura_hpc worker joined: local rank {local}\n"


def _abort(rank: int, why: str) -> str:
    return f"[rank{rank}]:[E1127 10:00:0{rank}.1 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group \
watchdog thread terminated with exception: {why}\n"


TIMEOUT = "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=77, OpType=ALLREDUCE, NumelIn=1, \
NumelOut=1, Timeout(ms)=600000) ran for 600047 milliseconds before timing out."
GONE = "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there was a network \
error, NCCL version 2.21.5"
EARLIER = _started(0) + _abort(1, TIMEOUT)  # a launch before this one
NOW = (
    "".join(_started(local) for local in range(5))
    + _abort(1, "CUDA error: an illegal memory access was encountered")
    + _abort(2, TIMEOUT)
    + _started(1)  # local rank 1 restarted by the agent: its new attempt died otherwise (no abort line)
    + "[rank2]:[F1127 10:00:04.1 some.cpp:1] Check failed: a C++ assertion\n"
    + "[rank3]:[W1127 10:00:04.2 ProcessGroupNCCL.cpp:1000] a warning\n"
    + f"torch.distributed.DistBackendError: {GONE}\n"  # unprefixed: any process's (a traceback)
    + _abort(4, GONE)
    + "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
    + _abort(5, TIMEOUT)
)


def test_ranks_nccl_took_down_for_waiting_on_a_peer_are_named_after_the_cause(tmp_path: Path) -> None:
    """On NCCL a rank whose collective timed out, or whose peer went away, is taken down by torch's watchdog
    with SIGABRT: killed by a signal, it was named first, as the cause. Its own abort line says it waited.
    Not demoted: a CUDA error leaving the same way, a wait in an earlier attempt or launch, a rank that an
    unprefixed line (any process's traceback) follows. The launcher numbers this node's ranks 0-4 (torchrun
    counted it first), torch's lines and ours 1-5 (node 0 holds rank 0): matched by the workers' own lines, and
    named as ours, the N of the rank_N.log the user opens next."""
    import signal
    from types import SimpleNamespace

    from aura_hpc.config import RunConfig
    from aura_hpc.launch.agent import _failure
    from aura_hpc.launch.plan import LocalPlan

    cfg = RunConfig()
    cfg.output_dir, cfg.run_name = str(tmp_path), "nccl"
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True)
    (logs / "stderr_node1.log").write_text(EARLIER + NOW)
    abort, since = -signal.SIGABRT, len(EARLIER.encode())
    when = {0: 22.0, 1: 21.0, 2: 20.0, 3: 23.0, 4: 19.0}
    failures = {r: SimpleNamespace(exitcode=abort, timestamp=t, local_rank=r) for r, t in when.items()}
    plan = LocalPlan(cfg, 2, 1, 5, "127.0.0.1", 29500, 0, 60, None)
    line = str(_failure(plan, failures, since))
    named = re.findall(r"rank (\d) (was killed by SIGABRT|was ended by NCCL \(([^:]+): it waited)", line)
    assert [(r, w.split(" (")[0], why) for r, w, why in named] == [
        ("3", "was killed by SIGABRT", ""),
        ("2", "was killed by SIGABRT", ""),
        ("1", "was killed by SIGABRT", ""),
        ("5", "was ended by NCCL", "a collective timed out (dist.timeout_s)"),
        ("4", "was ended by NCCL", "a peer went away"),
    ], line
    # Local rank 0 aborting with no line of its own in this launch: the earlier launch's wait does not count, nor
    # its rank (a worker that died before the ranks met is named by its place).
    (logs / "stderr_node1.log").write_text(EARLIER + "[rank1]:[F1127 10:00:01.1 some.cpp:1] Check failed: a C++ assertion\n")
    one = {0: failures[0]}
    assert "training failed: local rank 0 of node 1 was killed by SIGABRT" in str(_failure(plan, one, since))
    assert "training failed: rank 1 was ended by NCCL" in str(_failure(plan, one))  # what the offset keeps out


def test_workers_ended_by_sigterm_alone_are_no_screen_and_an_earlier_launchs_error_is_not_this_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers a SIGTERM ended before their stop handler was up (all -15) were called a failed pre-flight screen
    (78) though no screen ran; a rank killed before it logged anything was said to have failed with the newest
    ERROR line of its log, one an earlier launch wrote there. The elastic agent's verdict, as it reaches us."""
    from types import SimpleNamespace

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from aura_hpc.launch import agent

    logs = tmp_path / "logs"
    logs.mkdir()
    plan = SimpleNamespace(
        cfg=SimpleNamespace(run_dir=tmp_path), worker_cmd=["python"], node_rank=0, nnodes=1, nproc=2, max_restarts=0,
        master_addr="127.0.0.1", master_port=0, master="127.0.0.1:0",
    )  # fmt: skip
    start = "[rank0] 2026-11-29 22:00:00 INFO start rank=0 local_rank=0 world_size=2 node_rank=0 host=vm backend=gloo\n"
    (logs / "rank_0.log").write_text(f"{start}[rank0] 2026-11-29 22:00:05 ERROR no space left on /tmp during step 5 (fix: free)\n")
    codes: dict[int, int] = {}

    def elastic_launch(config: object, entrypoint: object) -> object:
        def run(*args: object) -> None:
            (logs / "rank_0.log").open("a").write(start)  # this launch's workers start, then die
            raise ChildFailedError("aura_hpc.train", {r: ProcessFailure(r, 1000 + r, c, "") for r, c in codes.items()})

        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch)
    codes.update({0: -signal.SIGTERM, 1: -signal.SIGTERM})
    with pytest.raises(errors.TrainingFailed) as failed:
        agent._launch_once(plan, None)  # type: ignore[arg-type]
    assert failed.value.exit_code == errors.EXIT_TRAIN_FAILED and "screening" not in str(failed.value), str(failed.value)
    codes.update({0: -signal.SIGKILL})
    with pytest.raises(errors.TrainingFailed) as failed:
        agent._launch_once(plan, None)  # type: ignore[arg-type]
    said = str(failed.value)
    assert "no space left" not in said and "rank 0 was killed by SIGKILL" in said, said


def test_a_stop_signal_between_attempts_is_a_stop_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the workers failed, the launcher waits (a hang's evidence settling, node 0's new store for the
    restart); torch's signal handler, installed by the first launch, raises there on Ctrl+C or SIGTERM, outside
    the launch that turned it into a stop: the user saw a traceback and exit 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from aura_hpc.launch import agent
    from aura_hpc.launch.hang_watch import HangWatch
    from aura_hpc.launch.local import plan_local

    class Settling:
        def __init__(self) -> None:
            self.hangs: list[object] = []
            self.board, self.started, self.stops = None, 0.0, None

        def start(self) -> None: ...

        def settle(self, seconds: float) -> None:
            raise SignalException("Process got signal: 15", signal.SIGTERM)

        def stop(self) -> None: ...

        def close(self) -> None: ...

    def fails(*args: object) -> int:
        raise errors.TrainingFailed("training failed: rank 1 was killed by SIGKILL", errors.EXIT_TRAIN_FAILED)

    plan = plan_local(None, [], str(tmp_path), "stop")
    plan.cfg.run_dir.mkdir(parents=True)
    monkeypatch.setattr(HangWatch, "for_run", classmethod(lambda cls, *a: Settling()))
    monkeypatch.setattr(agent, "_launch_once", fails)
    assert agent.run_workers(plan) == errors.EXIT_RESUMABLE


def test_a_launcher_whose_workers_are_still_stopping_keeps_the_run_locked(
    tmp_path: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl+C cuts the agent's wait for its stopping workers short (no SIGKILL follows): the launcher
    released the run lock while they still ran, and a re-run started a second trainer beside them."""
    import subprocess
    import sys

    from aura_hpc.launch import local
    from aura_hpc.launch.run_lock import LOCK_NAME, RunLock

    plan = local.plan_local(None, [f"data.path={prepared}"], str(tmp_path), "stopping")
    worker: list[subprocess.Popen[bytes]] = []

    def stopped_by_a_second_ctrl_c(p: object) -> int:  # a worker of the run, still on its way out
        worker.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "aura_hpc.train", str(plan.config_path)]))
        time.sleep(0.5)
        return 130

    monkeypatch.setattr(local, "run_workers", stopped_by_a_second_ctrl_c)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the launcher exports for its workers stays here
    try:
        assert local.launch(plan) == 130 and (plan.cfg.run_dir / LOCK_NAME).exists()
        with pytest.raises(errors.LaunchError, match=r"is gone but its workers still run \(PIDs \d+\)"):
            RunLock(plan.cfg.run_dir).acquire()
    finally:
        for w in worker:
            w.kill()
            w.wait()
    RunLock(plan.cfg.run_dir).acquire().release()  # once they are gone, the next launch takes it


def test_a_live_lock_on_a_filesystem_whose_clock_runs_behind_this_machines_is_not_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NFS the server stamps the heartbeat's mtime: a login node whose clock ran 90 s ahead of it took a live
    trainer's lock (on another node) for a stale one, and `submit` wrote over its run directory."""
    import json

    from aura_hpc.launch import run_lock
    from aura_hpc.launch.run_status import local_status

    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"host": "gpu07", "pid": 4242, "token": "t", "boot_id": "b"}))
    real = time.time()
    monkeypatch.setattr(run_lock.time, "time", lambda: real + 200.0)  # this machine's clock, 200 s ahead of the files' one
    with pytest.raises(errors.LaunchError, match="gpu07"):
        run_lock.check_free(tmp_path)
    with pytest.raises(errors.LaunchError, match="gpu07"):
        run_lock.RunLock(tmp_path).acquire()
    # `status` and `logs -f` judge it by the same clock: they read the live run as STOPPED, and the follow ended at once.
    assert local_status(tmp_path, {})["state"] == "RUNNING"
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_lock.LOCK_NAME]  # no probe left behind
    old = real - 200.0  # a heartbeat that stopped 200 s ago by the files' clock: stale whatever this one says
    os.utime(tmp_path / run_lock.LOCK_NAME, (old, old))
    run_lock.check_free(tmp_path)


def test_a_lock_whose_pid_another_process_took_since_reads_as_no_run(tmp_path: Path) -> None:
    """A launcher killed outright (SIGKILL, the OOM killer) leaves its lock; once its PID is another process's, `status`
    read the run as RUNNING for ever, `logs -f` never ended and `cancel` said to kill that stranger's PID."""
    import json
    import socket
    import subprocess
    import sys

    from aura_hpc.launch import run_lock
    from aura_hpc.launch.run_status import local_status

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held = {"host": socket.gethostname(), "pid": stranger.pid, "token": "t", "boot_id": run_lock._boot_id()}
        here = run_lock._pid_namespace()
        # A start time /proc does not show (hidepid), or a PID of another namespace (a container's launcher): alive, as before.
        cases = [("1", here, "STOPPED"), (run_lock._started(stranger.pid), here, "RUNNING"), ("1", "pid:[1]", "RUNNING")]
        for started, namespace, state in cases:
            (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({**held, "pid_started": started, "pid_ns": namespace}))
            assert local_status(tmp_path, {})["state"] == state, (started, namespace)
    finally:
        stranger.kill()
        stranger.wait()


def test_an_exit_handler_that_never_returns_holds_the_exit_a_bounded_time_and_logs_are_still_flushed(tmp_path: Path) -> None:
    """W&B's exit hook waits for its service process with no limit: online with no server answering, every
    worker's exit was held 60-90 s past tracking.finish_wait_s. The handlers run on a thread joined for
    EXIT_HANDLERS_S; logging's own (registered first, so run last) still closes the log files."""
    import subprocess
    import sys
    import time

    script = f"""
import atexit, logging, threading, time
import torch  # exit_process takes its fast way out only where torch is loaded
from aura_hpc import errors
errors.EXIT_HANDLERS_S = 2.0
logging.basicConfig(filename={str(tmp_path / "rank.log")!r}, level=logging.INFO)
logging.getLogger("x").info("the last line")
atexit.register(threading.Event().wait)  # a hook that never returns (W&B's service.join with no server)
errors.exit_process(3)
"""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=cli_env())
    took = time.monotonic() - t0
    assert r.returncode == 3 and "exit handlers still running after 2 s" in r.stderr, r.stderr
    assert took < 60, took  # the hook alone would have held it for ever (the test's timeout)
    assert "the last line" in (tmp_path / "rank.log").read_text()


def test_a_lan_node_without_the_checkpoints_tells_a_checkpointed_stop_from_one_that_was_not(tmp_path: Path) -> None:
    """Node 0 keeps a LAN run's checkpoints: Ctrl-C on node 1 after every rank's stop was checkpointed said
    "re-run ... from step 0: there is no checkpoint yet" and exited 130, not 75; its failure lines all said
    "starts from step 0". This node's ranks' logs tell it now."""
    import signal
    import time
    from types import SimpleNamespace

    from aura_hpc.launch.agent import _resumable, _resume_hint

    plan = SimpleNamespace(cfg=SimpleNamespace(run_dir=tmp_path), node_rank=1, nproc=1, nnodes=2)
    logs = tmp_path / "logs"
    logs.mkdir()
    start = "[rank1] 2026-11-30 05:00:00 INFO start rank=1 local_rank=0 world_size=2 node_rank=1 host=b backend=gloo"
    (logs / "rank_1.log").write_text(f"{start}\n")
    asked = (signal.SIGINT, time.time())
    assert _resumable(plan, "SIGINT", asked) == 128 + signal.SIGINT  # type: ignore[arg-type]  # nothing says it was saved
    (logs / "rank_1.log").write_text(f"{start}\n[rank1] x INFO {errors.EXITING_LINE}{errors.EXIT_RESUMABLE}\n")
    assert _resumable(plan, "SIGINT", asked) == errors.EXIT_RESUMABLE  # type: ignore[arg-type]
    assert "node 0's newest checkpoint (node 0 keeps them)" in _resume_hint(plan) and "step 0" not in _resume_hint(plan)  # type: ignore[arg-type]


def test_a_checkpoint_stamped_by_a_file_server_whose_clock_runs_behind_is_still_one_written_after_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher compared the checkpoint marker's mtime, stamped by the NFS server's clock, with its own: a server
    2 s behind made a checkpoint written after Ctrl-C read as one before it (exit 130, "before a checkpoint could be
    written"); one ahead, an older checkpoint as the stop's. The files' own clock is asked, as the run lock does."""
    from types import SimpleNamespace

    from aura_hpc.launch import agent, run_lock
    from aura_hpc.train.checkpoint import files as checkpoint
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    behind = 120.0
    asked = (signal.SIGINT, time.time())
    model = GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    ckpt = checkpoint.save(tmp_path / "checkpoints", 3, model, {}, {"step": 3}, None, "", keep_last=2)
    written = asked[1] + 0.5 - behind  # half a second after the stop, by the server's clock
    os.utime(ckpt / checkpoint.MARKER, (written, written))
    monkeypatch.setattr(run_lock, "fs_now", lambda folder, fresh=None: time.time() - behind)
    plan = SimpleNamespace(cfg=SimpleNamespace(run_dir=tmp_path), node_rank=0, nproc=1, nnodes=1)
    assert agent._resumable(plan, "SIGINT", asked) == errors.EXIT_RESUMABLE  # type: ignore[arg-type]
    os.utime(ckpt / checkpoint.MARKER, (written - 30, written - 30))  # 30 s before the stop: not the stop's
    assert agent._resumable(plan, "SIGINT", asked) == 128 + signal.SIGINT  # type: ignore[arg-type]


def test_a_status_no_restart_changes_ends_the_launch_on_every_node_and_a_strangers_word_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's agent restarted workers after any failure while --max-restarts lasted: the breaker's GPU trained on, a
    diverged run diverged again. Between two attempts the rendezvous handler (ours) asks this launch's logs: a status
    in NOT_RESTARTED ends the launch, and the node tells the others through node 0's store (signed), whose handlers
    find the rendezvous closed. Here node 1's worker logged 76; an earlier launch's 3 is not this one's."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from aura_hpc.comm import stores
    from aura_hpc.launch import agent, final_status

    monkeypatch.setenv(stores.SECRET_ENV, "a-run-secret-of-24-chars")
    store = stores.bound_server("127.0.0.1", 0, timedelta(seconds=10), multi_tenant=True)
    store.set(stores.ROUND_KEY, "1764500000.0-42")
    (tmp_path / "logs").mkdir()

    def plan(node: int) -> SimpleNamespace:
        return SimpleNamespace(
            cfg=SimpleNamespace(run_dir=tmp_path), worker_cmd=["python"], node_rank=node, nnodes=2, nproc=1, max_restarts=3,
            master_addr="127.0.0.1", master_port=store.port, master=f"127.0.0.1:{store.port}",
        )  # fmt: skip

    def start(rank: int) -> str:
        return f"[rank{rank}] 2026-11-30 12:00:00 INFO start rank={rank} local_rank=0 world_size=2 node_rank={rank} host=vm backend=gloo\n"

    log1 = tmp_path / "logs" / "rank_1.log"
    log1.write_text(f"{start(1)}[rank1] 2026-11-29 10:00:00 INFO {errors.FINAL_LINE}3\n")  # the launch before
    attempts: list[str] = []

    class Handler:  # torch's handler as far as the agent's restarts go: rendezvous, then again after a failure
        def __init__(self, closed_by_a_peer: bool) -> None:
            self.closed_by_a_peer, self.calls = closed_by_a_peer, 0

        def next_rendezvous(self) -> str:
            self.calls += 1
            if self.closed_by_a_peer and self.calls > 1:  # the nodes met, then one ended the run and closed it
                raise RendezvousClosedError("closed")
            attempts.append("rendezvous")
            return "info"

    def elastic_launch(handler: Handler) -> object:
        def launch(config: object, entrypoint: object) -> object:
            def run(*args: object) -> None:
                for hook in stores.HANDLER_HOOKS:  # as comm/stores.py's rendezvous backend does with each handler
                    hook(handler, store)
                handler.next_rendezvous()
                if not handler.closed_by_a_peer:  # this node's worker: the GPU circuit breaker, then the agent restarts
                    log1.open("a").write(f"{start(1)}[rank1] 2026-11-30 12:00:09 ERROR GPU 0 faulty\n{errors.FINAL_LINE}76\n")
                handler.next_rendezvous()
                attempts.append("restarted")

            return run

        return launch

    monkeypatch.setattr(agent, "_resume_hint", lambda plan: "to resume, re-run")
    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch(Handler(closed_by_a_peer=False)))
    assert agent._launch_once(plan(1), None) == errors.EXIT_GPU_FAULT  # type: ignore[arg-type]
    assert attempts == ["rendezvous"], "not restarted"
    assert not stores.HANDLER_HOOKS, "the launch's hook is gone with it"

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch(Handler(closed_by_a_peer=True)))
    attempts.clear()
    with pytest.raises(errors.TrainingFailed) as told:
        agent._launch_once(plan(0), None)  # type: ignore[arg-type]
    said = str(told.value)
    assert told.value.exit_code == errors.EXIT_TRAIN_FAILED and said.startswith("node 1 ended the run with status 76"), said
    assert "GPU circuit breaker" in said and "were not restarted" in said and store.check([f"{final_status.KEY}/read/0"])

    # A stranger who reaches the store writes the key: unsigned, or a word of an earlier store replayed (its stamp
    # written back too), it is not believed.
    earlier = final_status.Guard(plan(1), {})
    earlier.round = "1764400000.0-7"
    replayed = {"code": 76, "node": 1, "mac": earlier._mac(earlier.round, 76, 1)}
    for forged in ({"code": 76, "node": 1, "mac": "0" * 64}, {"code": 76, "node": 1, "mac": ""}, {"code": "76", "node": 1}, replayed):
        guard = final_status.Guard(plan(0), {})
        guard.wrap(handler := Handler(closed_by_a_peer=True), store)
        handler.next_rendezvous()  # met: the stamp of this store is read now
        store.set(final_status.KEY, json.dumps(forged))
        store.set(stores.ROUND_KEY, earlier.round)
        with pytest.raises(RendezvousClosedError):
            handler.next_rendezvous()
        store.set(stores.ROUND_KEY, "1764500000.0-42")


def test_the_launchers_wait_for_a_stops_checkpoint_is_what_the_hang_watch_gives_two(tmp_path: Path) -> None:
    """The agent waited a fixed 120 s for the workers after a stop signal, then killed them: a large model's checkpoint
    written to NFS over 1 GbE (16 GB, two minutes) was cut mid-write, after an asynchronous one still being written."""
    from aura_hpc.launch.agent import agent_options
    from aura_hpc.launch.hang_watch import CALIBRATION
    from aura_hpc.launch.local import plan_local

    fresh = plan_local(None, [], str(tmp_path), "fresh")
    assert fresh.shutdown_timeout >= 2 * fresh.cfg.health.hang_section_floor_s  # a checkpoint's floor, twice
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / CALIBRATION).write_text(json.dumps({"checkpoint": 140.0, "step": 4.0}))  # measured by an earlier attempt
    big = plan_local(None, [], str(tmp_path), "big")
    assert big.shutdown_timeout >= 2 * 5 * 140 + 2 * 4
    options, _ = agent_options(big.shutdown_timeout)
    assert options.get("shutdown_timeout", big.shutdown_timeout) == big.shutdown_timeout
    # No hang watch: nothing but this wait would end a hang during the stop.
    assert plan_local(None, ["health.hang_watch=false"], str(tmp_path), "big").shutdown_timeout == 120
