"""Fault injection with real processes and gloo: every fault ends in a finished run, nothing lost."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest
import torch

from aura_hpc import errors
from aura_hpc.errors import EXIT_RESUMABLE
from aura_hpc.train.checkpoint import files as checkpoint
from tests.conftest import (
    SMALL_MODEL,
    cli_env,
    final_weights,
    free_port,
    make_two_hosts,
    remove_hosts,
    run_cli,
    run_cli_together,
    tensorboard_steps,
)

pytestmark = pytest.mark.slow

STEPS = 20
LONG = 60  # the stop-signal runs: stopped once past step 20, resumed to the end
# Those runs idle 3/4 of each step on rank 0 (a slower machine; the weights are the same), so that the
# signal lands mid-run however fast this machine trains.
SLOWER = {"AURA_FAULT_SLOW": "0:0.75"}
BASE = [
    *SMALL_MODEL,
    "--set",
    "train.warmup_steps=3",
    "--set",
    "train.checkpoint_every=5",
    "--set",
    "model.dropout=0.1",
    "--set",
    "train.keep_last=5",
]


def _args(out: Path, name: str, prepared: Path, steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "local",
        "--nproc-per-node",
        "2",
        "--output-dir",
        str(out),
        "--run-name",
        name,
        "--set",
        f"data.path={prepared}",
        *BASE,
        "--set",
        f"train.max_steps={steps}",
        *extra,
    ]


def _diagnose(res: subprocess.CompletedProcess[str], run_dir: Path) -> str:
    """What a failed run printed, and the tail of every rank's log (CI keeps nothing else)."""
    logs = "".join(
        f"\n== {p.name}\n" + "".join(p.read_text().splitlines(keepends=True)[-25:]) for p in sorted((run_dir / "logs").glob("*.log"))
    )
    return f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}{logs}"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> Path:
    """Uninterrupted runs of STEPS and LONG steps (folders ref20 and ref60), never changed by a test."""
    out = tmp_path_factory.mktemp("reference")
    done = run_cli_together([_args(out, f"ref{steps}", prepared, steps) for steps in (STEPS, LONG)])
    for r in done:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def reference(reference_runs: Path) -> dict[int, dict[str, torch.Tensor]]:
    """The weights every faulted run must end with, bit for bit."""
    return {steps: final_weights(reference_runs / f"ref{steps}") for steps in (STEPS, LONG)}


# The runs whose rank 1 stops (SIGSTOP) after step 12 spend most of their time idle, in a hang window: one
# after another on one xdist worker they left a core idle for some 70 s (a per-test profile, 2026-11-28).
# They start together, when the first of their tests asks, and each test reads its own.
class Interrupted(NamedTuple):
    returncode: int
    took: float  # from Ctrl+C to the launcher's exit
    stdout: str
    stderr: str
    left: list[psutil.Process]  # processes of the run still alive after the launcher's exit


def _watched(out: Path, prepared: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return out, run_cli(_args(out, "run", prepared), AURA_FAULT_STOP="1:12")


def _interrupted(out: Path, prepared: Path) -> Interrupted:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", *_args(out, "run", prepared)],
        env=cli_env(AURA_FAULT_STOP="1:12"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    stopped = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "SIGSTOP rank 1" in line:
                stopped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stopped.wait(180), "".join(lines)[-2000:]
        time.sleep(2)
        sent_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=150)
        took = time.monotonic() - sent_at
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if str(out) in " ".join(p.cmdline()):
                left.append(p)
    return Interrupted(proc.returncode, took, "".join(lines), proc.stderr.read() if proc.stderr else "", left)


def _stopped_on_another_node(out: Path, prepared: Path) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    hosts = make_two_hosts()
    master, prefixes = (
        ("127.0.0.1", None) if isinstance(hosts, str) else ("10.77.1.1", [["nsenter", f"--net=/run/netns/{h}"] for h in hosts])
    )
    print("the two nodes:", hosts if prefixes else f"127.0.0.1 ({hosts})")
    args = ["local", "--nnodes", "2", "--master-addr", master, "--master-port", str(free_port()), "--nproc-per-node", "1"]
    args += ["--set", f"data.path={prepared}", *BASE, "--set", f"train.max_steps={STEPS}", "--run-name", "lan"]
    args += ["--set", "health.hang_step_floor_s=10"]  # the defaults' 30 s is the single-node test's; the mechanism is the same
    runs = [[*args, "--node-rank", str(n), "--output-dir", str(out / f"m{n}")] for n in (0, 1)]
    try:
        node0, node1 = run_cli_together(runs, timeout=600, prefixes=prefixes, AURA_FAULT_STOP="1:12")
    finally:
        if prefixes:
            remove_hosts(tuple(hosts))
    return out, [node0, node1]


_STOPPED = {
    "watchdog": (_watched, "test_a_stopped_rank_is_named_within_a_minute_and_the_run_restarts_bit_identical"),
    "ctrl_c": (_interrupted, "test_ctrl_c_during_a_hang_answers_in_seconds_names_the_rank_and_does_not_claim_a_checkpoint"),
    "other_node": (_stopped_on_another_node, "test_a_rank_stopped_on_another_node_is_named_on_both_and_both_nodes_restart_bit_identical"),
}


@pytest.fixture(scope="module")
def stopped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> Iterator[dict[str, Future]]:
    """Those of the runs above whose tests were collected, started at once; each test waits for its own."""
    collected = {item.originalname for item in request.session.items}
    with ThreadPoolExecutor(len(_STOPPED)) as pool:
        yield {
            name: pool.submit(run, tmp_path_factory.mktemp(name), prepared) for name, (run, test) in _STOPPED.items() if test in collected
        }


@pytest.mark.parametrize("seed", [1])  # rank 0 after step 19; test_beyond_max_restarts kills rank 1 at step 12
def test_sigkill_of_a_rank_restarts_and_ends_bit_identical(tmp_path: Path, prepared: Path, reference: dict, seed: int) -> None:
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(1, STEPS)
    # AURA_FAULT_NCCL_SIGNAL: the first attempt leaves in the workers' store what NCCL's watchdog leaves there on a
    # failed collective; left for the restart, NCCL's monitor would abort every healthy rank of it (comm/stores.py).
    env = {"AURA_FAULT_KILL": f"{rank}:{step}", "AURA_FAULT_NCCL_SIGNAL": "1"}
    r = run_cli([*_args(tmp_path, "run", prepared), "--max-restarts", "1"], **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "restart=1" in r.stdout, "the elastic agent did not restart the workers"
    assert r.stdout.count("cleared exception_dump: NCCL's signal of a failed collective of the attempt before") == 1, r.stdout[-3000:]
    last_ckpt = (step // 5) * 5
    if last_ckpt:
        # That save is written in the background: a kill before its commit (a loaded machine, CI's floor run once)
        # resumes from the one before, and its partial folder is removed; either way the end is bit-identical.
        resumed = re.search(r"resumed from checkpoint step_(\d+) at step (\d+)", r.stdout)
        assert resumed and resumed.group(1) == f"{int(resumed.group(2)):08d}", r.stdout[-3000:]
        at = int(resumed.group(2))
        removed = f"removing partial checkpoint .tmp-step_{last_ckpt:08d}" in r.stdout
        assert at == last_ckpt or (at == last_ckpt - 5 and removed), r.stdout[-3000:]
    assert _same(final_weights(tmp_path / "run"), reference[STEPS])


def test_beyond_max_restarts_says_how_to_resume_and_rerun_resumes(tmp_path: Path, prepared: Path, reference: dict) -> None:
    r = run_cli(_args(tmp_path, "run", prepared), AURA_FAULT_KILL="1:12")
    assert r.returncode == errors.EXIT_TRAIN_FAILED == 1, _diagnose(r, tmp_path / "run")
    err = r.stderr.strip().splitlines()[-1]
    assert "training failed: rank 1 was killed by SIGKILL" in err  # the cause first, even if rank 0 failed too
    assert "to resume from step_00000010" in err and "re-run the same command" in err
    again = run_cli(_args(tmp_path, "run", prepared))
    assert again.returncode == 0, again.stdout[-2000:]
    assert "resumed from checkpoint step_00000010 at step 10" in again.stdout
    assert _same(final_weights(tmp_path / "run"), reference[STEPS])


def test_a_killed_rank_of_a_node_torchrun_counted_first_is_named_by_its_own_rank(tmp_path: Path, prepared: Path) -> None:
    """torchrun numbers LAN nodes by address, then by the launcher's pid: node 1's launcher, started first on one
    host, gets torchrun's rank 0 for its worker, which is our rank 1 (rank_1.log). Killed, it is named rank 1."""
    args = ["local", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--nproc-per-node", "1"]
    args += ["--set", f"data.path={prepared}", *BASE, "--set", "train.max_steps=6", "--run-name", "lan"]
    runs = [[*args, "--node-rank", str(n), "--output-dir", str(tmp_path / f"m{n}")] for n in (1, 0)]  # node 1 first
    node1, node0 = run_cli_together(runs, timeout=300, AURA_FAULT_KILL="1:3")
    assert node1.returncode == errors.EXIT_TRAIN_FAILED and node0.returncode != 0, _diagnose(node1, tmp_path / "m1" / "lan")
    line = node1.stderr.strip().splitlines()[-1]
    assert "training failed: rank 1 was killed by SIGKILL" in line and "rank 0" not in line, line
    assert (tmp_path / "m1" / "lan" / "logs" / "rank_1.log").is_file() and not (tmp_path / "m1" / "lan" / "logs" / "rank_0.log").exists()
    # `logs --stderr` of a local run is its node's stderr log (it printed the rank log whatever it was asked).
    err = run_cli(["logs", str(tmp_path / "m1" / "lan"), "--rank", "1", "--stderr"], timeout=60)
    assert err.returncode == 0 and "aura_hpc worker joined: local rank 0" in err.stdout and "start rank=" not in err.stdout, err.stdout
    elsewhere = run_cli(["logs", str(tmp_path / "m1" / "lan"), "--rank", "0", "--stderr"], timeout=60)
    assert elsewhere.returncode == 2 and "read it on the machine that ran it" in elsewhere.stderr, elsewhere.stderr


def test_a_rank_hung_inside_a_checkpoint_or_a_diloco_meeting_is_named_there_and_the_run_restarts(
    tmp_path: Path, prepared: Path, reference: dict
) -> None:
    """Rank 1 stops as it enters the step-10 checkpoint (its peer waits inside the save's collectives), or
    as it enters a DiLoCo meeting: each is declared hung in that section (its floor lowered to 20 s from
    300), named, and restarted; the checkpoint run ends with the uninterrupted bits, the DiLoCo one with
    those of an uninterrupted DiLoCo run."""
    floor = ("--set", "health.hang_section_floor_s=20")
    diloco = (*floor, "--set", "dist.strategy=diloco", "--set", "dist.diloco_replicas=2", "--set", "dist.sync_every=5")
    runs = [_args(tmp_path, "ckpt", prepared, extra=floor), _args(tmp_path, "meet", prepared, extra=diloco)]
    runs.append(_args(tmp_path, "meetref", prepared, extra=diloco))
    env = {"ckpt": "1:10:checkpoint", "meet": "1:10:meeting"}
    procs = {}
    for args in runs:
        name = args[args.index("--run-name") + 1]
        extra = {"AURA_FAULT_STOP": env[name]} if name in env else {}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "aura_hpc", *args], env=cli_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    done = {name: p.communicate(timeout=600) for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, _diagnose(subprocess.CompletedProcess([], p.returncode, *done[name]), tmp_path / name)
    for name, section in (("ckpt", "checkpoint"), ("meet", "meeting")):
        out, err = done[name]
        line = next(x for x in err.splitlines() if "hang: " in x)
        assert "hang: rank 1 on " in line and "did not answer" in line and re.search(rf"\({section} after step 1\d,", line), line
        assert "restarting the workers from the newest checkpoint after the hang" in out
    assert "resumed from checkpoint step_00000005 at step 5" in done["ckpt"][0]  # the step-10 save never completed
    assert _same(final_weights(tmp_path / "ckpt"), reference[STEPS])
    assert _same(final_weights(tmp_path / "meet"), final_weights(tmp_path / "meetref"))


def test_ctrl_c_during_a_hang_answers_in_seconds_names_the_rank_and_does_not_claim_a_checkpoint(stopped: dict[str, Future]) -> None:
    """Rank 1 stops after step 12; Ctrl+C a few seconds later cannot be honoured with a checkpoint (rank 1
    never reaches one). The launcher names the hung rank well before the agent's 120 s shutdown wait, says
    which checkpoint a re-run resumes from, and exits 130, not 75 ("a checkpoint was written")."""
    r: Interrupted = stopped["ctrl_c"].result()
    out, err = r.stdout, r.stderr
    assert r.returncode == 128 + signal.SIGINT, out[-2000:] + err[-2000:]
    assert r.took < 60, r.took
    assert "hang: rank 1 on " in err and "did not answer" in err, err[-2000:]
    said = err.strip().splitlines()[-1]
    assert "stopped by SIGINT before a checkpoint could be written" in said and "from step_00000010, the newest" in said, said
    assert not r.left, f"workers were left: {r.left}"


def test_a_rank_stopped_on_another_node_is_named_on_both_and_both_nodes_restart_bit_identical(
    stopped: dict[str, Future], reference: dict
) -> None:
    """Two LAN nodes of one process each, each in a network namespace of its own (two machines on one link;
    on 127.0.0.1 where namespaces cannot be made): the rank of node 1 stops after step 12. Node 1's watchdog
    names it; node 0, whose rank only waits, names the same rank through the board in node 0's store (not
    "another node", not its own rank); both launchers restart the run from step 10 and it ends as if nothing
    had hung."""
    tmp_path, (node0, node1) = stopped["other_node"].result()
    run0 = tmp_path / "m0" / "lan"
    assert node0.returncode == 0 and node1.returncode == 0, _diagnose(node0, run0) + _diagnose(node1, tmp_path / "m1" / "lan")
    stopped_at = float(re.search(r"SIGSTOP rank 1 after step 12 at ([\d.]+)", node1.stdout).group(1))
    for node, out in ((0, node0), (1, node1)):
        line = next(x for x in out.stderr.splitlines() if "hang: " in x)
        assert "hang: rank 1 on " in line and "did not answer" in line and "training after step 12" in line, (node, line)
        assert "restarting the workers on every node" in out.stdout, out.stdout[-2000:]
    assert "named by node 1" in next(x for x in node0.stderr.splitlines() if "hang: " in x)
    # Node 0's rank only waited: its stack was taken before node 1's kill broke its connection.
    [waited] = [f.read_text() for f in (run0 / "hangs").glob("*/rank0.txt")]
    assert "most recent call first" in waited and "aura_hpc/train/worker.py" in waited, waited
    record = json.loads((tmp_path / "m1" / "lan" / "hangs" / "last.json").read_text())
    assert record["culprits"] == [1] and record["declared_at"] - stopped_at <= 40
    assert "resumed from checkpoint step_00000010 at step 10" in node0.stdout, node0.stdout[-3000:]
    assert _same(final_weights(run0), reference[STEPS])


def _workers(launcher: subprocess.Popen[str]) -> dict[int, psutil.Process]:
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "aura_hpc.train" in " ".join(child.cmdline()):
                found[int(child.environ().get("LOCAL_RANK", "-1"))] = child
        except psutil.Error:
            continue
    return found


def _wait_for_step(run: Path, step: int, timeout: float = 120) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if rows and rows[-1]["step"] >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"training never reached step {step}")


# SIGTERM to the launcher takes the same path as SIGINT (the agent's handler turns both into a stop).
@pytest.mark.parametrize(("sig", "target"), [("SIGINT", "launcher"), ("SIGUSR2", "rank1")])
def test_stop_signal_checkpoints_once_and_exits_resumable(tmp_path: Path, prepared: Path, reference: dict, sig: str, target: str) -> None:
    # straggler_action=exclude on one machine: nothing to leave out, and the line says so.
    args = [*_args(tmp_path, "run", prepared, LONG), "--set", "health.straggler_action=exclude"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", *args], env=cli_env(**SLOWER), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_step(tmp_path / "run", 20)
        victim = proc.pid if target == "launcher" else _workers(proc)[1].pid
        sent_at = time.monotonic()
        os.kill(victim, getattr(signal, sig))
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - sent_at < 60
    assert proc.returncode == EXIT_RESUMABLE, out[-3000:]
    stops = [line for line in out.splitlines() if "stop requested" in line]
    assert len(stops) == 1 and "resumable" in stops[0], out[-3000:]  # one checkpoint, written by rank 0
    step = int(stops[0].split(" at step ")[1].split(":")[0])
    assert 20 <= step < LONG
    assert checkpoint.list_complete(tmp_path / "run" / "checkpoints")[0].step == step
    assert "re-run the same command to resume" in out
    # Rank 0 idled 3/4 of every step: named as the straggler at the third logging interval, and the
    # slowest in every row (loop/stragglers.py).
    log0 = (tmp_path / "run" / "logs" / "rank_0.log").read_text()
    named = [x for x in log0.splitlines() if "straggler: rank 0 on " in x]
    assert len(named) == 1 and "at step 15" in named[0], named
    assert "straggler: rank 0 shares " in log0 and "there is no machine to leave out" in log0, log0[-3000:]
    slowed = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert slowed and all(r["slowest_rank"] == 0 and r["slowest_score"] < 0.75 for r in slowed), slowed
    again = run_cli(args)
    assert again.returncode == 0, _diagnose(again, tmp_path / "run")
    assert f"resumed from checkpoint step_{step:08d} at step {step}" in again.stdout
    assert _same(final_weights(tmp_path / "run"), reference[LONG])
    # One row per logged step (none twice across the two attempts), and each rank's log holds both.
    rows = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == sorted(set(rows)) and rows[-1] == LONG
    assert (tmp_path / "run" / "logs" / "rank_0.log").read_text().count("start rank=0") == 2


def test_a_closed_terminal_stops_the_run_with_a_checkpoint(tmp_path: Path, prepared: Path) -> None:
    """`local` started in an ssh session that closes: the kernel hangs up its terminal (SIGHUP to the launcher, which
    forwards it) and every write to it fails (EIO). Rank 0's progress bar and log lines went there: it died on its way
    to the stop's checkpoint, and the launcher's last lines turned its 75 into a 1."""
    import pty
    import select

    run = tmp_path / "run"
    pid, terminal = pty.fork()  # the launcher leads a session whose terminal this is, as a login shell's child does
    if pid == 0:
        try:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a login shell's child has it (this suite may run under nohup)
            os.execve(sys.executable, [sys.executable, "-m", "aura_hpc", *_args(tmp_path, "run", prepared, LONG)], cli_env(**SLOWER))
        finally:
            os._exit(127)
    shown, done = b"", (0, 0)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _reached(run, 10):
            if select.select([terminal], [], [], 0.05)[0]:  # read, as ssh does: a full terminal would stall the writers
                with contextlib.suppress(OSError):
                    shown += os.read(terminal, 65536)
        assert _reached(run, 10), shown.decode(errors="replace")[-3000:]
        assert b"training" in shown  # rank 0's progress bar was on this terminal
        os.close(terminal)  # the session closed
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        with contextlib.suppress(OSError):
            os.close(terminal)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    log0 = (run / "logs" / "rank_0.log").read_text()
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == EXIT_RESUMABLE, log0[-3000:]
    [stop] = [line for line in log0.splitlines() if "stop requested (SIGHUP)" in line]
    step = int(stop.split(" at step ")[1].split(":")[0])
    assert checkpoint.list_complete(run / "checkpoints")[0].step == step and 10 <= step < LONG, stop
    assert "Traceback" not in log0, log0[-3000:]


def _reached(run: Path, step: int) -> bool:
    rows = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    return bool(rows) and json.loads(rows[-1])["step"] >= step


# Killed just before the commit marker: the most written and still not a checkpoint. Random instants of
# the writer alone: test_sigkill_at_random_moments_of_a_save_never_breaks_the_previous.
def test_writer_killed_mid_checkpoint_resumes_from_the_previous(tmp_path: Path, prepared: Path, reference: dict) -> None:
    r = run_cli([*_args(tmp_path, "run", prepared), "--max-restarts", "1"], AURA_FAULT_CKPT="kill:marker")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The first save (step 5) died half-written; the restart started over, ignoring it.
    assert "no checkpoint in" in r.stdout[r.stdout.index("restart=1") :]
    assert "removing partial checkpoint .tmp-step_00000005" in r.stdout
    ckpts = tmp_path / "run" / "checkpoints"
    assert not list(ckpts.glob(".tmp-*"))
    assert _same(final_weights(tmp_path / "run"), reference[STEPS])


def test_the_other_ranks_wait_for_rank_0s_final_checkpoint_past_the_collective_timeout(tmp_path: Path, prepared: Path) -> None:
    """The ranks learn the save's outcome once rank 0 has written it. They waited on the world's group (NCCL on GPUs,
    dist.timeout_s): a big model's final checkpoint written to a shared disk for longer than that timed them out, and
    the run ended without it. Here rank 0's writer is held 10 s past a 6 s collective timeout."""
    extra = ("--set", "dist.timeout_s=6", "--set", "train.checkpoint_every=1000")
    r = run_cli(_args(tmp_path, "run", prepared, steps=4, extra=extra), AURA_FAULT_CKPT="slow:marker:10", timeout=240)
    assert r.returncode == 0, _diagnose(r, tmp_path / "run")
    assert "checkpoint writer held 10 s after marker" in r.stdout
    assert [c.step for c in checkpoint.list_complete(tmp_path / "run" / "checkpoints")] == [4]


def test_nan_on_one_rank_skips_the_step_without_hanging(tmp_path: Path, prepared: Path) -> None:
    r = run_cli(_args(tmp_path, "run", prepared, extra=("--set", "train.eval_every=5")), AURA_FAULT_NAN="1:10:1", timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "non-finite loss or gradient on rank(s) [1] at step 10: update skipped (1 in a row)" in r.stdout
    w = final_weights(tmp_path / "run")
    assert all(torch.isfinite(t).all() for t in w.values())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows if "loss" in row)
    # The skipped step keeps its checkpoint and its evaluation: one bad step does not double the work lost.
    assert [c.step for c in checkpoint.list_complete(tmp_path / "run" / "checkpoints")] == [20, 15, 10, 5]
    assert [row.get("update_skipped") for row in rows if row["step"] == 10] == [True]
    assert sorted(row["step"] for row in rows if "eval_loss" in row) == [5, 10, 15, 20]


def test_nan_burst_rolls_back_to_the_last_good_checkpoint(tmp_path: Path, prepared: Path) -> None:
    # Steps 11-18 go bad once each: 3 in a row roll back to step_10, and after the replay again (the
    # count leaves room for the step that was already running when a rollback was decided).
    extra = ("--set", "train.checkpoint_every=10", "--set", "train.log_every=1")  # rows of the steps redone too
    r = run_cli(_args(tmp_path, "run", prepared, extra=extra), AURA_FAULT_NAN="0:11:8", timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    rollbacks = [line for line in r.stdout.splitlines() if "non-finite steps in a row: rolled back to step_00000010 (step 10)" in line]
    assert len(rollbacks) == 2, r.stdout[-3000:]
    # The second rollback to the same checkpoint compounds the learning-rate cut.
    assert "learning rate x0.5 of" in rollbacks[0] and "learning rate x0.25 of" in rollbacks[1]
    # Each rollback is kept at once, its step written again (a crash before the next save replayed the bad data).
    assert r.stdout.count("step_00000010 written") == 3, r.stdout[-3000:]
    run = tmp_path / "run"
    meta = json.loads((checkpoint.list_complete(run / "checkpoints")[0].path / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["rollbacks"] == 2
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "rows of the steps redone after a rollback are not kept twice"
    shown = tensorboard_steps(run / "tensorboard", "train/loss")
    assert shown == sorted(set(shown)) and shown[-1] == STEPS, f"nor are TensorBoard's points: {shown}"
    assert all(torch.isfinite(t).all() for t in final_weights(run).values())


def test_nan_forever_stops_with_a_clear_error(tmp_path: Path, prepared: Path) -> None:
    """...and a failed run keeps its last rows in TensorBoard and reads as failed in the trackers (before,
    the MLflow run of a failed attempt was never even written). --max-restarts does not restart it: the
    agent restarted a diverged run, which diverged again from its checkpoint (or, the fault spent, trained on)."""
    import importlib.util

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mlflow = importlib.util.find_spec("mlflow") is not None
    extra = ("--set", "train.nan_max_rollbacks=1", "--set", f"tracking.backends=tensorboard{',mlflow' if mlflow else ''}")
    r = run_cli([*_args(tmp_path, "run", prepared, extra=extra), "--max-restarts", "2"], AURA_FAULT_NAN="0:6:100", timeout=180)
    assert r.returncode == errors.EXIT_DIVERGED == 3, _diagnose(r, tmp_path / "run")
    assert (tmp_path / "run" / "logs" / "rank_0.log").read_text().count("start rank=") == 1, "one attempt: not restarted"
    assert "the loss stayed non-finite after 1 rollbacks" in r.stdout and "fix: lower train.lr" in r.stdout
    # One line naming what happened and the fix, taken from the worker that stopped.
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: training stopped: the loss stayed non-finite"), r.stderr
    assert "fix: lower train.lr" in lines[0]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [5], events.Tags()
    if mlflow:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'tracking' / 'mlflow.db'}")
        [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "FAILED", run.info
    for c in checkpoint.list_complete(tmp_path / "run" / "checkpoints"):
        from safetensors.torch import load_file

        assert all(torch.isfinite(t).all() for t in load_file(str(c.path / "model" / "model.safetensors")).values())


@pytest.fixture(scope="module")
def stopped_at_15(tmp_path_factory: pytest.TempPathFactory, reference_runs: Path) -> Path:
    """A run whose newest checkpoint is step 15 (and 5 and 10 before it); each damage test works on a copy. The
    reference run to step 20 without its last checkpoint: the same state as a run stopped at 15, one launch fewer."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    shutil.copytree(reference_runs / f"ref{STEPS}", run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    assert [c.step for c in checkpoint.list_complete(run / "checkpoints")] == [15, 10, 5]
    return run


def test_damaged_newest_checkpoints_fall_back_to_the_one_before_them(
    tmp_path: Path, prepared: Path, reference: dict, stopped_at_15: Path
) -> None:
    """Step 15 without its commit marker (its save interrupted), step 10 truncated: the run resumes from
    step 5 and ends as an uninterrupted one. (A flipped byte, caught by the checksum, is the next test's damage.)"""
    shutil.copytree(stopped_at_15, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step_00000015" / checkpoint.MARKER).unlink()
    with open(checkpoints / "step_00000010" / "model" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    r = run_cli(_args(tmp_path, "run", prepared))
    assert r.returncode == 0, r.stdout[-2000:]
    assert "checkpoint step_00000015 has no COMPLETE.json" in r.stdout, r.stdout[-2000:]
    assert "checkpoint step_00000010 is corrupt (model/model.safetensors has 100 bytes" in r.stdout, r.stdout[-2000:]
    assert "resumed from checkpoint step_00000005 at step 5" in r.stdout
    assert _same(final_weights(tmp_path / "run"), reference[STEPS])


def test_every_checkpoint_damaged_is_refused_not_restarted_from_zero_in_silence(
    tmp_path: Path, prepared: Path, reference: dict, stopped_at_15: Path
) -> None:
    """Every checkpoint damaged (a flipped byte in each): the run used to start from step 0 while its warning
    said it used the previous one. It stops with one line (the damaged ones kept aside); the re-run starts over."""
    shutil.copytree(stopped_at_15, tmp_path / "run")
    for step in (5, 10, 15):
        state = tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "trainer_state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    r = run_cli(_args(tmp_path, "run", prepared))
    assert r.returncode == 2, r.stdout[-2000:]
    said = r.stderr.strip().splitlines()[-1]
    assert "every checkpoint in" in said and "is damaged (3 moved aside as corrupt-step_*)" in said, said
    assert "re-run the same command to start again from step 0" in said and "trying the one before it" in r.stdout
    assert len(list((tmp_path / "run" / "checkpoints").glob("corrupt-step_*"))) == 3
    again = run_cli(_args(tmp_path, "run", prepared))
    assert again.returncode == 0 and "starting from step 0" in again.stdout, again.stdout[-2000:]
    assert _same(final_weights(tmp_path / "run"), reference[STEPS])


def test_checkpoint_cannot_run_code(tmp_path: Path, prepared: Path, stopped_at_15: Path) -> None:
    """A trainer_state.pt that would execute code on unpickling is refused (weights_only=True)."""
    shutil.copytree(stopped_at_15, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000015"
    pwned = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {pwned}",))

    torch.save({"optimizer": Evil()}, ckpt / "trainer_state.pt")
    marker = json.loads((ckpt / checkpoint.MARKER).read_text())
    p = ckpt / "trainer_state.pt"
    marker["files"]["trainer_state.pt"] = {"size": p.stat().st_size, "sha256": checkpoint._sha256(p)}
    (ckpt / checkpoint.MARKER).write_text(json.dumps(marker))
    r = run_cli(_args(tmp_path, "run", prepared))
    assert r.returncode != 0
    assert "step_00000015: checkpoint could not be loaded safely" in r.stdout
    assert not pwned.exists()


def test_a_checkpoint_the_worker_refuses_exits_2(tmp_path: Path, prepared: Path, stopped_at_15: Path) -> None:
    shutil.copytree(stopped_at_15, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000015"
    meta = ckpt / "meta.json"
    meta.write_text(meta.read_text().replace('"model_fingerprint": "', '"model_fingerprint": "x'))
    # Re-seal it, so that it passes verification and reaches the worker's fingerprint check.
    marker = ckpt / checkpoint.MARKER
    m = json.loads(marker.read_text())
    m["files"]["meta.json"] = {"size": meta.stat().st_size, "sha256": checkpoint._sha256(meta)}
    marker.write_text(json.dumps(m))
    r = run_cli(_args(tmp_path, "run", prepared))
    assert r.returncode == errors.EXIT_USER_ERROR, r.stdout[-2000:] + r.stderr[-2000:]
    assert "was written with a different model shape" in r.stderr and "fix:" in r.stderr


def test_sigkill_at_random_moments_of_a_save_never_breaks_the_previous(tmp_path: Path) -> None:
    """The writer alone, killed at random instants: a checkpoint is complete and valid, or ignored."""
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from aura_hpc.train.model.gpt import GPT, GPTConfig\n"
        "from aura_hpc.train.checkpoint import files as checkpoint\n"
        "root = Path(sys.argv[1])\n"
        "model = GPT(GPTConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2))\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "print('ready', flush=True)\n"
        "for step in range(1, 10000):\n"
        "    with torch.no_grad():\n"
        "        for p in model.parameters():\n"
        "            p.add_(0.001)\n"
        "    checkpoint.save(root, step, model, {'optimizer': opt.state_dict()}, {'step': step}, None, 'x: 1\\n', 2)\n"
    )
    rng = random.Random(0)
    root = tmp_path / "ckpts"
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(root)], env=cli_env(), stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        # Libraries may print first (transformers 4.x imports DeepSpeed, which logs its accelerator).
        assert any(proc.stdout.readline().strip() == "ready" for _ in range(20))
        # A kill before the first save completes would prove nothing (and on a busy machine the first
        # save can take longer than any fixed delay): the random instant counts from one being there.
        deadline = time.monotonic() + 240
        while not checkpoint.list_complete(root) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.05, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpts = checkpoint.list_complete(root)
        assert ckpts, "no checkpoint survived"
        newest = checkpoint.newest_valid(root)
        assert newest is not None and newest.step == ckpts[0].step  # the newest complete one is intact
        assert checkpoint.verify(newest.path) is None
        from aura_hpc.train.checkpoint.checkpointer import _decode_payload, _payload_parts

        weights, _state, meta = _decode_payload(_payload_parts(newest.path))
        assert meta["step"] == newest.step and weights


def test_a_crash_between_the_renames_of_a_re_saved_step_keeps_that_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step saved again (after a rollback) swaps folders with two renames; a process that dies
    between them leaves the committed copy only as `.old-step_N-PID`: it comes back, not deleted (by the
    re-run's launcher, which removed it with the partial folders)."""
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    for step in (1, 2):
        checkpoint.save(tmp_path, step, model, {}, {"step": step}, None, "", keep_last=3)
    real_rename = Path.rename

    def dies_before_the_second(self: Path, target: Any) -> Any:
        if self.name.startswith(".tmp-step_"):
            raise KeyboardInterrupt  # the process ends here: nothing after it runs
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", dies_before_the_second)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, model, {}, {"step": 2}, None, "", keep_last=3)
    monkeypatch.undo()
    assert [c.step for c in checkpoint.list_complete(tmp_path)] == [1]
    # The re-run's launcher, first thing (it removed the set-aside copy with the partial folders), here with the
    # dead writer's own PID, as a container's restarted process has (the copy was left hidden, PID "in use").
    from aura_hpc.launch.run_setup import _remove_partial_checkpoints

    _remove_partial_checkpoints(tmp_path)
    newest = checkpoint.newest_valid(tmp_path)
    assert newest is not None and newest.step == 2 and checkpoint.verify(newest.path) is None
    checkpoint.save(tmp_path, 3, model, {}, {"step": 3}, None, "", keep_last=3)  # the next save clears the rest
    assert [c.step for c in checkpoint.list_complete(tmp_path)] == [3, 2, 1] and not list(tmp_path.glob(".*"))


def test_keep_last_plus_best_by_validation_loss(tmp_path: Path) -> None:
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    losses = {1: 3.0, 2: 1.5, 3: 2.5, 4: 2.8, 5: 2.9}
    for step, loss in losses.items():
        checkpoint.save(tmp_path, step, model, {}, {"step": step, "eval_loss": loss}, None, "", keep_last=2)
    assert [c.step for c in checkpoint.list_complete(tmp_path)] == [5, 4, 2]
    best = checkpoint.best(tmp_path)
    assert best is not None and best.step == 2
    # A NaN validation loss (an overflowing evaluation with finite weights) compared less than nothing: the newest
    # checkpoint became "best" and step 2, the real best, was pruned.
    for step in (6, 7):
        checkpoint.save(tmp_path, step, model, {}, {"step": step, "eval_loss": float("nan")}, None, "", keep_last=2)
    assert [c.step for c in checkpoint.list_complete(tmp_path)] == [7, 6, 2]
    assert (best := checkpoint.best(tmp_path)) is not None and best.step == 2


def test_a_run_that_diverges_for_good_says_so_even_when_the_save_in_flight_failed(caplog: pytest.LogCaptureFixture) -> None:
    """The rollback waits for the save in flight before anything else; at the rollback limit, that save's failure
    (a full disk) became the run's verdict: exit 1, restarted, where a divergence is exit 3 and not restarted."""
    from types import SimpleNamespace

    from aura_hpc.errors import CheckpointWriteError, TrainingError
    from aura_hpc.train.checkpoint.checkpointer import Checkpointer

    def wait() -> None:
        raise CheckpointWriteError("no space left on /scratch while writing checkpoint step 400")

    stub = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(nan_max_rollbacks=3)), pos=SimpleNamespace(rollbacks=3, step=420), wait=wait
    )
    with (
        caplog.at_level(logging.ERROR, logger="aura_hpc"),
        pytest.raises(TrainingError, match="the loss stayed non-finite after 3 rollbacks"),
    ):
        Checkpointer.rollback(stub, 3)  # type: ignore[arg-type]
    assert "no space left on /scratch" in caplog.text
    stub.pos.rollbacks = 1  # below the limit the write's failure is the error, as before
    with pytest.raises(CheckpointWriteError):
        Checkpointer.rollback(stub, 3)  # type: ignore[arg-type]


def test_a_storage_that_fails_a_read_at_resume_sets_nothing_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EIO (or ESTALE, or a permission) while a resume checked the checkpoints moved good ones aside as corrupt;
    with all of them read so, the advice was to start again from step 0."""
    import errno

    from aura_hpc.errors import CheckpointError
    from aura_hpc.train.checkpoint import files
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    for step in (1, 2):
        checkpoint.save(tmp_path, step, model, {}, {"step": step}, None, "", keep_last=3)

    def blip(path: Path) -> str:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(files, "_sha256", blip)
    with pytest.raises(
        CheckpointError, match=r"checkpoint step_00000002 could not be checked: the storage could not read it: Input/output"
    ):
        checkpoint.newest_valid(tmp_path)
    monkeypatch.undo()
    assert [c.step for c in checkpoint.list_complete(tmp_path)] == [2, 1] and not list(tmp_path.glob("corrupt-*"))
    assert (newest := checkpoint.newest_valid(tmp_path)) is not None and newest.step == 2


def test_prune_leaves_a_linked_folder_and_damaged_markers_or_files_gone_mid_read_are_said(tmp_path: Path) -> None:
    """A step folder that is a link to an archive: prune removed the archive's COMPLETE.json through it. A marker
    of another shape, or a file gone while `generate` read (its run pruning), was a traceback; and `generate`, a
    reader, set the checkpoints it could not check aside as corrupt under the run that owns them."""
    from aura_hpc.train.generate import generate
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    root, archive = tmp_path / "run" / "checkpoints", tmp_path / "archive"
    checkpoint.save(archive, 1, model, {}, {"step": 1}, None, "", keep_last=5)
    root.mkdir(parents=True)
    (root / "step_00000001").symlink_to(archive / "step_00000001", target_is_directory=True)
    for step in (2, 3):
        checkpoint.save(root, step, model, {}, {"step": step}, None, "", keep_last=1)
    assert (archive / "step_00000001" / "COMPLETE.json").is_file() and (root / "step_00000001").is_symlink()
    newest = root / "step_00000003"
    for marker in ("[]", '{"files": {"meta.json": 1}}', '{"files": [["meta.json", 1]]}'):
        (newest / "COMPLETE.json").write_text(marker)
        assert checkpoint.verify(newest).startswith("unreadable commit marker or files"), marker
    (root / "step_00000001").unlink()
    with pytest.raises(errors.CheckpointError, match=r"no checkpoint in .* verifies \(step_00000003: unreadable commit marker"):
        generate(str(tmp_path / "run"), "", 5, 1.0, 0, 0)
    assert newest.is_dir() and not list(root.glob("corrupt-*")), sorted(p.name for p in root.iterdir())


def test_a_killed_launcher_takes_its_workers_along_and_a_run_dir_admits_one_trainer(
    tmp_path: Path, prepared: Path, reference: dict
) -> None:
    args = _args(tmp_path, "run", prepared, LONG)
    run = tmp_path / "run"
    # Rank 0 idles 1 s a step: the 48 steps left outlast the three commands below on a busy machine (its launcher is
    # killed after them).
    slow = {"AURA_FAULT_SLOW": "0:+1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", *args], env=cli_env(**slow), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_step(run, 12)
        # A second trainer in the same run directory is refused before it changes anything there.
        config_before = (run / "config.yaml").read_bytes()
        second = run_cli([*args, "--set", "train.lr=0.5"], timeout=120)
        said = second.stdout + second.stderr
        assert second.returncode == 2 and f"is in use by PID {proc.pid} on " in said and "another --run-name" in said, said
        assert (run / "config.yaml").read_bytes() == config_before
        # status and cancel name the live holder of a local run.
        st = json.loads(run_cli(["status", str(run), "--json"]).stdout)["jobs"][0]
        assert st["state"] == "RUNNING" and st["holder"]["pid"] == proc.pid, st
        cancel = run_cli(["cancel", str(run)])
        assert cancel.returncode == 2 and f"`kill {proc.pid}` on " in cancel.stderr, cancel.stderr
        workers = list(_workers(proc).values())
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: workers run in sessions of their own
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, "workers outlived their launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
    # Whichever worker notices first says so; the other stops on the shared stop flag.
    logs = "".join((run / "logs" / f"rank_{r}.log").read_text() for r in (0, 1))
    assert f"the launcher (PID {proc.pid}) is gone" in logs, logs[-3000:]
    step = checkpoint.list_complete(run / "checkpoints")[0].step
    # The dead launcher's lock is taken over; the same command resumes and ends as if never stopped.
    again = run_cli(args)
    assert again.returncode == 0, _diagnose(again, run)
    assert f"resumed from checkpoint step_{step:08d}" in again.stdout
    assert _same(final_weights(run), reference[LONG])
    assert not (run / "run.lock").exists()


def test_a_stopped_rank_is_named_within_a_minute_and_the_run_restarts_bit_identical(stopped: dict[str, Future], reference: dict) -> None:
    """Rank 1 stops (SIGSTOP) after step 12 and never moves again: the watchdog outside the loop declares
    the hang within 60 s of that step under the default settings, names rank 1 and what rank 0 waits
    in, keeps both stacks, and the same launch restarts from step 10 to the same bits as no hang."""
    tmp_path, r = stopped["watchdog"].result()
    run_dir = tmp_path / "run"
    assert r.returncode == 0, _diagnose(r, run_dir)
    stopped_at = float(re.search(r"fault injection: SIGSTOP rank 1 after step 12 at ([\d.]+)", r.stdout).group(1))
    record = json.loads((run_dir / "hangs" / "last.json").read_text())
    assert record["declared_at"] - stopped_at <= 60, record["declared_at"] - stopped_at
    assert record["culprits"] == [1], record["line"]
    line = next(x for x in r.stderr.splitlines() if "hang: " in x)
    assert "rank 1 on " in line and "did not answer" in line and "training after step 12" in line, line
    assert "it is stopped (state T: SIGSTOP, or a debugger)" in line, line
    assert re.search(r"rank 0 waits at train/(loop/step|strategies/base)\.py:\d+ in \w+", line), line
    folder = Path(line.rsplit("stacks in ", 1)[1].strip())
    assert "(most recent call first)" in (folder / "rank0.txt").read_text()
    assert "no answer" in (folder / "rank1.txt").read_text()
    if hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):  # gloo keeps a flight record (torch 2.13): rank 0's, read back
        assert re.search(r"; flight records: rank 0 waits in gloo:\w+ #\d+ of group \d+; rank 1 gave no record; ", line), line
        assert record["nccl_flight_records"] == ["nccl_flight_record_rank0"] and record["flight_recorder"]["culprits"] == []
    assert "resumed from checkpoint step_00000010 at step 10" in r.stdout, r.stdout[-3000:]
    assert _same(final_weights(run_dir), reference[STEPS])
    # The goodput ledger: the launch's wall time split, the hang and the steps trained again included.
    split = json.loads((run_dir / "summary.json").read_text())["goodput"]
    sec, fr = split["seconds"], split["fractions"]
    assert abs(fr["other"]) <= 0.02, split
    assert sec["productive steps"] > 0 and sec["start-up"] > 0 and sec["recomputed"] > 0 and sec["restarts"] > 0, split
    assert 25 <= sec["hangs"] <= 60, split  # from rank 1's last step to the kill (a 30 s floor, then the stacks)
    said = [x for x in r.stdout.splitlines() if x.endswith("(goodput ledger)")]
    assert len(said) == 1 and "% hangs" in said[0] and "% productive steps" in said[0], r.stdout[-500:]
