"""`submit`, requeue, sweeps and job inspection against a real Slurm (slurmctld + 4 slurmd + slurmdbd).

The cluster is started by tests/slurm/cluster.sh (the `slurm_cluster` fixture in conftest.py); .ci/run installs
Debian's slurm-wlm, munge, slurmdbd and mariadb-server first.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from aura_hpc.ops.network import loopback_interface, resolve
from tests.conftest import SMALL_MODEL, cli_env, final_weights, free_port, run_cli

TINY = [
    "--nodes",
    "2",
    "--gpus",
    "0",
    "--time",
    "10",
    *SMALL_MODEL,
    "--set",
    "train.warmup_steps=2",
    "--set",
    "train.sample_tokens=5",
]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "aura-home"
    monkeypatch.setenv("AURA_HPC_HOME", str(h))
    return h


def _job_id(run_dir: Path) -> str:
    return str(json.loads((run_dir / "job.json").read_text())["job_id"])


def _sacct_time(t: float) -> str:
    """sacct's -S format; a -S bound keeps records of older jobs under reused ids out of the answer."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def _squeue_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _wait_gone(job_id: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_id not in _squeue_ids():
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still queued after {timeout}s")


def _latest_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.strip().startswith("{")]
    return max(steps, default=0)


def _job_evidence(run_dir: Path, job: str, lines: int = 12) -> str:
    """What a failed wait shows: Slurm's account of the job and the last lines of each task's logs."""
    acct = subprocess.run(
        ["sacct", "-j", job, "-n", "-P", "-o", "JobID,State,ExitCode,Restarts,NodeList,Elapsed"], capture_output=True, text=True
    )
    parts = [f"sacct {job}:\n{acct.stdout or acct.stderr}"]
    for log in sorted((run_dir / "slurm").glob(f"{job}_*_log.*")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}:\n" + "\n".join(tail))
    return "\n".join(parts)


def _requeued_beside_a_reference(runs: list[tuple[list[str], Path]], timeout: float) -> list[tuple[Path, str, float]]:
    """For each (common args, output dir): submit an uninterrupted "straight" run and a "requeued" one
    side by side, USR2 the second once it reaches step 20; [(its run dir, job id, when signalled)]. `timeout`:
    a liveness bound (4 jobs starting on 2 busy cores beside another test file), not a speed target.
    A job's tasks take one CPU each, so up to 4 two-node jobs share the test cluster's 4 two-CPU nodes:
    two runs (4 jobs) take the wall time of one."""
    assert len(runs) <= 2, "more than 4 jobs would queue behind each other"
    pending = {}
    for common, out in runs:
        for name in ("straight", "requeued"):
            res = run_cli(["submit", *common, "--run-name", name])
            assert res.returncode == 0, res.stderr
        pending[out / "requeued"] = _job_id(out / "requeued")
    signalled: dict[Path, float] = {}
    deadline = time.monotonic() + timeout
    while len(signalled) < len(pending):
        if time.monotonic() > deadline:
            late = sorted(str(r) for r in pending if r not in signalled)
            queue = subprocess.run(["squeue", "-o", "%i %T %M %N %R"], capture_output=True, text=True).stdout
            evidence = "\n".join(_job_evidence(r, pending[r]) for r in pending if r not in signalled)
            raise AssertionError(f"never reached step 20 in {timeout:.0f} s: {late}\n{queue}\n{evidence}")
        queued = _squeue_ids()
        for run_dir, job in pending.items():
            if run_dir in signalled:
                continue
            if _latest_step(run_dir) < 20:
                if job not in queued:  # read before the step: a job that left the queue wrote its last step already
                    raise AssertionError(f"job {job} ended before step 20: {run_dir}\n{_job_evidence(run_dir, job)}")
            else:
                # Preemption or the pre-timeout warning: the same signal Slurm sends before the time limit.
                signalled[run_dir] = time.time()
                subprocess.run(["scancel", "--signal=USR2", job], check=True)
        time.sleep(0.2)
    for job in pending.values():
        _wait_gone(job)
    return [(run_dir, job, signalled[run_dir]) for run_dir, job in pending.items()]


def _ends_equal_to_the_straight_run(run_dir: Path, out: Path, what: str) -> None:
    _wait_gone(_job_id(out / "straight"))
    assert json.loads((out / "straight" / "summary.json").read_text())["finished"]
    a, b = final_weights(run_dir), final_weights(out / "straight")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs after the requeue from the uninterrupted run"


# ---- real submissions -------------------------------------------------------------------


def test_two_node_job_completes_and_status_logs_find_it(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    """On n3 and n4: n3's name resolves nowhere (tests/slurm/cluster.sh), as on a site whose node names are in no DNS.
    Every rank was told MASTER_ADDR=n3, which no rank could look up; they are now told where srun ran from."""
    out = tmp_path / "runs"
    args = ["submit", *TINY, "--output-dir", str(out), "--run-name", "two", "--set", f"data.path={prepared}", "--set", "train.max_steps=12"]
    args += ["--set", "slurm.exclude=n1,n2"]
    dry = run_cli([*args, "--dry-run"])
    assert dry.returncode == 0, dry.stderr
    t0 = time.perf_counter()
    res = run_cli([*args, "--follow"], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = out / "two"
    job = _job_id(run_dir)
    assert f"submitted job {job}" in res.stdout and "COMPLETED" in res.stdout
    # --follow streamed rank 0's log while waiting.
    assert "[rank0]" in res.stdout and "all 2 ranks finished at step 12" in res.stdout
    print(f"submit --wait of a 2-node tiny job: {time.perf_counter() - t0:.1f}s")

    # The run directory holds the resolved config, the submitted script and the job id.
    assert (run_dir / "config.yaml").exists()
    submitted = (run_dir / "submission.sh").read_text()
    assert submitted.rstrip() in dry.stdout.replace(str(run_dir / "slurm" / "<jobid>_submission.sh"), ""), (
        "dry-run differs from what was submitted"
    )
    assert "#SBATCH --nodes=2" in submitted and "#SBATCH --ntasks-per-node=1" in submitted and "#SBATCH --signal=USR2@" in submitted

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 12 and summary["world_size"] == 2 and summary["finished"]

    status = run_cli(["status", job, "--json"])
    assert status.returncode == 0, status.stderr
    row = json.loads(status.stdout)["jobs"][0]
    assert row["job_id"] == job and row["state"] == "COMPLETED" and row["step"] == 12
    assert row["run_dir"] == str(run_dir) and row["loss"] > 0

    by_dir = json.loads(run_cli(["status", str(run_dir), "--json"]).stdout)["jobs"][0]
    assert by_dir["job_id"] == job

    # `logs --follow` of a job that has ended: its lines, then how it ended, and its status.
    followed = run_cli(["logs", job, "--follow"], timeout=120)
    assert followed.returncode == 0 and "all 2 ranks finished at step 12" in followed.stdout, followed.stdout + followed.stderr
    assert f"job {job} ended: COMPLETED" in followed.stdout, followed.stdout

    own = resolve(socket.gethostname())  # where gloo would listen: told the route to the master instead where loopback
    told = 1 if own is None or own.startswith("127.") else 0
    gloo_line = f"GLOO_SOCKET_IFNAME=lo: this node's name {socket.gethostname()} resolves to {own or 'nothing'}"
    for rank in (0, 1):
        log = run_cli(["logs", job, "--rank", str(rank)])
        assert log.returncode == 0, log.stderr
        assert f"[rank{rank}]" in log.stdout and "world_size=2" in log.stdout
        assert f"node_rank={rank} host=" in log.stdout and "master=127.0.0.1:" in log.stdout, log.stdout  # srun's address
        assert log.stdout.count(gloo_line) == told, log.stdout
        assert (run_dir / "slurm" / f"{job}_{rank}_log.out").exists()
    assert "all 2 ranks finished at step 12" in run_cli(["logs", str(run_dir)]).stdout
    bad = run_cli(["logs", job, "--rank", "5"])
    assert bad.returncode == 2 and "--rank 0..1" in bad.stderr

    history = run_cli(["history", "--json"])
    assert history.returncode == 0, history.stderr
    # `generate` takes the job id as `status` and `logs` do: the run directory the index holds for it.
    sampled = run_cli(["generate", job, "--max-new-tokens", "3"], timeout=120)
    assert sampled.returncode == 0 and sampled.stdout.startswith("En un lugar de la Mancha"), sampled.stdout + sampled.stderr

    # The run submitted again (a resume): job.json names the new job, and the index has both.
    from aura_hpc.slurm import index

    recorded = json.loads((run_dir / "job.json").read_text())
    index.record("999999", run_dir, recorded["job_name"], recorded["submitted"], run_dir / "slurm", 2)
    (run_dir / "job.json").write_text(json.dumps({**recorded, "job_id": "999999"}))
    earlier = json.loads(run_cli(["status", job, "--json"]).stdout)
    [row] = earlier["jobs"]
    assert row["state"] == "COMPLETED" and row["step"] is None and row["loss"] is None, earlier  # step 12 is the run's, not the job's
    assert any("submitted again as job 999999" in n for n in earlier["notes"]), earlier
    assert "start rank=1 " in run_cli(["logs", job, "--rank", "1"]).stdout  # rank 1's own log, of this job
    assert any(r["job_id"] == job and r["run_dir"] == str(run_dir) for r in json.loads(history.stdout)["jobs"])


def test_usr2_checkpoints_requeues_and_ends_equal_to_an_uninterrupted_run(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path
) -> None:
    """DDP, and beside it DiLoCo (two Slurm nodes, one replica each, USR2 mid-interval: the requeued job
    resumes its replicas' own weights and outer state): both end bit-identical to a run never stopped."""
    out, dl_out = tmp_path / "runs", tmp_path / "diloco"
    common = [*TINY, "--set", f"data.path={prepared}", "--set", "train.max_steps=150", "--set", "train.checkpoint_every=100"]
    diloco = [*common, "--output-dir", str(dl_out), "--set", "dist.strategy=diloco", "--set", "dist.sync_every=7"]
    (run_dir, job, signalled), (dl_dir, dl_job, _) = _requeued_beside_a_reference(
        [([*common, "--output-dir", str(out)], out), (diloco, dl_out)], timeout=420
    )

    log = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    # Rank 0 may act on rank 1's copy of the signal first (the stop is agreed at the step boundary); it still
    # requeues, on its own copy.
    said = "stop requested (SIGUSR2)" in log or "stop requested (signal on another rank)" in log
    assert said and f"requeuing job {job}" in log and f"scontrol requeue {job} failed" not in log, log[-3000:]
    assert "restart=0" in log and "restart=1" in log, "the log must show both parts (appended, not truncated)"
    m = re.search(r"resumed from checkpoint step_(\d+) at step (\d+)", log)
    assert m and 20 <= int(m.group(2)) < 150
    first = re.findall(r"first step of this attempt done: step (\d+) at unix time ([\d.]+)", log)
    assert len(first) == 2 and int(first[1][0]) == int(m.group(2)) + 1
    print(f"USR2 -> first resumed step: {float(first[1][1]) - signalled:.1f}s")
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 150
    # Rank 1's interrupted attempt does not claim success; history counts the requeue.
    rank1 = (run_dir / "slurm" / f"{job}_1_log.out").read_text() + (run_dir / "slurm" / f"{job}_1_log.err").read_text()
    assert "this attempt stops here" in rank1 and rank1.count("Job completed successfully") == 1, rank1[-3000:]
    hist = _history_of(job, lambda rows: len(rows) == 1 and rows[0]["state"] == "COMPLETED")
    assert len(hist) == 1 and hist[0]["requeues"] == 1 and hist[0]["state"] == "COMPLETED", hist
    # The goodput ledger spans the job's two attempts: the requeue and its wait in the queue are "restarts".
    split = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert split["seconds"]["restarts"] > 0 and split["seconds"]["productive steps"] > 0, split
    assert abs(split["seconds"]["other"]) <= 0.02 * split["wall_s"], split
    assert "[rank0] time: " in log and "(goodput ledger)" in log
    st = run_cli(["status", job, "--json"])
    assert any(n.startswith("time: ") for n in json.loads(st.stdout)["notes"]), st.stdout
    _ends_equal_to_the_straight_run(run_dir, out, "ddp")

    log = (dl_dir / "slurm" / f"{dl_job}_0_log.out").read_text()
    said = "stop requested (SIGUSR2)" in log or "stop requested (signal on another rank)" in log
    assert "strategy: diloco" in log and said and f"requeuing job {dl_job}" in log, log[-3000:]
    m = re.search(r"resumed from checkpoint step_(\d+) at step (\d+)", log)
    assert m and 20 <= int(m.group(2)) < 150, log[-3000:]
    _ends_equal_to_the_straight_run(dl_dir, dl_out, "diloco")


def test_sweep_is_an_array_and_after_waits(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    out = tmp_path / "runs"
    base = [*TINY[2:], "--nodes", "1", "--output-dir", str(out), "--set", f"data.path={prepared}", "--set", "train.max_steps=8"]
    since = _sacct_time(time.time() - 60)  # records from before this test belong to other jobs
    first = run_cli(["submit", *base, "--run-name", "first", "--set", "train.max_steps=60"])
    assert first.returncode == 0, first.stderr
    first_id = _job_id(out / "first")
    res = run_cli(["submit", *base, "--run-name", "sw", "--sweep", "train.lr=1e-3,3e-3", "--after", first_id, "--wait"], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    points = sorted(p for p in (out / "sw").iterdir() if (p / "job.json").exists())
    assert [p.name for p in points] == ["lr1e-3", "lr3e-3"]
    ids = [_job_id(p) for p in points]
    array = {i.split("_")[0] for i in ids}
    assert len(array) == 1 and sorted(i.split("_")[1] for i in ids) == ["0", "1"], ids
    logs = run_cli(["logs", next(iter(array))])  # the id `submit` printed: it said "no run directory is known"
    assert logs.returncode == 2 and f"is a sweep of 2 points, each with its own logs (fix: `logs {sorted(ids)[0]}`" in logs.stderr, (
        logs.stderr
    )
    lrs = []
    for p in points:
        cfg = (p / "config.yaml").read_text()
        lrs.append(float(re.search(r"^  lr: (.+)$", cfg, re.M).group(1)))  # type: ignore[union-attr]
        assert json.loads((p / "summary.json").read_text())["finished"]
    assert lrs == [1e-3, 3e-3]
    # --after: no array element started before the first job had ended.
    # slurmctld hands finished jobs to slurmdbd asynchronously: on a busy host their records can lag the end.
    deadline = time.monotonic() + 60
    while True:
        acct = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-S", since, "-j", f"{first_id},{next(iter(array))}", "-o", "JobID,Start,End"],
            capture_output=True,
            text=True,
        ).stdout
        times = {line.split("|")[0]: line.split("|")[1:] for line in acct.splitlines() if line}
        if ({first_id, *ids} <= times.keys() and "Unknown" not in acct) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {first_id, *ids} <= times.keys(), acct
    assert times[first_id][1] <= min(times[i][0] for i in ids), acct


def test_hostile_names_and_paths_are_passed_literally(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    out = tmp_path / "my runs $(touch PWNED1) `touch PWNED2` 'q' \"dq\""
    name = "job $(touch PWNED3) `touch PWNED4` 'x' \"y\" ; touch PWNED5 | wc"
    args = ["submit", *TINY, "--output-dir", str(out), "--run-name", "quoted", "--job-name", name]
    args += ["--set", f"data.path={prepared}", "--set", "train.max_steps=4"]
    dry = run_cli([*args, "--dry-run"])
    assert dry.returncode == 0, dry.stderr
    script = dry.stdout[dry.stdout.index("#!/bin/bash") :]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    since = _sacct_time(time.time() - 60)
    res = run_cli([*args, "--wait"], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = out / "quoted"
    assert json.loads((run_dir / "summary.json").read_text())["finished"]
    job = _job_id(run_dir)
    acct = ["sacct", "-n", "-X", "-P", "-S", since, "-j", job, "-o", "JobName"]
    got = subprocess.run(acct, capture_output=True, text=True).stdout.strip()
    squeue_name = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%j"], capture_output=True, text=True).stdout.strip()
    assert name in (got, squeue_name), (got, squeue_name)
    for where in (tmp_path, Path.cwd(), run_dir, run_dir / "slurm", Path("/tmp")):
        assert not list(where.glob("PWNED*")), f"a name was executed as a command in {where}"


# ---- requeue cap ------------------------------------------------------------------------


def test_requeue_stops_at_max_requeues(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    out = tmp_path / "runs"
    args = ["submit", *TINY, "--output-dir", str(out), "--run-name", "capped", "--set", f"data.path={prepared}"]
    args += ["--set", "train.max_steps=100000", "--set", "slurm.max_requeues=0", "--set", "train.checkpoint_every=0"]
    assert run_cli(args).returncode == 0
    run_dir = out / "capped"
    job = _job_id(run_dir)
    deadline = time.monotonic() + 300  # beside the busiest test files: scheduling, imports, rendezvous
    while _latest_step(run_dir) < 5:
        assert time.monotonic() < deadline, _job_evidence(run_dir, job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    waited = run_cli(["status", job, "--json"])
    assert waited.returncode == 0
    _wait_gone(job)
    log = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    assert "not requeued" in log and "slurm.max_requeues=0" in log and "requeuing job" not in log
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*"))


# ---- refused before anything is submitted ------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--partition", "nosuchpart"], "invalid partition"),
        (["--nodes", "0"], "slurm.nodes must be at least 1"),
        (["--cluster", "h100-ib", "--gpus", "9"], "more than the 8 GPUs per node"),
        (["--nodes", "9"], "sbatch"),
        (["--time", "soon"], "is not a Slurm time"),
    ],
    ids=["unknown partition", "zero nodes", "gpus above profile", "more nodes than the cluster", "bad time"],
)
def test_bad_submissions_are_refused_and_nothing_is_queued(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path, extra: list[str], needle: str
) -> None:
    name = f"bad-{tmp_path.name}"  # this test's own job name: other tests' jobs come and go in the queue meanwhile
    since = _sacct_time(time.time() - 60)  # records from before this test belong to other jobs
    args = ["submit", *TINY, "--output-dir", str(tmp_path / "runs"), "--run-name", name, "--set", f"data.path={prepared}", *extra]
    res = run_cli(args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr and "fix:" in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("warning:")]
    assert len(errors) == 1, res.stderr
    queued = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, check=True).stdout.split()
    acct = ["sacct", "-n", "-X", "-o", "JobName%200", "-S", since]
    accounted = subprocess.run(acct, capture_output=True, text=True, check=True)
    assert f"aura-{name}" not in queued + accounted.stdout.split()
    assert not (tmp_path / "runs" / name / "job.json").exists()


def test_a_queued_job_whose_record_cannot_be_written_is_named_by_its_id(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home over quota (here: AURA_HPC_HOME a file) after sbatch had queued the job: a traceback without the id,
    and the user submitted again."""
    blocked = tmp_path / "home-is-a-file"
    blocked.write_text("")
    monkeypatch.setenv("AURA_HPC_HOME", str(blocked))
    args = ["submit", *TINY, "--output-dir", str(tmp_path / "runs"), "--run-name", f"unrecorded-{tmp_path.name}"]
    res = run_cli([*args, "--set", f"data.path={prepared}", "--set", "train.max_steps=1"])
    said = re.search(r"job\(s\) (\d+) were queued, but recording them failed \(.*\(fix: ", res.stderr)
    if said:
        subprocess.run(["scancel", said.group(1)], check=False)
    assert res.returncode == 2 and said and "Traceback" not in res.stderr, res.stdout + res.stderr


def test_logs_of_a_large_sweeps_id_names_its_points_in_index_order_and_not_all_of_them(tmp_path: Path, home: Path) -> None:
    """The points were listed as text (123_10 before 123_2, the first to try was not the first point) and every one
    of them: a 100-point sweep made a line of a thousand characters."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.slurm import commands, index

    for i in range(12):
        index.record(f"77_{i}", tmp_path / f"p{i}", f"aura-p{i}", "2026-12-03T00:00:00")
    with pytest.raises(LaunchError) as said:
        commands.log_file("77", 0, False)
    assert str(said.value) == (
        "job 77 is a sweep of 12 points, each with its own logs (fix: `logs 77_0`, one of 77_0, 77_1, 77_2, ... 77_10, 77_11)"
    )


def test_a_damaged_index_line_or_job_file_is_a_line_not_a_keyerror(tmp_path: Path, home: Path) -> None:
    """A jobs.jsonl line without run_dir (an older version's, or half written) made every status and history a
    KeyError traceback; an empty job.json a JSONDecodeError, one without log_dir a KeyError at `logs`."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.slurm import index

    index.record("7", tmp_path / "seven", "aura-seven", "2026-11-30T00:00:00")
    with index.index_path().open("a") as f:
        f.write('{"job_id": "8"}\n[1, 2]\n{"job_id": "7", "run_dir": 5}\n')
    assert index.run_dirs() == {"7": tmp_path / "seven"} and index.run_dir_of("8") is None
    run = tmp_path / "seven"
    run.mkdir()
    for damaged in ("", '{"job_id": "7"}', "[]"):
        (run / "job.json").write_text(damaged)
        with pytest.raises(LaunchError, match=r"job\.json is damaged \(not the record submit writes\) \(fix: "):
            index.resolve(str(run))


def test_the_logs_of_a_runs_earlier_job_stay_reachable_after_it_was_submitted_again(tmp_path: Path, home: Path) -> None:
    """A resume submits the same run again, and job.json then names the new job: `logs` of the earlier one said no run
    directory was known for it (its log files still there), and following that fix showed the new job's."""
    from aura_hpc.slurm import index

    run = tmp_path / "runs" / "again"
    (run / "slurm").mkdir(parents=True)
    index.record("7", run, "aura-again", "2026-12-01T10:00:00+0000", run / "slurm", 2)
    index.record("8", run, "aura-again", "2026-12-02T10:00:00+0000", run / "slurm", 4)
    (run / "job.json").write_text(json.dumps({"job_id": "8", "job_name": "aura-again", "log_dir": str(run / "slurm"), "world_size": 4}))
    for job in ("7", "8"):
        (run / "slurm" / f"{job}_1_log.out").write_text(f"[rank1] the log of job {job}\n")
    shown = run_cli(["logs", "7", "--rank", "1"])
    assert shown.returncode == 0 and shown.stdout.strip() == "[rank1] the log of job 7", shown.stdout + shown.stderr
    assert run_cli(["logs", "8", "--rank", "1"]).stdout.strip() == "[rank1] the log of job 8"
    beyond = run_cli(["logs", "7", "--rank", "3"])  # job 7 had 2 ranks, job 8 has 4
    assert beyond.returncode == 2 and "--rank 0..1" in beyond.stderr, beyond.stderr
    _, _, info = index.resolve("7")
    assert info is not None and info["superseded_by"] == "8" and info["world_size"] == 2


def test_a_watch_outlasts_a_controller_that_misses_an_answer_and_prints_the_jobs_last_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One squeue that timed out (a busy controller) ended `logs --follow` and `submit --wait` with exit 2 while
    the job ran on; and the job's last line, written without a line break, was never printed."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.slurm import commands, submit

    answers: list[object] = [LaunchError("squeue: error: Socket timed out on send/recv operation"), None]

    def squeue_jobs(job_ids: list[str]) -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return dict.fromkeys(job_ids, answer)

    monkeypatch.setattr(submit.slurm_query, "squeue_jobs", squeue_jobs)
    log = tmp_path / "42_0_log.out"
    log.write_text("step 10 loss 3.1\nRuntimeError: CUDA out of memory")
    printed: list[str] = []
    commands.follow("42", log, printed.append, poll_s=0.1)
    assert printed == ["step 10 loss 3.1", "RuntimeError: CUDA out of memory"] and not answers
    answers[:] = [LaunchError("squeue: error: Socket timed out")] * 3
    with pytest.raises(LaunchError, match=r"Socket timed out \(squeue failed for 1 s; the job itself may still run\)"):
        submit.squeue_patiently("42", patience_s=1)
    # What no time cures is said at once: `logs -f` on a machine without squeue was silent for 5 minutes.
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"Slurm's squeue is not on PATH: this machine is not a Slurm login node \(fix: ") as said:
        commands.follow("42", log, printed.append, poll_s=0.1)
    assert time.monotonic() - t0 < 5 and "squeue failed for" not in str(said.value)
    # A login node with squeue and no sacct (the accounting client not installed): told so, not "no Slurm login node".
    (tmp_path / "no-slurm-here").mkdir()
    (tmp_path / "no-slurm-here" / "squeue").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "no-slurm-here" / "squeue").chmod(0o755)
    with pytest.raises(LaunchError, match=r"sacct is not on PATH, though squeue is: finished jobs cannot be asked .*\(fix: install"):
        submit.slurm_query.accounting_enabled()
    # and what may pass (munge restarting, a controller in standby) is asked again, as a timeout is
    answers[:] = [LaunchError("squeue: error: Munge decode failed: Socket communication error"), None]
    monkeypatch.setattr(submit.slurm_query, "squeue_jobs", squeue_jobs)
    assert submit.squeue_patiently("42", patience_s=30) is None and not answers


def test_a_limit_of_the_account_or_qos_and_a_bad_since_get_their_own_fix(slurm_cluster: Path, home: Path) -> None:
    """Slurm's text for an association's or QOS's limit (ESLURM_ACCOUNTING_POLICY, the reason on a line before it)
    names "time limits": every MaxSubmitJobs or GrpTRES refusal was told to ask for less --time. A --since sacct
    cannot read was told to look at the partitions."""
    from aura_hpc.slurm.query import explain

    said = explain(
        "sbatch",
        "sbatch: error: AssocMaxSubmitJobLimit\nsbatch: error: Batch job submission failed: Job violates accounting/QOS "
        "policy (job submit limit, user's size and/or time limits)",
    )
    assert "AssocMaxSubmitJobLimit" in said and "sacctmgr show assoc user=$USER" in said and "--time" not in said, said
    res = run_cli(["history", "--since", "yesterday"])
    assert res.returncode == 2 and "Invalid time specification" in res.stderr, res.stderr
    assert "fix: give the time as Slurm reads it (history --since" in res.stderr and "sinfo" not in res.stderr, res.stderr


def test_a_controller_that_does_not_answer_the_exclusion_leaves_a_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a requeue that worked, the update that leaves the named node out timed out on a busy controller: a
    traceback in rank 0's or the watchdog's log, where every other scontrol call of the requeue says a line."""
    from aura_hpc.slurm import exclude

    def busy(*args: str) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(["scontrol", *args], 30)

    monkeypatch.setattr(exclude, "_scontrol", busy)
    room = exclude._Room(leave_out=["n3"], left=["n1", "n2"], least=2, partition="debug", refused="")
    said: list[str] = []
    judged = exclude.Judged(room=room, nodes=["n3"], names="n3 (rank 1 hung there)")
    assert exclude.apply_after_requeue(42, tmp_path, said.append, judged) == []
    assert said == [
        "the requeued job keeps its nodes: scontrol could not leave out n3 (rank 1 hung there): scontrol did not answer "
        "(Command '['scontrol', 'update', 'JobId=42', 'ExcNodeList=n3']' timed out after 30 seconds)"
    ], said


def test_a_completing_jobs_run_time_is_read_in_utc_across_a_clock_change(slurm_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scontrol printed the host's local time. Across the spring clock change, a job cancelled after 61 minutes of
    a 2-hour limit read as 2 h 1 min, its limit reached: a timeout, requeued where no accounting said it was a
    cancel (and the hour a fall-back repeats has no one reading). The job's times are now asked in UTC."""
    from aura_hpc.slurm import exclude

    monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")  # Central Europe's rule, no tzdata needed
    time.tzset()
    try:
        across = ["StartTime=2026-03-29T00:30:00", "EndTime=2026-03-29T01:31:00", "TimeLimit=02:00:00"]  # UTC: 61 min
        assert exclude._ended_early(across) is True
        at_limit = ["StartTime=2026-03-29T00:30:00", "EndTime=2026-03-29T02:30:00", "TimeLimit=02:00:00"]
        assert exclude._ended_early(at_limit) is False
        assert exclude._ended_early(["StartTime=2026-03-29T00:30:00", "EndTime=2026-03-29T01:31:00", "TimeLimit=UNLIMITED"]) is None
        # What scontrol says of a job here, in this time zone: its submit time in UTC.
        job = subprocess.run(
            ["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"], capture_output=True, text=True, check=True
        )
        job_id = job.stdout.strip()
        try:
            shown = exclude._scontrol("show", "job", "-o", job_id).stdout
            submitted = re.search(r"SubmitTime=(\S+)", shown).group(1)
            utc = datetime.fromisoformat(submitted).replace(tzinfo=UTC)
            assert abs(utc.timestamp() - time.time()) < 600, shown  # read as local time, an hour off
        finally:
            subprocess.run(["scancel", job_id], check=False)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_requeue_where_the_slurm_client_is_missing_is_a_reason_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container image without scontrol: the watchdog still kills the hung ranks, a screen's requeue
    that did not happen ends the job failed; both read this reason instead of a FileNotFoundError."""
    from aura_hpc.slurm import exclude

    monkeypatch.setenv("PATH", str(tmp_path))
    said = exclude.requeue(123)
    assert said is not None and "scontrol could not be run" in said and "lack the Slurm client" in said, said


def test_the_rendezvous_host_is_where_srun_started_and_gloo_is_kept_off_a_loopback_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The address srun ran from, which every node's slurmstepd reached already (the tasks' output goes back to srun
    there); the first node's name only where srun gave none (or an IPv6 one, which the stores do not take). On the
    master's node, a loopback address (srun reached its own slurmd over loopback: a name Debian maps to 127.0.1.1)
    is where the store listens only when every node is on this machine; gloo's own choice, the machine name's
    address, is kept where it is no loopback address."""
    from aura_hpc.slurm.job import rendezvous_host
    from aura_hpc.train.process import master_address
    from aura_hpc.train.process.dist_env import DistEnv

    monkeypatch.delenv("SLURM_LAUNCH_NODE_IPADDR", raising=False)
    assert rendezvous_host("n[3-4]") == "n3"
    given = {"10.1.0.7": "10.1.0.7", "::ffff:10.1.0.7": "10.1.0.7", "fd00::7": "n3", "0.0.0.0": "n3", "n1;x": "n3"}
    for launched_from, expected in given.items():
        monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", launched_from)
        assert rendezvous_host("n[3-4]") == expected, launched_from

    node0 = DistEnv(world_size=4, local_rank=1, master_addr="127.0.0.1", launcher="slurm", peer_host="n4", hostname="n3")
    assert master_address.reached_at(node0) == "127.0.0.1"  # n4 is this machine too (the test cluster)
    monkeypatch.setattr(master_address, "resolve", lambda name, patient=False: {"127.0.0.1": "127.0.0.1", "n4": "10.1.0.8"}.get(name))
    monkeypatch.setattr(master_address, "route_to", lambda addr: ("10.1.0.7", "eth1") if addr.startswith("10.") else (None, None))
    assert master_address.reached_at(node0) == "10.1.0.7"  # where rank 0 listens, and its node's other ranks dial
    assert master_address.dialled(node0) == "10.1.0.7"
    node1 = DistEnv(world_size=4, node_rank=1, master_addr="10.1.0.7", launcher="slurm", peer_host="n4", hostname="n4")
    assert master_address.dialled(node1) == "10.1.0.7"

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr("socket.gethostname", lambda: "n3")  # resolves nowhere: gloo would fall back to loopback
    assert master_address.gloo_interface(node0) == (
        "eth1",
        "this node's name n3 resolves to nothing, where gloo would listen instead of on the route to 10.1.0.7",
    )
    assert master_address.gloo_interface(DistEnv(launcher="slurm", hostname="n3")) is None  # one node: every rank's choice
    monkeypatch.setattr(master_address, "resolve", lambda name, patient=False: "10.1.0.7")  # a name on the network: gloo's own choice
    assert master_address.gloo_interface(node0) is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the site's, or the profile's, always wins
    monkeypatch.setattr(master_address, "resolve", lambda name, patient=False: None)
    assert master_address.gloo_interface(node0) is None

    # Task 0 on another node than srun's (a `#SBATCH --batch` feature): one line, not a traceback from the bind.
    from datetime import timedelta

    from aura_hpc.errors import LaunchError
    from aura_hpc.train.process import distributed

    elsewhere = DistEnv(world_size=2, master_addr="192.0.2.7", launcher="slurm", hostname="n3", master_port=free_port())
    with pytest.raises(LaunchError, match=r"rank 0 runs on n3, and the master address 192.0.2.7 is none of its addresses"):
        distributed._store(elsewhere, timedelta(seconds=5))
    with socket.socket() as taken:  # and a port in use is still that
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        here = DistEnv(world_size=2, launcher="slurm", hostname="n3", master_port=taken.getsockname()[1])
        with pytest.raises(LaunchError, match=r"port \d+ on 127.0.0.1 is already in use \(fix: submit the same command again"):
            distributed._store(here, timedelta(seconds=5))


def test_submit_check_meets_where_training_does_on_a_master_srun_reached_over_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit --check` on a site whose first node reaches its own slurmd over loopback (its name maps to 127.0.1.1):
    node 0's store listens where the other nodes reach it, as training's does, not at the loopback address srun gave
    that node's task (the other nodes, given its real address, were refused and check blamed the firewall)."""
    from aura_hpc.ops import check
    from aura_hpc.slurm.job import CheckJob
    from aura_hpc.train.process import master_address

    asked: list[tuple[str, str | None]] = []
    # The interfaces too, as training's: gloo's from the route where the node's name is loopback (it resolves to
    # nothing here), NCCL's its own choice (it was set to the route's, often not the one NCCL trains on).
    seen = lambda shared, cluster: asked.append((cluster.master_addr, os.environ.get("GLOO_SOCKET_IFNAME"))) or 0  # noqa: E731
    monkeypatch.setattr(check, "run_and_show", seen)
    monkeypatch.setattr(master_address, "resolve", lambda name, patient=False: {"127.0.0.1": "127.0.0.1", "n4": "10.1.0.8"}.get(name))
    lo = loopback_interface() or "lo"  # the route's interface: one this machine has (`check` refuses another)
    monkeypatch.setattr(master_address, "route_to", lambda addr: ("10.1.0.7", lo) if addr.startswith("10.") else (None, None))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "unset by the test")
    job = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[3-4]", "SLURM_NNODES": "2", "SLURM_NTASKS": "2"}
    for node, launched_from in ((0, "127.0.0.1"), (1, "10.1.0.7")):
        for name, value in {**job, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LAUNCH_NODE_IPADDR": launched_from}.items():
            monkeypatch.setenv(name, value)
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # each node's task its own (and restored after the test)
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)
        assert CheckJob("gloo", "/nowhere")() == 0
        assert "NCCL_SOCKET_IFNAME" not in os.environ
    assert asked == [("10.1.0.7", lo), ("10.1.0.7", lo)]


def test_a_lookup_the_resolver_calls_temporary_is_tried_again_on_the_masters_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of the master's node looks the peer node up itself: a DNS server that did not answer one of them
    in time (EAI_AGAIN) would have sent that rank to loopback while rank 0 listened at the node's address. A name
    that is in no DNS (EAI_NONAME) is not waited for."""
    from aura_hpc.train.process import master_address
    from aura_hpc.train.process.dist_env import DistEnv

    asked: list[str] = []

    def lookup(name: str) -> str:
        asked.append(name)
        if name == "n4" and asked.count("n4") < 3:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if name == "n9":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return "10.1.0.8" if name == "n4" else name

    monkeypatch.setattr(socket, "gethostbyname", lookup)
    monkeypatch.setattr("time.sleep", lambda s: None)
    monkeypatch.setattr(master_address, "route_to", lambda addr: ("10.1.0.7", "eth1") if addr.startswith("10.") else (None, None))
    node0 = DistEnv(world_size=4, local_rank=1, master_addr="127.0.0.1", launcher="slurm", peer_host="n4", hostname="n3")
    assert master_address.dialled(node0) == "10.1.0.7"
    assert asked.count("n4") == 3
    asked.clear()
    far = DistEnv(world_size=4, local_rank=1, master_addr="127.0.0.1", launcher="slurm", peer_host="n9", hostname="n3")
    assert master_address.dialled(far) == "127.0.0.1"  # n9 resolves nowhere: every rank of the node alike, at once
    assert asked.count("n9") == 1


_TASK_START_UP = """
import json, os, signal, sys, types
signal.signal(signal.SIGUSR2, lambda *a: sys.exit(99))  # submitit's handler, which ruled a task's start-up
os.environ.update(SLURM_JOB_ID="7", SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n[1-2]-ib", RANK="0", WORLD_SIZE="1")
import aura_hpc.train
from aura_hpc.slurm import job

def main(argv, why_not):
    from aura_hpc.train.process.dist_env import DistEnv
    from aura_hpc.train.process.stop import StopRequest
    env = DistEnv.from_environ()
    os.kill(os.getpid(), signal.SIGUSR2)  # the pre-timeout signal, while the rank is still starting
    stop = StopRequest()
    stop.install()
    later = StopRequest()
    later.install()
    print(json.dumps({"rank": env.rank, "launcher": env.launcher, "stop": stop.signal_name, "later": later.signal_name}))
    return 0

fake = types.ModuleType("aura_hpc.train.worker")
fake.main = main
sys.modules["aura_hpc.train.worker"] = aura_hpc.train.worker = fake
job._start_watchdog = lambda *a: None
job.rendezvous_host = lambda nodelist: "n1-ib"
print(job.TrainJob("/nowhere/config.yaml")())
"""


def test_a_signal_during_a_tasks_start_up_is_the_trainers_and_torchrun_variables_from_the_shell_are_not_read() -> None:
    """Until the trainer installed its handlers, submitit's ruled: a pre-timeout USR2 failed the job or requeued it
    outside slurm.max_requeues. sbatch passes the submitting shell's RANK/WORLD_SIZE on, and every task took rank 0."""
    done = subprocess.run([sys.executable, "-c", _TASK_START_UP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.splitlines()[-2])
    assert seen == {"rank": 1, "launcher": "slurm", "stop": "SIGUSR2", "later": None}, seen


def test_a_second_local_in_one_allocation_is_refused_and_a_requeued_attempt_takes_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run lock let a holder of the same SLURM_JOB_ID go as "this job's earlier, requeued attempt": a second
    `local` inside one salloc took a live trainer's run directory (two trainers, one folder). Only another attempt
    of the job (SLURM_RESTART_COUNT) is one whose nodes have let go."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.launch.run_lock import RunLock

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    trainer = subprocess.Popen(["sleep", "120"])
    first = RunLock(tmp_path, pid=trainer.pid).acquire()
    try:
        with pytest.raises(LaunchError, match=r"is in use by Slurm job 4242 \(PID \d+ on .*one trainer per run directory"):
            RunLock(tmp_path).acquire()
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        RunLock(tmp_path).acquire().release()
    finally:
        first.release()
        trainer.kill()
        trainer.wait()


def test_nodes_not_responding_or_in_maintenance_are_not_counted_as_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sinfo marks a node that does not respond with `*` and one in a maintenance reservation with `$`: neither
    takes new work, and both were counted as room for a requeued job without its bad node (it then waited).
    The states of a 4-node test cluster cannot be made so; this sinfo on PATH prints what such a cluster's does."""
    from aura_hpc.slurm import exclude

    fake = tmp_path / "sinfo"
    fake.write_text("#!/bin/sh\nprintf 'n1 idle\\nn2 idle*\\nn3 mix\\nn4 idle$\\nn5 drain\\nn6 alloc~\\nn7 mix-\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert exclude._nodes_by_use("gpu") == (["n1", "n3", "n6", "n7"], ["n2", "n4", "n5"])


def test_a_relative_output_dir_is_where_sbatch_starts_the_job_however_it_is_given(tmp_path: Path) -> None:
    """`--output-dir runs`, and the default `runs` of a profile without one, were refused ("not an absolute path")
    while `--set output_dir=runs` was taken from the directory submit ran in, where sbatch starts the job."""
    (tmp_path / "sub").mkdir()
    plans = [
        run_cli(["submit", *flags, "--nodes", "2", "--run-name", "r", "--dry-run"], cwd=tmp_path / "sub")
        for flags in (["--output-dir", "runs"], ["--set", "output_dir=runs"], [], ["--output-dir", "../sub/runs"])
    ]
    for res in plans:
        assert res.returncode == 0 and f"run directory: {tmp_path}/sub/runs/r" in res.stdout, res.stdout[-2000:] + res.stderr
    # Two nodes on this machine's local disk: said, as for an absolute path there (a job's nodes see no shared folder).
    assert all(f"output_dir {tmp_path}/sub/runs is on a local filesystem" in res.stdout + res.stderr for res in plans), plans[0].stdout


def test_missing_slurm_is_a_clear_error(tmp_path: Path, prepared: Path) -> None:
    bin_dir = Path(os.__file__).parent  # a PATH with python's lib only: no sbatch anywhere on it
    res = run_cli(
        ["submit", *TINY, "--output-dir", str(tmp_path / "runs"), "--set", f"data.path={prepared}"],
        PATH=str(bin_dir),
    )
    assert res.returncode == 2 and "not on PATH" in res.stderr and "fix:" in res.stderr, res.stderr
    status = run_cli(["status", "123"], PATH=str(bin_dir))
    assert status.returncode == 2 and "not on PATH" in status.stderr, status.stderr
    # with no job named, status lists the local runs and says in one note why no Slurm jobs are shown
    overview = run_cli(["status"], PATH=str(bin_dir), cwd=tmp_path)
    assert overview.returncode == 0 and "no Slurm jobs" in overview.stdout and "not on PATH" in overview.stdout, overview.stdout


def test_unknown_job_is_a_clear_error_and_another_users_job_is_not_cancelled(slurm_cluster: Path, home: Path) -> None:
    res = run_cli(["status", "987654"])
    assert res.returncode == 2 and "987654" in res.stderr and "fix:" in res.stderr, res.stderr
    res = run_cli(["cancel", "987654"])
    assert res.returncode == 2 and "not in the queue" in res.stderr
    from aura_hpc.slurm import query

    # An id of someone else's job (a typo, or ids restarted): an operator's scancel would have ended it.
    sub = ["sbatch", "--parsable", "--hold", "--uid=nobody", "-o", "/dev/null", "--wrap", "true"]
    other = subprocess.run(sub, capture_output=True, text=True, check=True, cwd="/tmp").stdout.strip().split(";")[0]
    try:
        res = run_cli(["cancel", other])
        assert res.returncode == 2 and f"job {other} is nobody's, not yours: not cancelled" in res.stderr, res.stderr
        row = query.squeue_job(other)  # the owner compared by uid: a failed name lookup reads `nobody`, even for our own
        assert row.state == "PENDING" and row.uid == str(pwd.getpwnam("nobody").pw_uid), row
    finally:
        subprocess.run(["scancel", other], check=False)


def test_status_and_history_read_sweep_elements_and_names_with_a_pipe_as_slurm_holds_them(
    slurm_cluster: Path, tmp_path: Path, home: Path
) -> None:
    """An array's elements are `N_0`, `N_1` (what a sweep's index and logs know), and a `|` in a job's
    name, which arrives literally, shifts no field of squeue's or sacct's answer."""
    since = _sacct_time(time.time() - 60)
    name = f"lr|3e-4 {tmp_path.name}"
    sub = ["sbatch", "--parsable", "--array=0-1", "--job-name", name, "--comment", "aura_hpc", "--wrap", "sleep 120"]
    array = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip().split(";")[0]
    elements = {f"{array}_0", f"{array}_1"}
    plain = f"not ours {tmp_path.name}"  # a job of the user's own, not started by aura_hpc
    subprocess.run(["sbatch", "--job-name", plain, "--wrap", "true"], capture_output=True, check=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            # LOGNAME/USER naming another user (su, sudo -E, a container): the jobs listed are still the caller's.
            res = run_cli(["status", "--json"], LOGNAME="nobody", USER="nobody")
            assert res.returncode == 0, res.stderr
            rows = {r["job_id"]: r for r in json.loads(res.stdout)["jobs"] if r["name"] == name}
            if (set(rows) == elements and all(r["state"] == "RUNNING" for r in rows.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(rows) == elements and {r["state"] for r in rows.values()} == {"RUNNING"}, rows
        one = run_cli(["status", "--json", f"{array}_1"])
        assert [(r["job_id"], r["name"], r["state"]) for r in json.loads(one.stdout)["jobs"]] == [(f"{array}_1", name, "RUNNING")]
        # The array's own id (what `submit` printed for a sweep) was "not in the queue"; squeue's `N_[1-3]` row refused.
        several = run_cli(["cancel", f"{array}_[0-1]"])
        assert several.returncode == 2 and f"(fix: pass {array} for the whole array, or one element such as {array}_0)" in several.stderr
        whole = run_cli(["cancel", array])
        assert whole.returncode == 0, whole.stdout + whole.stderr
    finally:
        subprocess.run(["scancel", array], check=False)
    deadline = time.monotonic() + 60  # slurmdbd records the ends asynchronously
    while True:
        res = run_cli(["history", "--json", "--since", since])
        assert res.returncode == 0, res.stderr
        done = {r["job_id"]: r["state"] for r in json.loads(res.stdout)["jobs"] if r.get("name") == name}
        every = run_cli(["history", "--json", "--all", "--since", since])
        assert every.returncode == 0, every.stderr
        others = [r for r in json.loads(every.stdout)["jobs"] if r.get("name") == plain]
        if (done == dict.fromkeys(elements, "CANCELLED") and others) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert done == dict.fromkeys(elements, "CANCELLED"), res.stdout
    # The array's id once its elements left the queue (after MinJobAge: a squeue that no longer has them) read
    # "unknown to squeue and sacct".
    forgot = tmp_path / "forgetful"
    forgot.mkdir()
    (forgot / "squeue").write_text("#!/bin/sh\nexit 0\n")
    (forgot / "squeue").chmod(0o755)
    gone = run_cli(["status", "--json", array], PATH=f"{forgot}:{os.environ['PATH']}")
    assert gone.returncode == 0, gone.stderr
    assert {r["job_id"]: r["state"] for r in json.loads(gone.stdout)["jobs"]} == dict.fromkeys(elements, "CANCELLED"), gone.stdout
    assert others and not any(r.get("name") == plain for r in json.loads(res.stdout)["jobs"]), every.stdout
    _a_node_failure_requeues_one_job_in_history(tmp_path, since)


def test_history_shows_a_job_cancelled_before_it_was_ever_eligible(slurm_cluster: Path, tmp_path: Path, home: Path) -> None:
    """Slurm's accounting, asked for a time window, keeps only the jobs eligible to start before its end: a job held,
    or waiting on a dependency (a prepare chain's later jobs, after its tokenizer job failed), then cancelled, was
    in no `history`, though `sacct -j` shows it."""
    name = f"held {tmp_path.name}"
    sub = ["sbatch", "--parsable", "--hold", "--job-name", name, "--comment", "aura_hpc", "--wrap", "true"]
    job = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    subprocess.run(["scancel", job], check=True)
    # The accounting records such a job twice: at first without its name ("allocation", 0 nodes), then whole.
    rows = _history_of(job, lambda rows: bool(rows) and rows[0]["name"] == name)
    assert len(rows) == 1 and rows[0]["state"] == "CANCELLED" and rows[0]["name"] == name, rows


def _history_of(job: str, ended: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> list[dict[str, Any]]:
    """`history`'s rows of `job` once `ended` holds for them, or as they are at `timeout`: the accounting records a
    job's end after it left squeue, later on a busy controller."""
    deadline = time.monotonic() + timeout
    while True:
        res = run_cli(["history", "--json"])
        assert res.returncode == 0, res.stderr
        rows = [r for r in json.loads(res.stdout)["jobs"] if r["job_id"] == job]
        if ended(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1)


def _wait_for_state(job: str, state: str, failure: str, timeout: float = 60) -> None:
    """Until squeue shows `job` in `state`; `failure` if it never does."""
    deadline = time.monotonic() + timeout
    while state not in subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, failure
        time.sleep(0.5)


def _a_node_failure_requeues_one_job_in_history(tmp_path: Path, since: str) -> None:
    """A node that goes down under a job submitted with --requeue: Slurm requeues it itself, and its
    first attempt ends NODE_FAIL, not REQUEUED (PREEMPTED under PreemptMode=REQUEUE alike). History
    shows one job that was requeued once, submitted when it first was."""
    name = f"node-fail {tmp_path.name}"
    sub = ["sbatch", "--parsable", "--requeue", "-w", "n4", "--job-name", name, "--comment", "aura_hpc", "--wrap", "sleep 120"]
    job = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    try:
        _wait_for_state(job, "RUNNING", "the job never started on n4")
        subprocess.run(["scontrol", "update", "nodename=n4", "state=down", "reason=aura-test"], check=True)
        _wait_for_state(job, "PENDING", "the job was not requeued after its node went down")
    finally:
        subprocess.run(["scancel", job], check=False)
        subprocess.run(["scontrol", "update", "nodename=n4", "state=resume"], check=False, capture_output=True)
    deadline = time.monotonic() + 60
    while True:
        res = run_cli(["history", "--json", "--since", since])
        assert res.returncode == 0, res.stderr
        rows = [r for r in json.loads(res.stdout)["jobs"] if r["job_id"] == job]
        if (rows and rows[0]["state"] == "CANCELLED") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(rows) == 1 and rows[0]["requeues"] == 1 and rows[0]["state"] == "CANCELLED", rows
    attempts = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-j", job, "-o", "State,Submit"], capture_output=True, text=True)
    first = attempts.stdout.splitlines()[0].split("|")
    assert first[0] == "NODE_FAIL" and rows[0]["submit"] == first[1], attempts.stdout
    deadline = time.monotonic() + 60  # the node back for the tests after this one
    while "n4" not in subprocess.run(["sinfo", "-h", "-t", "idle,mix,alloc", "-o", "%N", "-N"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "n4 did not come back"
        time.sleep(1)


def test_a_cancel_during_a_stop_is_not_undone_by_the_requeue(slurm_cluster: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that lands after the pre-timeout signal (or with slurm.signal=TERM, which scancel sends): rank 0
    requeued the job while its processes were still stopping, and Slurm put the cancelled job back in the queue.
    The accounting, which alone says why a stopping job stops, records the cancel a moment later on a loaded
    controller (the suite once read it before then): here its first two answers still say RUNNING."""
    from aura_hpc.slurm import exclude
    from aura_hpc.slurm.job import TrainJob

    real, calls = shutil.which("sacct"), tmp_path / "sacct_calls"
    lagging = tmp_path / "lagging_accounting"
    lagging.mkdir()
    (lagging / "sacct").write_text(
        f'#!/bin/sh\necho x >> {calls}\nif [ "$(wc -l < {calls})" -le 2 ]; then echo "$5|RUNNING"; exit 0; fi\nexec {real} "$@"\n'
    )
    (lagging / "sacct").chmod(0o755)
    trapped = tmp_path / "trapped"  # the cancel then finds it stopping (COMPLETING), not gone
    wrap = f"trap '' TERM; touch {trapped}; sleep 120"
    sub = ["sbatch", "--parsable", "--requeue", "--time", "10", "--job-name", f"cancelled {tmp_path.name}", "--wrap", wrap]
    job = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    try:
        _wait_for_state(job, "RUNNING", "the job never started")
        deadline = time.monotonic() + 60
        while not trapped.exists():
            assert time.monotonic() < deadline, "the job's script never ran"
            time.sleep(0.2)
        subprocess.run(["scancel", job], check=True)
        with monkeypatch.context() as m:
            m.setenv("PATH", f"{lagging}:{os.environ['PATH']}")
            assert TrainJob(str(tmp_path / "config.yaml"))._requeue(int(job), 0) is False
        assert len(calls.read_text().splitlines()) >= 3  # it waited for the accounting to record the end
        # A cluster without accounting: a job that ends before its time limit (10 min) was stopped by someone.
        (lagging / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
        with monkeypatch.context() as m:
            m.setenv("PATH", f"{lagging}:{os.environ['PATH']}")
            assert "ending before its time limit" in exclude.why_stopped(int(job)).why
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        assert "Restarts=0" in shown and "JobState=PENDING" not in shown, shown
    finally:
        subprocess.run(["scancel", job], check=False)
    # A sweep: its last element has the array's id, and read a cancelled sibling's state as its own.
    # Its name holds what a state looks like: JobName comes before JobState on scontrol's line, unquoted.
    sub = [
        "sbatch",
        "--parsable",
        "--requeue",
        "--array=0-1",
        "--job-name",
        f"sweep JobState=CANCELLED {tmp_path.name}",
        "--wrap",
        "sleep 120",
    ]
    array = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip().split(";")[0]
    try:
        raw: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(raw) < 2:
            assert time.monotonic() < deadline, "the sweep never started"
            listed = subprocess.run(["squeue", "-h", "-r", "-t", "R", "-j", array, "-o", "%i %A"], capture_output=True, text=True)
            raw = dict(line.split() for line in listed.stdout.splitlines())
            time.sleep(0.5)
        subprocess.run(["scancel", f"{array}_0"], check=True)
        assert exclude.why_stopped(int(raw[f"{array}_0"])) and not exclude.why_stopped(int(raw[f"{array}_1"]))
        # Its element that has the array's id requeues itself (its task's variables): `scontrol requeue ARRAY` was
        # every element's, and put the cancelled sibling back in the queue.
        (element,) = [e for e, r in raw.items() if r == array]
        monkeypatch.setenv("SLURM_JOB_ID", array)
        monkeypatch.setenv("SLURM_ARRAY_JOB_ID", array)
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", element.split("_")[1])
        assert exclude.requeue(int(array)) is None
        for e in raw:
            shown = subprocess.run(["scontrol", "show", "job", "-o", e], capture_output=True, text=True).stdout
            assert f"Restarts={int(e == element)}" in shown, shown
    finally:
        subprocess.run(["scancel", array], check=False)


def test_a_job_requeued_by_another_hand_is_neither_requeued_again_nor_submitted_again(
    slurm_cluster: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cluster that preempts by requeuing and sends the job's signal first (PreemptMode=REQUEUE with
    SlurmctldParameters=preempt_send_user_signal): rank 0 gets USR2, checkpoints, and finds the job requeued by
    Slurm itself (an admin's `scontrol requeue` alike). It said "was preempted" or asked again ("Job is pending
    execution"), and either way told the user to submit the same command again: a second job for one run. Now
    the job's Restarts, past this attempt's SLURM_RESTART_COUNT, says it is back in the queue."""
    from aura_hpc.launch import goodput
    from aura_hpc.slurm import exclude
    from aura_hpc.slurm.job import TrainJob

    monkeypatch.setenv(goodput.LAUNCH_ENV, "")  # the ledger's own variable, put back after the test
    trapped = tmp_path / "trapped"
    sub = ["sbatch", "--parsable", "--requeue", "--time", "10", "--job-name", f"requeued {tmp_path.name}"]
    sub += ["--wrap", f"trap '' TERM; touch {trapped}; sleep 120"]
    job_id = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    sigterm, job_ids = signal.getsignal(signal.SIGTERM), [job_id]
    try:
        deadline = time.monotonic() + 60
        while not trapped.exists():
            assert time.monotonic() < deadline, "the job's script never ran"
            time.sleep(0.2)
        subprocess.run(["scontrol", "requeue", job_id], check=True)  # its processes stop: COMPLETING, Restarts=1
        attempt = TrainJob(str(tmp_path / "config.yaml"))
        attempt.launch = goodput.Launch.of_slurm_job(tmp_path, int(job_id), time.time())
        assert attempt._requeue(int(job_id), 0) is True  # back in the queue: the job's tasks end as requeued
        said = capsys.readouterr().out
        assert "not requeued again" in said and "Restarts=1" in said and "nothing to submit" in said, said
        assert "fix: submit" not in said and "requeuing job" not in said, said
        assert len(attempt.launch.requeues) == 1  # the goodput ledger counts the wait in the queue as a restart
        _wait_for_state(job_id, "PENDING", "the requeued job did not go back to pending")
        # Another hand's requeue landing between the look and the ask: the answer is that it is done.
        assert exclude.requeue(int(job_id)) is None
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        assert "Restarts=1 " in shown, shown
        # Requeued and held (`scontrol requeuehold`, a prolog that failed): it starts again only once released.
        trapped.unlink()
        held = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
        job_ids.append(held)
        while not trapped.exists():
            assert time.monotonic() < deadline + 60, "the second job's script never ran"
            time.sleep(0.2)
        subprocess.run(["scontrol", "requeuehold", held], check=True)
        stopped = exclude.why_stopped(int(held), 0)
        assert stopped.requeued_anyway and "requeued and held" in stopped.why and f"scontrol release {held}" in stopped.then, stopped
        assert not exclude.why_stopped(int(held), 1)  # the attempt that asked for it itself: no other hand
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        subprocess.run(["scancel", *job_ids], check=False)


def test_an_sbatch_that_timed_out_after_queuing_names_the_job(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    """sbatch can say "Socket timed out" after slurmctld queued the job (a busy controller), and "try again in a
    minute" queued a second job for the same run directory. Here a sbatch that says so once the real one queued it."""
    real, fake = shutil.which("sbatch"), tmp_path / "busy_controller"
    fake.mkdir()
    (fake / "sbatch").write_text(
        f'#!/bin/sh\ncase "$*" in *--test-only*) exec {real} "$@";; esac\n{real} "$@" > /dev/null || exit 1\n'
        "echo 'sbatch: error: Batch job submission failed: Socket timed out on send/recv operation' >&2\nexit 1\n"
    )
    (fake / "sbatch").chmod(0o755)
    args = ["submit", *TINY, "--output-dir", str(tmp_path / "runs"), "--run-name", "timed-out", "--set", f"data.path={prepared}"]
    try:
        res = run_cli(args, PATH=f"{fake}:{os.environ['PATH']}")
        queued = subprocess.run(["squeue", "-h", "-n", "aura-timed-out", "-o", "%i"], capture_output=True, text=True).stdout.split()
        assert res.returncode == 2 and len(queued) == 1, res.stdout + res.stderr
        assert f"job(s) {queued[0]} named 'aura-timed-out' are in the queue" in res.stderr, res.stderr
        assert "`python -m aura_hpc cancel ID`" in res.stderr
    finally:
        subprocess.run(["scancel", "-n", "aura-timed-out"], check=False)


def test_a_job_requeued_and_held_is_not_taken_for_ended(slurm_cluster: Path, tmp_path: Path, home: Path) -> None:
    """SPECIAL_EXIT (a requeue held by the cluster's epilog; here `scontrol requeuehold State=SpecialExit`) is a
    pending job kept until released: `cancel` said it had ended, and `submit --wait` took it for ended."""
    from aura_hpc.slurm import submit

    sub = ["sbatch", "--parsable", "--requeue", "--job-name", f"held {tmp_path.name}", "--wrap", "sleep 120"]
    job = subprocess.run(sub, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    try:
        _wait_for_state(job, "RUNNING", "the job never started")
        subprocess.run(["scontrol", "requeuehold", "State=SpecialExit", job], check=True)
        _wait_for_state(job, "SPECIAL_EXIT", "the job was not held in SPECIAL_EXIT")
        [row] = json.loads(run_cli(["status", job, "--json"]).stdout)["jobs"]
        assert row["requeues"] == 1, row  # squeue's RestartCnt: it said 0 until the job had left the queue
        said: list[str] = []
        assert submit.wait([job], poll_s=0.5, printer=said.append) == 1
        assert said and "will not start" in said[0] and f"scontrol release {job}" in said[0], said
        res = run_cli(["cancel", job])
        assert res.returncode == 0, res.stderr
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        assert "JobState=CANCELLED" in shown, shown
    finally:
        subprocess.run(["scancel", job], check=False)


def test_cancel_stops_a_running_job(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    out = tmp_path / "runs"
    args = [
        "submit",
        *TINY,
        "--output-dir",
        str(out),
        "--run-name",
        "cx",
        "--set",
        f"data.path={prepared}",
        "--set",
        "train.max_steps=100000",
    ]
    # sbatch lets SBATCH_* variables override the script's lines: a shell's leftovers gave the planned job 1 minute
    # and no requeue; the plan wins, and says so.
    # Some change the job whatever its lines: SBATCH_ARRAY_INX made 2 copies of one run in one run directory.
    sub = run_cli(args, SBATCH_TIMELIMIT="1", SBATCH_NO_REQUEUE="1", SBATCH_ARRAY_INX="0-1")
    assert sub.returncode == 0 and "SBATCH_TIMELIMIT='1' in this shell would override the script's --time" in sub.stderr
    assert "SBATCH_ARRAY_INX='0-1' in this shell would add --array to the planned job" in sub.stderr, sub.stderr
    run_dir = out / "cx"
    shown = subprocess.run(["scontrol", "show", "job", _job_id(run_dir)], capture_output=True, text=True, check=True).stdout
    assert "TimeLimit=00:10:00" in shown and "Requeue=1" in shown and "ArrayTaskId" not in shown, shown
    # The same run submitted again while its job is queued or running: its config.yaml would be what the first
    # job starts (or restarts) with, and both would train in one folder.
    config = (run_dir / "config.yaml").read_text()
    again = run_cli([*args, "--set", "train.lr=0.01"])
    assert again.returncode == 2 and f"job {_job_id(run_dir)} (" in again.stderr and "is already queued for" in again.stderr, again.stderr
    assert (run_dir / "config.yaml").read_text() == config
    deadline = time.monotonic() + 300
    while _latest_step(run_dir) < 2:
        assert time.monotonic() < deadline, _job_evidence(run_dir, _job_id(run_dir))
        time.sleep(0.2)
    # An old job.json whose id Slurm has since given to another job (ids restart; clusters share output_dirs).
    recorded = (run_dir / "job.json").read_text()
    (run_dir / "job.json").write_text(json.dumps({**json.loads(recorded), "job_name": "aura-an-older-run"}))
    stale = run_cli(["cancel", str(run_dir)])
    assert stale.returncode == 2 and "it is another job now, not cancelled" in stale.stderr, stale.stderr
    (run_dir / "job.json").write_text(recorded)
    res = run_cli(["cancel", str(run_dir)])
    assert res.returncode == 0, res.stderr
    job = _job_id(run_dir)
    _wait_gone(job)
    log = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    assert "requeuing job" not in log, "a cancel must not requeue"


def test_a_job_that_fits_once_a_drained_node_returns_is_queued_to_wait_and_an_impossible_one_is_refused(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path
) -> None:
    """`sbatch --test-only` leaves down and drained nodes out, and says "Requested node configuration is not
    available" for a job of all 4 nodes with n4 drained, as for one of 5: the first was refused, and plain sbatch
    queues it to start when n4 returns. What even every node of the partition could not hold is still refused."""
    out = tmp_path / "runs"
    base = ["submit", *TINY[2:], "--output-dir", str(out), "--set", f"data.path={prepared}", "--set", "train.max_steps=1"]
    deadline = time.monotonic() + 60  # n4 idle first: drained under an earlier test's job it is `drng`
    while subprocess.run(["squeue", "-h", "-w", "n4", "-o", "%i"], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "n4 never became idle"
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", "nodename=n4", "state=drain", "reason=aura-test"], check=True)
    job = ""
    try:
        for name, extra in (("five", ["--nodes", "5"]), ("wide", ["--nodes", "4", "--set", "slurm.cpus_per_task=3"])):
            refused = run_cli([*base, *extra, "--run-name", name])
            assert refused.returncode == 2 and "Requested node configuration is not available" in refused.stderr, (
                refused.stdout + refused.stderr
            )
            assert "fix:" in refused.stderr and not (out / name).exists(), refused.stderr
        queued = run_cli([*base, "--nodes", "4", "--run-name", "four"])
        said = queued.stdout + queued.stderr
        assert queued.returncode == 0, said
        job = re.search(r"submitted job (\d+)", queued.stdout).group(1)  # type: ignore[union-attr]
        assert re.search(r"no 4 node\(s\) of the partition can take this job now: n4 \(dr(ain|ng)\) would, once up again", said), said
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        assert state == "PENDING", state
    finally:
        if job:
            subprocess.run(["scancel", job], check=False)
        subprocess.run(["scontrol", "update", "nodename=n4", "state=resume"], check=False, capture_output=True)


def test_a_node_holds_a_job_by_its_gpus_of_the_type_asked_its_memory_cpus_and_features() -> None:
    """What is judged of the partition's nodes, their state aside (sinfo's %G, %m, %c, %f), for a job Slurm finds no
    room for now; an expression of features Slurm alone reads is not judged here."""
    from aura_hpc.config.tree import SlurmConfig
    from aura_hpc.slurm.node_room import Node, _gpus, holds

    assert _gpus("gpu:h100:8(S:0-1),gpu:a100:2") == {"h100": 8, "a100": 2} and _gpus("gpu:4") == {"": 4} and _gpus("(null)") == {}
    node = Node("g1", "drain", 64, 512000, _gpus("gpu:h100:8(S:0-1)"), {"ib", "h100"})
    assert holds(node, SlurmConfig(gpus_per_node=8, gpu_type="h100", mem="500G", constraint="ib&h100", cpus_per_task=8), 8)
    assert not holds(node, SlurmConfig(gpus_per_node=8, gpu_type="a100"), 8)
    assert not holds(node, SlurmConfig(gpus_per_node=16), 16)
    assert not holds(node, SlurmConfig(gpus_per_node=8, mem="1T"), 8)
    assert not holds(node, SlurmConfig(gpus_per_node=8, cpus_per_task=9), 8)
    assert not holds(node, SlurmConfig(gpus_per_node=8, constraint="ib&a100"), 8)
    assert holds(node, SlurmConfig(gpus_per_node=8, constraint="a100|h100", mem="0"), 8)
    assert not node.usable and Node("g2", "idle*", 64, 0, {}, set()).usable is False and Node("g3", "mix", 64, 0, {}, set()).usable


def test_submit_check_runs_check_on_every_node(slurm_cluster: Path, tmp_path: Path, home: Path) -> None:
    res = run_cli(["submit", "--check", "--nodes", "2", "--gpus", "0", "--time", "5", "--output-dir", str(tmp_path / "runs")], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified on every rank" in res.stdout and "is the same directory on all 2 nodes" in res.stdout, res.stdout


def test_unreachable_slurmctld_is_a_clear_error(slurm_cluster: Path, tmp_path: Path, home: Path) -> None:
    conf = tmp_path / "slurm.conf"
    text = slurm_cluster.read_text()
    conf.write_text(re.sub(r"^SlurmctldPort=\d+", "SlurmctldPort=1", text, flags=re.M) + "MessageTimeout=2\n")
    res = run_cli(["status", "123"], SLURM_CONF=str(conf), timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "slurmctld is not reachable" in res.stderr and "fix:" in res.stderr, res.stderr
    overview = run_cli(["status"], SLURM_CONF=str(conf), timeout=120, cwd=tmp_path)
    assert overview.returncode == 0 and "slurmctld is not reachable" in overview.stdout, overview.stdout + overview.stderr
    # The accounting database down, the controller up: `history` named slurmctld and `scontrol ping`, which says all is well.
    nodb = tmp_path / "slurm-nodb.conf"
    nodb.write_text(re.sub(r"^AccountingStoragePort=\d+", "AccountingStoragePort=1", text, flags=re.M))
    history = run_cli(["history"], SLURM_CONF=str(nodb), timeout=120)
    assert history.returncode == 2 and "slurmdbd, the job accounting database, is not reachable" in history.stderr, history.stderr
    assert "sacctmgr ping" in history.stderr and "slurmctld" not in history.stderr, history.stderr


@pytest.mark.parametrize("command", [["status", "123"], ["history"], ["cancel", "123"]])
def test_no_slurm_configuration_is_named_at_once(command: list[str], tmp_path: Path, home: Path) -> None:
    if shutil.which("squeue") is None:
        pytest.skip("needs Slurm's client commands")
    t0 = time.perf_counter()
    res = run_cli(command, SLURM_CONF=str(tmp_path / "nowhere" / "slurm.conf"), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no Slurm configuration is reachable" in res.stderr and "SLURM_CONF=" in res.stderr, res.stderr
    assert time.perf_counter() - t0 < 45, "Slurm's own 60 s retry loop was not waited out"


def test_slurms_clients_without_a_readable_configuration_say_which_in_one_line(tmp_path: Path, home: Path) -> None:
    """Debian's slurm-client with no slurm.conf looks for a configless controller (DNS SRV records, then a fetch) and
    logs each step before its fatal line: `status` beside a laptop's local runs quoted four lines of Slurm's internals
    in its note, each prefixed twice ("squeue: squeue: error: resolve_ctls_from_dns_srv: ..."). A slurm.conf Slurm
    could not parse was called unreachable, with no slurm.conf."""
    if shutil.which("squeue") is None:
        pytest.skip("needs Slurm's client commands")
    broken = tmp_path / "slurm.conf"
    broken.write_text("ClusterName=x\nSlurmctldHost=localhost\nFooBar=1\n")
    res = run_cli(["status", "123"], SLURM_CONF=str(broken), timeout=120)
    assert res.returncode == 2 and "unrecognized key: FooBar fatal: Unable to process configuration file" in res.stderr, res.stderr
    assert "(fix: Slurm could not read its slurm.conf" in res.stderr and "not reachable" not in res.stderr, res.stderr
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a slurm.conf, which Slurm reads without SLURM_CONF")
    env = cli_env()
    env.pop("SLURM_CONF", None)
    fix = "(fix: no Slurm configuration is reachable from this machine"
    said = {}
    for command in ("status", "history"):
        said[command] = subprocess.run(
            [sys.executable, "-m", "aura_hpc", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
    status, history = said["status"], said["history"]
    assert status.returncode == 0 and history.returncode == 2, status.stdout + status.stderr + history.stderr
    note = [line for line in status.stdout.splitlines() if line.startswith("no Slurm jobs:")]
    assert len(note) == 1 and note[0].startswith(f"no Slurm jobs: squeue: fatal: Could not establish a configuration source {fix}"), note
    assert history.stderr.startswith(f"error: sacct: fatal: Could not establish a configuration source {fix}"), history.stderr
    for text in (note[0], history.stderr):
        assert "dns_srv" not in text and "fetch_config" not in text and "squeue: squeue:" not in text and "sacct: sacct:" not in text, text


def test_submit_without_a_slurm_configuration_is_named_at_once(tmp_path: Path, home: Path) -> None:
    """submit's sbatch --test-only waited out Slurm's 60 s retry loop first (59.5 s measured)."""
    if shutil.which("sbatch") is None:
        pytest.skip("needs Slurm's client commands")
    t0 = time.perf_counter()
    res = run_cli(["submit", "--output-dir", str(tmp_path / "runs")], SLURM_CONF=str(tmp_path / "nowhere" / "slurm.conf"), timeout=90)
    assert res.returncode == 2 and "no Slurm configuration is reachable" in res.stderr, res.stdout + res.stderr
    assert time.perf_counter() - t0 < 45 and not (tmp_path / "runs").exists()


def test_a_sharded_strategy_requeues_and_resumes_from_its_shards(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    """FSDP: the requeued job resumes from its own shards (DCP) and ends equal to its uninterrupted twin.
    ZeRO's resume from DeepSpeed's shards: a killed rank in tests/test_strategies.py."""
    runs = []
    for strategy in ("fsdp",):
        out = tmp_path / strategy
        common = [*TINY, "--output-dir", str(out), "--set", f"data.path={prepared}", "--set", "train.max_steps=150"]
        common += ["--set", "train.checkpoint_every=100", "--set", f"dist.strategy={strategy}", "--set", "train.precision=fp32"]
        runs.append((common, out))
    requeued = _requeued_beside_a_reference(runs, timeout=420)
    for strategy, (run_dir, job, _), (_, out) in zip(("fsdp",), requeued, runs, strict=True):
        log = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
        said = "stop requested (SIGUSR2)" in log or "stop requested (signal on another rank)" in log
        assert f"strategy: {strategy}" in log and said and f"requeuing job {job}" in log, log[-3000:]
        m = re.search(r"resumed from checkpoint step_(\d+) at step (\d+)", log)
        assert m and 20 <= int(m.group(2)) < 150, log[-3000:]
        resumed_from = run_dir / "checkpoints" / f"step_{int(m.group(1)):08d}"
        assert not resumed_from.exists() or (resumed_from / "sharded").is_dir()
        _ends_equal_to_the_straight_run(run_dir, out, strategy)


def test_a_job_whose_output_dir_is_gone_on_the_nodes_is_explained(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    # A short job to wait for, so the run directory can vanish (as an unmounted NFS) before ours starts.
    first = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 3"], capture_output=True, text=True, check=True)
    out = tmp_path / "runs"
    args = ["submit", *TINY, "--output-dir", str(out), "--run-name", "gone", "--set", f"data.path={prepared}"]
    res = run_cli([*args, "--after", first.stdout.strip().split(";")[0]])
    assert res.returncode == 0, res.stderr
    job = _job_id(out / "gone")
    shutil.rmtree(out / "gone")
    _wait_gone(job)
    st = run_cli(["status", job, "--json"])
    assert st.returncode == 0, st.stderr
    said = json.loads(st.stdout)
    assert said["jobs"][0]["state"] == "FAILED", said
    assert any("failed before any rank started" in n and "could not launch its tasks on" in n for n in said["notes"]), said
    assert any("output_dir is not mounted" in n for n in said["notes"]), said
    logs = run_cli(["logs", job])
    assert logs.returncode == 2 and "does not exist on this machine" in logs.stderr and "not mounted" in logs.stderr, logs.stderr


def test_a_wait_on_a_job_whose_dependency_failed_ends_with_the_fix(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    """afterok on a job that fails leaves ours PENDING (DependencyNeverSatisfied) for ever where the site does not
    set kill_invalid_depend: `submit --wait` waited with it."""
    failing = ["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 3; false"]
    first = subprocess.run(failing, capture_output=True, text=True, check=True)
    first_id = first.stdout.strip().split(";")[0]
    out = tmp_path / "runs"
    args = ["submit", *TINY, "--output-dir", str(out), "--run-name", "never", "--set", f"data.path={prepared}", "--after", first_id]
    res = run_cli([*args, "--wait"], timeout=240)
    job = _job_id(out / "never")
    try:
        said = res.stdout + res.stderr
        assert res.returncode != 0 and f"job {job} will never start: the job it waits for (--after)" in said, said
        assert f"python -m aura_hpc cancel {job}" in said
        # `logs` of a job that never wrote one: it said "may still be pending" even once the job had ended.
        logs = run_cli(["logs", job])
        assert logs.returncode == 0 and f"job {job} is PENDING (DependencyNeverSatisfied)" in logs.stdout, logs.stdout
        run_cli(["cancel", job])
        _wait_gone(job)
        logs = run_cli(["logs", job], timeout=120)
        assert logs.returncode == 0 and f"job {job} ended CANCELLED without writing it" in logs.stdout, logs.stdout
    finally:
        run_cli(["cancel", job])


def test_a_held_job_is_one_that_never_starts_unless_released(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    """Only a failed dependency and a held launch were known: `--wait` and `logs -f` waited for ever on a job held
    by its user (or over its partition's limits), and on a job submitted `--after` it (pending for "Dependency")."""
    from aura_hpc.slurm import query
    from aura_hpc.slurm.submit import never_starts

    held = subprocess.run(
        ["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"], capture_output=True, text=True, check=True
    )
    job = held.stdout.strip().split(";")[0]
    out, after = tmp_path / "runs", ""
    try:
        row = query.squeue_job(job)
        assert row is not None and row.state == "PENDING", row
        said = never_starts(row)
        assert f"job {job} will not start: it is held" in said and f"`scontrol release {job}`" in said, (row, said)
        args = ["submit", *TINY, "--output-dir", str(out), "--run-name", "after", "--set", f"data.path={prepared}", "--after", job]
        waited = run_cli([*args, "--wait"], timeout=120)
        after = _job_id(out / "after")
        behind = f"job {after} waits for job {job}: job {job} will not start: it is held"
        said = waited.stdout + waited.stderr
        assert waited.returncode == 1 and behind in said and f"job {after} still queued; the wait ends here" in said, said
        followed = run_cli(["logs", after, "--follow"], timeout=120)
        assert followed.returncode == 2 and behind in followed.stderr, followed.stdout + followed.stderr
        for shown in (run_cli(["status", after]), run_cli(["status"])):  # the job, and the table of them all
            assert shown.returncode == 0 and " ".join(behind.split()) in " ".join(shown.stdout.split()), shown.stdout + shown.stderr
    finally:
        subprocess.run(["scancel", job, *([after] if after else [])], check=False)


def test_the_nodes_to_leave_out_are_judged_before_the_requeue_is_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After `scontrol requeue`, KillWait (30 s) is left before SIGKILL; the judgement's Slurm queries (30 s each at
    most on a busy controller) came after it, and the node was not left out. Only the update follows the requeue."""
    from types import SimpleNamespace

    from aura_hpc.ops import excluded_nodes
    from aura_hpc.slurm import exclude
    from aura_hpc.slurm.job import TrainJob

    excluded_nodes.record(tmp_path, "n3", "rank 1 hung there")
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "1234", "min_nodes": 3}))  # a running job's NumNodes is 4
    order: list[str] = []
    room = exclude._Room(["n3"], ["n1", "n2", "n4"], 3, "debug", "")
    monkeypatch.setattr(exclude, "_judge", lambda job_id, nodes, least: (order.append(f"judge least={least}"), (room, ""))[1])
    monkeypatch.setattr(exclude, "outlive_the_requeue", lambda: None)
    monkeypatch.setattr(exclude, "requeue", lambda job_id: order.append("requeue"))
    monkeypatch.setattr(exclude, "_scontrol", lambda *a: (order.append(" ".join(a)), subprocess.CompletedProcess(a, 0, "", ""))[1])
    job = TrainJob(str(tmp_path / "config.yaml"), max_requeues=3)
    job.launch = SimpleNamespace(requeued=lambda at: None)  # type: ignore[assignment]
    assert job._requeue(1234, 0)
    # Whether the job was cancelled is asked first: a cancel is not undone.
    assert order == ["show job -o 1234", "judge least=3", "requeue", "update JobId=1234 ExcNodeList=n3"], order
    # A controller too busy to answer within the budget: the requeue goes first, with the job's nodes, and says so.
    order.clear()
    monkeypatch.setattr(exclude, "JUDGE_BUDGET_S", 0.2)
    monkeypatch.setattr(exclude, "_judge", lambda job_id, nodes, least: (time.sleep(5), (room, ""))[1])
    said: list[str] = []
    assert exclude.judge_before_requeue(1234, tmp_path, said.append) is None
    assert said == ["not leaving out n3 (rank 1 hung there): Slurm did not say which nodes are spare within 0 s (a busy controller)"], said
    # A judgement that fails in an unforeseen way is said as such, at once, not as a controller too busy.
    monkeypatch.setattr(exclude, "JUDGE_BUDGET_S", 20.0)
    monkeypatch.setattr(exclude, "_judge", lambda job_id, nodes, least: {}["NumNodes"])
    said.clear()
    t0 = time.monotonic()
    assert exclude.judge_before_requeue(1234, tmp_path, said.append) is None and time.monotonic() - t0 < 10
    assert said == ["not leaving out n3 (rank 1 hung there): Slurm could not be asked which nodes are spare (KeyError: 'NumNodes')"], said


def test_a_wait_on_a_sweep_asks_squeue_once_a_pass_for_all_its_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit --sweep ... --wait` asked squeue once per point every second (100 points: 100 requests a second to
    slurmctld, the load sites ban); one call a pass covers them all."""
    from aura_hpc.slurm import query, submit

    calls: list[list[str]] = []

    def squeue(job_ids: list[str] | None = None, all_users: bool = False, all_states: bool = False) -> list:
        calls.append(list(job_ids or []))
        return [query.JobRow(j, "aura-sweep", "COMPLETED", "1", "0:30") for j in job_ids or []]

    monkeypatch.setattr(query, "squeue", squeue)
    monkeypatch.setattr(query, "sacct", lambda *a, **k: [])
    assert submit.wait(["7_0", "7_1", "7_2"], printer=lambda line: None) == 0
    assert calls == [["7_0", "7_1", "7_2"]], calls
    # Elements still pending are one row of their array (7_[1-5:2,8%2]): each is found in it, not taken for ended.
    pending = [
        query.JobRow("7_[1-5:2,8%2]", "aura-sweep", "PENDING", "1", "0:00"),
        query.JobRow("7_0", "aura-sweep", "RUNNING", "1", "0:09"),
    ]
    monkeypatch.setattr(query, "squeue", lambda *a, **k: pending)
    found = query.squeue_jobs(["7_0", "7_1", "7_3", "7_4", "7_8"])
    assert {j: r.state if r else None for j, r in found.items()} == {
        "7_0": "RUNNING",
        "7_1": "PENDING",
        "7_3": "PENDING",
        "7_4": None,
        "7_8": "PENDING",
    }
    assert found["7_3"] is not None and found["7_3"].job_id == "7_3"


def test_the_jobs_index_appends_under_a_lock_that_never_blocks_a_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_APPEND alone is not atomic on NFS (where ~/.aura_hpc is on a cluster): two login nodes' submits wrote at
    one offset. Appends wait for another submit's lock, a few seconds at most, then append as before."""
    import sys

    from aura_hpc.slurm import index

    monkeypatch.setenv("AURA_HPC_HOME", str(tmp_path))
    index.record("1", tmp_path / "a", "aura-a", "now")
    holder = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)"
    )
    other = subprocess.Popen([sys.executable, "-c", holder, str(index.index_path())], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        index.record("2", tmp_path / "b", "aura-b", "now")
        assert time.monotonic() - t0 > 0.5  # it waited for the other submit's append
    finally:
        other.wait(10)
    assert [e["job_id"] for e in index.entries()] == ["1", "2"]
    other = subprocess.Popen(
        [sys.executable, "-c", holder.replace("1.5", "60"), str(index.index_path())], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        index.record("3", tmp_path / "c", "aura-c", "now")  # a lock never let go: appended all the same, in seconds
        assert time.monotonic() - t0 < 30
    finally:
        other.kill()
        other.wait()
    assert [e["job_id"] for e in index.entries()] == ["1", "2", "3"]


def test_a_failed_sweep_point_with_logs_in_the_sweeps_folder_is_not_said_to_have_failed_at_launch(tmp_path: Path) -> None:
    """A sweep's logs are in the sweep's slurm/ folder (job.json's log_dir), not under its point's run directory:
    every failed point of a sweep was said to have failed before any rank started (output_dir not mounted)."""
    from aura_hpc.slurm.commands import _failed_at_launch
    from aura_hpc.slurm.query import JobRow

    (tmp_path / "slurm").mkdir()
    (tmp_path / "lr0.001").mkdir()
    row = JobRow("1234_1", "aura-sweep", "FAILED", "1", "0:10", exit_code="1:0")
    assert _failed_at_launch(row, tmp_path / "lr0.001", tmp_path / "slurm") is not None  # no log at all: said
    (tmp_path / "slurm" / "1234_1_0_log.err").write_text("Traceback (most recent call last):\n")
    assert _failed_at_launch(row, tmp_path / "lr0.001", tmp_path / "slurm") is None


def test_prepare_as_a_slurm_array_gives_the_tokens_of_a_local_prepare(slurm_cluster: Path, tmp_path: Path, home: Path) -> None:
    """A tokenizer job, an array of 2 encode tasks and a finish job: the same shards as one machine
    with one worker (that a stopped build redoes only its unfinished pieces: test_prepare.py)."""
    from aura_hpc.data.corpus import generate
    from aura_hpc.data.prepare import PrepareSpec, prepare, read_manifest

    text = tmp_path / "corpus.txt"
    text.write_text(generate(900, seed=1), encoding="utf-8")
    args = ["prepare", str(text), "--vocab-size", "400", "--shard-mb", "0.02"]
    out = tmp_path / "shared" / "es"
    r = run_cli([*args, "--out", str(out), "--submit", "--nodes", "2", "--workers", "2", "--time", "10", "--wait"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "array job" in r.stdout and "prepared " in r.stdout
    local = prepare(PrepareSpec(out_dir=tmp_path / "local", inputs=[str(text)], vocab_size=400, shard_mb=0.02))
    m = read_manifest(out)
    assert m is not None and m["pieces"] >= 4 and m["data_sha256"] == local["data_sha256"]
    logs = out.parent / ".es.slurm"
    tasks = [f.read_text() for f in logs.glob("*_*_0_log.out")]
    assert len(tasks) == 2, "the array ran 2 encode tasks"
    # Nothing of the build is left beside the prepared directory but the logs.
    assert sorted(p.name for p in out.parent.iterdir()) == [".es.slurm", "es"]


def test_a_prepare_whose_tokenizer_job_failed_ends_its_wait_on_a_cluster_without_accounting(
    slurm_cluster: Path, tmp_path: Path, home: Path
) -> None:
    """submitit's watcher asks the accounting alone: where there is none, the finish job cancelled before it wrote
    its result (the tokenizer job failed, and kill_on_invalid_dep cancelled the rest) kept `prepare --submit
    --wait` waiting for ever. The queue says the job ended; the wait names the job that failed and its last words
    (submitit's error ended on the log's path). The chain waits behind a job that holds every node meanwhile."""
    no_accounting = tmp_path / "no_accounting"
    no_accounting.mkdir()
    (no_accounting / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (no_accounting / "sacct").chmod(0o755)
    text = tmp_path / "corpus.txt"
    with _prepare_behind_a_blocker(text, tmp_path / "shared" / "es", PATH=f"{no_accounting}:{os.environ['PATH']}") as (
        jobs,
        blocker,
        waiting,
    ):
        text.unlink()  # the tokenizer job, still pending, will not find its input
        subprocess.run(["scancel", blocker], check=True)
        said = waiting.communicate(timeout=180)[0]
    assert waiting.returncode == 2, said
    assert (
        f"prepare job {jobs[-1]} did not end with its result (CANCELLED; job {jobs[0]} failed: aura_hpc.errors.DataError: input" in said
    ), said
    assert "corpus.txt" in said and "fix: see the logs" in said, said


def test_a_prepare_whose_tokenizer_job_is_held_ends_its_wait_naming_it(slurm_cluster: Path, tmp_path: Path, home: Path) -> None:
    """The finish job of a prepare chain whose tokenizer job is held is pending for "Dependency", as it is while
    the tokenizer job waits for nodes: `prepare --submit --wait` waited for ever. The wait follows the chain
    (finish -> encode array -> tokenizer) in its one squeue a pass and ends naming the held job and its fix;
    `submit --after` waits the same way."""
    text = tmp_path / "corpus.txt"
    with _prepare_behind_a_blocker(text, tmp_path / "shared" / "es") as (jobs, _, waiting):
        tokenizer, encode, finish = jobs
        subprocess.run(["scontrol", "uhold", tokenizer], check=True)  # as its user would (root's `hold` is an admin's)
        said = waiting.communicate(timeout=60)[0]
        state = subprocess.run(["squeue", "-h", "-j", finish, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        table = " ".join(run_cli(["status", "--all"]).stdout.split())  # the array's pending element is one row, 12_[0]
    assert waiting.returncode == 2, said
    chain = f"job {finish} waits for job {encode}: job {encode} waits for job {tokenizer}: job {tokenizer} will not start"
    assert f"prepare {chain}" in said and f"(fix: `scontrol release {tokenizer}` lets it start" in said, said
    assert chain in table, table
    assert state == "PENDING", "the wait ended, not the jobs: released, the chain runs"


def test_a_held_job_released_while_the_others_run_is_waited_for_again(slurm_cluster: Path) -> None:
    """A watch of several jobs (a sweep's points) said a held one would not start and took it as ended: released
    while the others still ran, it completed, and the wait still ended saying it was queued, with exit status 1."""
    import threading

    from aura_hpc.slurm import submit

    def sbatch(*args: str) -> str:
        return subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args], capture_output=True, text=True, check=True).stdout.strip()

    held, running = sbatch("--hold", "--wrap", "true"), sbatch("--wrap", "sleep 8")
    release = threading.Timer(1.5, lambda: subprocess.run(["scontrol", "release", held], check=True))
    printed: list[str] = []
    release.start()
    try:
        final = submit.watch([held, running], printer=printed.append, poll_s=0.3)
    finally:
        release.cancel()
        subprocess.run(["scancel", held, running], check=False)
    assert [row.state if row else None for row in final.values()] == ["COMPLETED", "COMPLETED"], (final, printed)
    assert sum(f"job {held} will not start: it is held" in line for line in printed) == 1, printed
    assert submit.exit_status(final) == 0


def test_a_job_submitted_from_inside_an_array_element_is_its_own(slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path) -> None:
    """A shell inside a job holds that job's SLURM_* variables, and sbatch passed them to the job submitted from it:
    from an array element (a workflow's step, a sweep of scripts), submitit took the new job for that element and
    failed after waiting 60 s for its pickle. `submit` leaves them out (saying so), and the job runs as itself."""
    out = tmp_path / "runs"
    inner = [sys.executable, "-m", "aura_hpc", "submit", *TINY[2:], "--nodes", "1", "--output-dir", str(out), "--run-name", "inner"]
    inner += ["--set", f"data.path={prepared}", "--set", "train.max_steps=2", "--wait"]
    log = tmp_path / "outer.out"
    outer = subprocess.run(
        ["sbatch", "--parsable", "--array=0", "-N1", "-o", str(log), "--wrap", shlex.join(inner)],
        capture_output=True, text=True, check=True, env=cli_env(), cwd=tmp_path,
    ).stdout.strip()  # fmt: skip
    deadline = time.monotonic() + 240
    while subprocess.run(["squeue", "-h", "-j", outer], capture_output=True, text=True).stdout.strip():  # 123_[0], then 123_0
        assert time.monotonic() < deadline, f"job {outer} still queued after 240 s"
        time.sleep(0.5)
    said = log.read_text()
    job = _job_id(out / "inner")
    assert f"this shell is inside Slurm job {outer}_0: its " in said and f"job {job} ended: COMPLETED" in said, said
    ran = (out / "inner" / "slurm" / f"{job}_0_log.out").read_text()
    assert f"Starting with JobEnvironment(job_id={job}," in ran, ran[-2000:]


def test_a_dependency_names_the_jobs_it_waits_for_as_squeue_shows_them() -> None:
    """squeue's Dependency field (Slurm 22.05's own strings): `,` needs each job, `?` any one; an array's `_*` is
    the array's own id; a singleton in an OR may pass without any job, an OR's failed part is out of it, and an
    aftercorr (element by element) is not judged."""
    from aura_hpc.slurm.query import waits_for

    assert waits_for("afterok:2(unfulfilled)") == (["2"], False)
    assert waits_for("afterok:3_*(unfulfilled)") == (["3"], False)
    assert waits_for("afterok:3_1(unfulfilled),afterany:2+5(unfulfilled)") == (["3_1", "2"], False)
    assert waits_for("afterok:3_1(unfulfilled)?afterany:2(unfulfilled)") == (["3_1", "2"], True)
    assert waits_for("afterok:3_1(unfulfilled)?afterany:2(unfulfilled)?singleton(unfulfilled)") == ([], True)
    assert waits_for("singleton(unfulfilled)") == ([], False)
    assert waits_for("afterok:1(failed)?afterok:2(unfulfilled)") == (["2"], True)
    assert waits_for("aftercorr:3_*(unfulfilled)?afterok:2(unfulfilled)") == ([], True)
    assert waits_for("aftercorr:3_*(unfulfilled),afterok:2(unfulfilled)") == (["2"], False)


@contextlib.contextmanager
def _prepare_behind_a_blocker(text: Path, out: Path, **env: str) -> Iterator[tuple[list[str], str, subprocess.Popen[str]]]:
    """`prepare --submit --wait` of a small corpus while a job holds every node: (its tokenizer, encode array and
    finish job ids, the blocker's, the waiting CLI). Every job is cancelled, and the CLI killed, on the way out."""
    from aura_hpc.data.corpus import generate

    text.write_text(generate(300, seed=2), encoding="utf-8")
    args = ["prepare", str(text), "--vocab-size", "400", "--out", str(out), "--submit", "--nodes", "1", "--time", "10", "--wait"]
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-N4", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 600"], capture_output=True, text=True, check=True
    ).stdout.strip()
    jobs: list[str] = []
    waiting: subprocess.Popen[str] | None = None
    try:
        _wait_for_state(blocker, "RUNNING", "the job that holds every node did not start")
        waiting = subprocess.Popen(
            [sys.executable, "-m", "aura_hpc", *args], env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        logs, deadline = out.parent / f".{out.name}.slurm", time.monotonic() + 120
        while len(jobs := [str(j) for j in sorted({int(p.name.split("_")[0]) for p in logs.glob("*_submitted.pkl")})]) < 3:
            assert time.monotonic() < deadline and waiting.poll() is None, "the three prepare jobs were not submitted"
            time.sleep(0.2)
        yield jobs, blocker, waiting
    finally:
        if waiting is not None and waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
        subprocess.run(["scancel", blocker, *jobs], check=False)


def test_a_stopped_rank_of_a_two_node_job_is_named_by_its_nodes_watchdog_and_the_job_requeued(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path
) -> None:
    """Rank 1 (node 2) stops after step 12 of a 2-node job: the watchdog beside that node's task names it
    within 40 s of its last step (a 10 s floor: the defaults' 30 s, named within a minute, are the single-node
    test's in test_faults.py; the watchdog is the same), keeps the stacks in the shared run directory,
    requeues the job and kills the node's ranks; the requeued job resumes from step 10 and ends with the
    bits of the same job never stopped (beside it)."""
    out = tmp_path / "runs"
    common = [*TINY, "--output-dir", str(out), "--set", f"data.path={prepared}", "--set", "train.max_steps=20"]
    common += ["--set", "train.checkpoint_every=5"]
    straight = run_cli(["submit", *common, "--run-name", "straight"])
    # The other node's rank waits in a collective that times out after 20 s (NCCL's, on GPUs): its task fails and
    # --kill-on-bad-exit ends the step while this node's watchdog still waits for that node's evidence (kept late here).
    # The watchdog got SIGTERM and left: the job ended FAILED, not requeued. It now acts within Slurm's KillWait.
    hung_args = [*common, "--run-name", "hung", "--set", "health.hang_step_floor_s=10", "--set", "dist.timeout_s=20"]
    hung = run_cli(["submit", *hung_args], AURA_FAULT_STOP="1:12", AURA_FAULT_PEER_RECORDS_LATE_S="60")
    assert straight.returncode == 0 and hung.returncode == 0, straight.stderr + hung.stderr
    job, run_dir = _job_id(out / "hung"), out / "hung"
    _wait_gone(job, timeout=420)
    _wait_gone(_job_id(out / "straight"))
    log1 = (run_dir / "slurm" / f"{job}_1_log.out").read_text()
    log0 = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    stopped_at = float(re.search(r"SIGSTOP rank 1 after step 12 at ([\d.]+)", log1).group(1))
    [record] = [json.loads(p.read_text()) for p in (run_dir / "hangs").glob("*/hang.json") if json.loads(p.read_text())["culprits"]]
    assert record["culprits"] == [1] and record["declared_at"] - stopped_at <= 40, record
    # Named by Slurm's node name: the test cluster's two slurmd share one host (and /dev/shm), and each
    # node's watchdog watches its own ranks only (node 1 saw its rank 0 wait for a peer).
    assert re.fullmatch(r"n\d+", record["host"]) and set(record["ranks"]) == {"1"}, record
    # The other node's rank only waited; its stack was kept before the requeue ended it.
    [waited] = [f.read_text() for f in (run_dir / "hangs").glob("*/rank0.txt")]
    assert "most recent call first" in waited and "aura_hpc/train/worker.py" in waited, waited
    assert f"[watchdog] hang: rank 1 on {record['host']} " in log1, log1[-3000:]
    # The requeued job left that node out (the test cluster has 4 nodes for 2 jobs of 2) and ran without it.
    assert f"the requeued job leaves out {record['host']} (rank 1 hung there)" in log1, log1[-3000:]
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
    ran_on = subprocess.run(["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True, text=True).stdout.split()
    assert fields["ExcNodeList"] == record["host"] and record["host"] not in ran_on and len(ran_on) == 2, shown
    assert "[watchdog] hang: rank 1 on " in log1 and "did not answer" in log1 and f"requeuing job {job} after the hang" in log1, log1[
        -3000:
    ]
    assert "the job step is ending (SIGTERM" in log1, log1[-3000:]
    # From step 10, or from the checkpoint rank 0 writes when the requeue's signal reaches it while it waits:
    # on a loaded machine rank 1 stops a step or two after the step its line names (reports are read one step
    # late), and both ranks had completed those steps (a CI run resumed at 14). The end is bit-identical either way.
    resumed = re.search(r"resumed from checkpoint step_(\d+) at step (\d+)", log0)
    assert resumed and int(resumed.group(1)) == int(resumed.group(2)) and 10 <= int(resumed.group(2)) <= 15, log0[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["goodput"]["seconds"]["hangs"] >= 8, summary[
        "goodput"
    ]  # the 10 s floor, less the step in flight
    assert abs(summary["goodput"]["seconds"]["other"]) <= 0.02 * summary["goodput"]["wall_s"], summary["goodput"]
    _ends_equal_to_the_straight_run(run_dir, out, "hang requeue")


def test_spare_nodes_a_job_may_start_on_fewer_and_a_requeue_leaves_bad_nodes_out_only_while_spares_remain(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path
) -> None:
    """--nodes 1:2 with 3 of the 4 nodes taken: the job starts on the one left, with world size 1, and
    trains to the end. Then, on a pending job (Slurm lets only a pending job's excluded nodes change,
    which is what a requeue makes it): the kept nodes are left out while 2 usable nodes remain for its 2,
    and not at all once they would not (the line says why and the fix). The requeue right after a hang:
    test_a_stopped_rank_of_a_two_node_job_is_named_by_its_nodes_watchdog_and_the_job_requeued."""
    from aura_hpc.ops import excluded_nodes
    from aura_hpc.slurm import exclude

    out = tmp_path / "runs"
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-N", "3", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 300"], capture_output=True, text=True
    )
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 240  # scheduling on busy cores
        while subprocess.run(["squeue", "-h", "-j", blocker_id, "-o", "%T"], capture_output=True, text=True).stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "the 3 nodes were never taken"
            time.sleep(0.3)
        args = ["submit", *TINY, "--nodes", "1:2", "--output-dir", str(out), "--run-name", "spare", "--set", f"data.path={prepared}"]
        args += ["--set", "train.max_steps=8"]
        dry = run_cli([*args, "--dry-run"])
        assert dry.returncode == 0 and "#SBATCH --nodes=1-2" in dry.stdout, dry.stdout + dry.stderr
        assert "tasks: 1-2 node(s) x 1 task(s) = world size 1-2" in dry.stdout, dry.stdout
        res = run_cli([*args, "--wait"], timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        log = (out / "spare" / "slurm" / f"{_job_id(out / 'spare')}_0_log.out").read_text()
        assert "world_size=1 " in log and json.loads((out / "spare" / "summary.json").read_text())["step"] == 8, log[-3000:]
        bad = run_cli(["submit", *TINY, "--nodes", "3:2", "--output-dir", str(out), "--dry-run"])
        assert bad.returncode == 2 and "slurm.min_nodes (3) must be between 1 and slurm.nodes (2)" in bad.stderr, bad.stderr
    finally:
        subprocess.run(["scancel", blocker_id], check=False)

    hold = ["sbatch", "--parsable", "--hold", "-N", "2", "-o", "/dev/null", "--wrap", "true"]
    held = subprocess.run(hold, capture_output=True, text=True)
    assert held.returncode == 0, held.stderr
    job = held.stdout.strip().split(";")[0]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    said: list[str] = []

    def excluded() -> str:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        return dict(f.split("=", 1) for f in shown.split() if "=" in f)["ExcNodeList"]

    try:
        excluded_nodes.record(run_dir, "n3", "rank 1 hung there")
        excluded_nodes.record(run_dir, "../n4", "a name no node has")  # kept out of the file, never passed on
        assert exclude.apply_after_requeue(int(job), run_dir, said.append) == ["n3"] and excluded() == "n3", said
        assert said[-1] == "the requeued job leaves out n3 (rank 1 hung there) (3 usable node(s) remain in partition debug)"
        excluded_nodes.record(run_dir, "n1", "rank 0 was a straggler")
        excluded_nodes.record(run_dir, "n2", "rank 3 was a straggler")
        assert exclude.apply_after_requeue(int(job), run_dir, said.append) == [] and excluded() == "n3", said
        assert said[-1].startswith("not leaving out n1 (rank 0 was a straggler), n2 (rank 3 was a straggler), n3 (rank 1 hung there)")
        assert "would keep 1 usable node(s) for a job of 2 (fix: submit with --nodes MIN:MAX" in said[-1], said
        # A job record Slurm does not give (here: no such job) is no room to judge: read as empty, the job's own
        # excluded nodes were overwritten with ours.
        assert exclude.apply_after_requeue(987654321, run_dir, said.append) == [], said
        assert said[-1].startswith("not leaving out") and "Slurm could not be asked which nodes are spare (scontrol show job" in said[-1]
    finally:
        subprocess.run(["scancel", job], check=False)

    # A partition of two kinds of node (n1, n2 have InfiniBand) and a job of 2 that asks for that kind: n3 and n4
    # are usable but no room for it. Counted as spare, n1 was left out and the job waited forever for a second
    # "ib" node; Slurm's own judgement of the request (sbatch --test-only) now says it cannot start without it.
    features = ["scontrol", "update", "NodeName=n[1-2]"]
    try:
        assert subprocess.run([*features, "AvailableFeatures=ib", "ActiveFeatures=ib"], capture_output=True).returncode == 0
        held = subprocess.run([*hold[:3], "--constraint", "ib", *hold[3:]], capture_output=True, text=True)
        assert held.returncode == 0, held.stderr
        job = held.stdout.strip().split(";")[0]
        (run_dir / "excluded_nodes.json").unlink()
        excluded_nodes.record(run_dir, "n1", "rank 0 hung there")
        assert exclude.apply_after_requeue(int(job), run_dir, said.append) == [] and excluded() == "(null)", said
        assert said[-1].startswith("not leaving out n1 (rank 0 hung there): Slurm finds no 2 node(s) for the job's request"), said
        assert "Requested node configuration is not available" in said[-1] and "fix: submit with --nodes MIN:MAX" in said[-1], said
        (run_dir / "excluded_nodes.json").unlink()
        excluded_nodes.record(run_dir, "n3", "rank 1 hung there")  # not of the kind: leaving it out costs the job nothing
        assert exclude.apply_after_requeue(int(job), run_dir, said.append) == ["n3"] and excluded() == "n3", said
    finally:
        subprocess.run(["scancel", job], check=False)
        subprocess.run([*features, "AvailableFeatures=", "ActiveFeatures="], check=False)


def test_a_node_its_screen_finds_slow_is_left_out_and_the_job_completes_on_the_others(
    slurm_cluster: Path, prepared: Path, tmp_path: Path, home: Path
) -> None:
    """submit --screen, rank 1's node made slow for the first attempt: the screen names that node before
    any model is built, the job is requeued without it, screens clean on two other nodes and trains to the end."""
    out = tmp_path / "runs"
    args = ["submit", *TINY, "--screen", "--output-dir", str(out), "--run-name", "screened", "--set", f"data.path={prepared}"]
    # The test nodes share two CPUs with the other tests: a clean one measured half its peer's speed (2026-11-29).
    # So rank 1 idles 90 % of its screen and the peers are judged at 0.3, far from both.
    args += ["--set", "health.screen_peer_fraction=0.3"]
    res = run_cli([*args, "--set", "train.max_steps=8"], AURA_FAULT_SCREEN_SLOW="1:0.9")
    assert res.returncode == 0, res.stderr
    run_dir = out / "screened"
    job = _job_id(run_dir)
    _wait_gone(job, timeout=300)
    log0 = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    first = json.loads((run_dir / "screen" / "attempt-0.json").read_text())
    [finding] = first["findings"]
    slow = finding["node"]
    assert finding["line"].startswith(f"rank 1 on {slow}: matmul ") and "under 0.3 x the other devices' median" in finding["line"]
    assert f"screen: leaving out {slow}" in log0 and f"the requeued job leaves out {slow} (failed screening: rank 1 on" in log0, log0[
        -3000:
    ]
    again = json.loads((run_dir / "screen" / "attempt-1.json").read_text())
    assert again["findings"] == [] and slow not in {d["host"] for d in again["devices"]}, again
    assert "model: GPT-2 " not in log0.split("requeuing job")[0], "the screen comes before the model is built"
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 8


def test_logs_of_an_absent_log_while_the_controller_is_away_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logs` of a log not written yet asks the queue whether the job waits: with the controller unreachable that
    was an error, where the log's absence alone was the answer before."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.slurm import commands

    log = tmp_path / "logs" / "77_0_log.out"
    monkeypatch.setattr(commands, "_log_of", lambda target, rank, stderr: ("77", log, tmp_path, {}))

    def away(job_id: str) -> None:
        raise LaunchError("squeue failed: slurm_load_jobs error: Unable to contact slurm controller (fix: check slurmctld)")

    monkeypatch.setattr(commands.slurm_query, "squeue_job", away)
    said = commands.absent_log_note("77", 0, False)
    assert said.startswith(f"{log} does not exist yet, and Slurm could not say how job 77 is (squeue failed"), said
    assert "Unable to contact slurm controller)" in said, said
