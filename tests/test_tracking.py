"""tracking.backends with no network: trackio's local store, W&B offline files and an MLflow SQLite
store read back after a run whose rank 0 was killed and restarted (one tracked run, not two); a tracker
pointed at a server that never answers costs a warning, never a step nor the checkpoint of a stop."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from aura_hpc.errors import EXIT_RESUMABLE
from aura_hpc.train.loop.trackers import node_local_store
from tests.conftest import SMALL_MODEL, cli_env, run_cli, run_cli_together, tensorboard_steps

pytestmark = pytest.mark.slow
pytest.importorskip("trackio")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

STEPS = 20
ALL = "tensorboard,trackio,wandb,mlflow"


def _args(out: Path, name: str, prepared: Path, backends: str, *extra: str) -> list[str]:
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
        *SMALL_MODEL,
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        "train.checkpoint_every=5",
        "--set",
        f"tracking.backends={backends}",
        *extra,
    ]


def _wandb_records(path: Path) -> list[object]:
    """The records of a W&B transaction log (.wandb): 32 KiB blocks of CRC'd chunks holding protobuf
    Records (wandb 0.31 ships no reader of its own)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def _network_spy(folder: Path) -> dict[str, str]:
    """The environment that has every Python process of a run note (and refuse) each lookup of another machine's
    name and each connection to another machine's address: a run with trackers must make none."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import ipaddress, os, socket\n"
        "_log, _lookup, _connect = os.environ['AURA_TEST_NETWORK_LOG'], socket.getaddrinfo, socket.socket.connect\n"
        "def _here(host):\n"
        "    if host in (None, '', 'localhost', socket.gethostname()):\n        return True\n"
        "    try:\n        return ipaddress.ip_address(str(host).split('%')[0]).is_loopback\n"
        "    except ValueError:\n        return False\n"
        "def _refuse(what):\n"
        "    with open(_log, 'a') as f:\n        f.write(f'{os.getpid()} {what}\\n')\n"
        "    raise socket.gaierror(socket.EAI_NONAME, 'no network in this test')\n"
        "def getaddrinfo(host, *args, **kwargs):\n"
        "    if not _here(host.decode() if isinstance(host, bytes) else host):\n        _refuse(f'lookup {host}')\n"
        "    return _lookup(host, *args, **kwargs)\n"
        "def connect(self, address):\n"
        "    if self.family in (socket.AF_INET, socket.AF_INET6) and not _here(address[0]):\n        _refuse(f'connect {address}')\n"
        "    return _connect(self, address)\n"
        "socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect\n"
    )
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "AURA_TEST_NETWORK_LOG": str(folder / "tried.txt")}


def _interrupt_after(proc: subprocess.Popen[str], run: Path, step: int) -> None:
    """SIGINT to a `local` launcher once its run has logged `step` (Ctrl+C; Slurm's stop takes the same path)."""
    metrics = run / "metrics.jsonl"
    while proc.poll() is None:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if rows and json.loads(rows[-1])["step"] >= step:
            os.kill(proc.pid, signal.SIGINT)
            return
        time.sleep(0.05)


def test_every_tracker_reads_back_one_run_across_a_restart_and_a_silent_one_costs_a_warning(tmp_path: Path, prepared: Path) -> None:
    # A server that takes the connection and never answers (a hung host), with MLflow's client told to wait
    # for it longer than the trackers' wait at the end (5 s here, 30 by default). The run is stopped mid-way by Ctrl+C.
    silent = socket.create_server(("127.0.0.1", 0))
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    blocked_args = _args(tmp_path, "blocked", prepared, "mlflow", "--set", f"tracking.mlflow_uri={uri}", "--set", "train.max_steps=5000")
    blocked_args += ["--set", "tracking.finish_wait_s=5"]
    blocked = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", *blocked_args],
        env=cli_env(MLFLOW_HTTP_REQUEST_TIMEOUT="300"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    threading.Thread(target=_interrupt_after, args=(blocked, tmp_path / "blocked", 10), daemon=True).start()
    runs = [
        # sqlite_local=true: the stores live on "node-local" disk and what is read back below is their copies
        # in the run directory (what a run on NFS does by itself).
        [
            *_args(tmp_path, "tracked", prepared, ALL, "--set", "tracking.sqlite_local=true", "--set", "train.log_every=1"),
            "--max-restarts",
            "1",
        ],
    ]
    # Offline first, whatever the shell exports: a trackio Space named in the environment, W&B's and MLflow's telemetry.
    spy = _network_spy(tmp_path / "spy")
    try:
        [tracked] = run_cli_together(runs, timeout=600, AURA_FAULT_KILL="0:12", TRACKIO_SPACE_ID="someone/dashboard", **spy)
        said = blocked.communicate(timeout=300)[0]
    finally:
        blocked.kill()
        silent.close()
    run = tmp_path / "tracked"
    assert tracked.returncode == 0, tracked.stdout[-3000:] + tracked.stderr[-3000:]
    # From step 10's checkpoint, or step 5's when the kill at step 12 came before step 10's background write
    # was committed (async checkpoints on 2 busy cores: seen once in CI); either way steps 10 and 20 are logged.
    resumed = re.search(r"resumed from checkpoint step_000000(10|05) at step", tracked.stdout)
    assert "restart=1" in tracked.stdout and resumed, tracked.stdout[-3000:]
    ids = json.loads((run / "tracking" / "ids.json").read_text())
    assert set(ids) == {"trackio", "wandb", "mlflow", "run_key"}, ids
    # TensorBoard: the killed attempt's points past the checkpoint are gone at the first resume (they stayed
    # beside the redone ones: a fresh run wrote no session start, and TensorBoard takes the first as no restart).
    shown = tensorboard_steps(run / "tensorboard", "train/loss")
    assert shown == sorted(set(shown)) and shown[-1] == STEPS, shown

    # trackio: one run in the project's SQLite file, with the last step's loss.
    code = (
        "import json,sys; from trackio.sqlite_storage import SQLiteStorage as S; "
        "print(json.dumps([S.get_runs('aura_hpc'), S.get_logs('aura_hpc', sys.argv[1])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ids["trackio"]],
        env={"TRACKIO_DIR": str(run / "tracking" / "trackio"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    trackio_runs, rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert trackio_runs == ["tracked"]
    logged = [r["step"] for r in rows if "loss" in r]
    # Steps 11-12, logged by the killed attempt and again after the resume, are held once.
    assert set(logged) >= {10, 20} and len(logged) == len(set(logged)), rows

    # W&B offline: every attempt's folder carries the one run id; the config is in its run record.
    folders = sorted(glob.glob(str(run / "wandb" / "offline-run-*")))
    assert folders and all(f.endswith(f"-{ids['wandb']}") for f in folders), folders
    records = _wandb_records(next(Path(folders[-1]).glob("run-*.wandb")))
    [head] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert head.run_id == ids["wandb"] and "train" in {i.key for i in head.config.update}
    steps = [
        int(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for i in r.history.item
        if i.key == "_step" or list(i.nested_key) == ["_step"]
    ]
    assert STEPS in steps, steps

    # MLflow: one run in the experiment of the SQLite store, its loss through step 20, the config as params.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'tracking' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("aura_hpc")
    found = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in found] == [ids["mlflow"]]
    assert found[0].data.params["train.max_steps"] == str(STEPS) and found[0].info.status == "FINISHED"
    history = [m.step for m in client.get_metric_history(ids["mlflow"], "loss")]
    assert set(history) >= {10, 20} and len(history) == len(set(history)), history

    # Read above from the copies in the run directory; the stores themselves lived on "node-local" disk,
    # which keeps nothing of a finished run (the killed attempt's stores included).
    assert not (run / "tracking" / ".mlflow.db.tmp").exists() and (run / "tracking" / "trackio" / "aura_hpc.db").is_file()
    assert not node_local_store(run).exists(), sorted(node_local_store(run).rglob("*"))
    log0 = (run / "logs" / "rank_0.log").read_text()
    assert "trackio show --project aura_hpc" in log0 and "wandb sync" in log0 and "mlflow server --backend-store-uri" in log0
    # trackio's own printed lines (the node-local folder, an "upload") are in rank 0's log, not bare on the terminal.
    assert "tracking: trackio said: * Trackio metrics logged to:" in log0, log0[-3000:]
    assert "TRACKIO_SPACE_ID in the environment ignored" in log0, log0[-3000:]
    assert "held another run's stores" not in log0  # the node-local folder of a new run is its own, not replaced
    tried = Path(spy["AURA_TEST_NETWORK_LOG"])
    assert not tried.exists(), tried.read_text()[-3000:]
    assert not [x for x in tracked.stdout.splitlines() if x.startswith("* ")], tracked.stdout[-3000:]

    # A kept MLflow id that names nothing (its store was lost, or another one is used): the run is found
    # again by its tag, not switched off for good.
    kept = json.loads((run / "tracking" / "ids.json").read_text())
    (run / "tracking" / "ids.json").write_text(json.dumps({**kept, "mlflow": "0" * 32}))
    again = run_cli(runs[0], timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert json.loads((run / "tracking" / "ids.json").read_text())["mlflow"] == ids["mlflow"]
    assert "mlflow could not start" not in (run / "logs" / "rank_0.log").read_text()
    assert not node_local_store(run).exists()

    # The tracker that never answered cost no step (the run got past step 10 while its first call waited),
    # and at the stop the checkpoint came first: the trackers' wait (tracking.finish_wait_s) follows it, where it no longer
    # spends the launcher's wait for its workers (30 s where torch has no shutdown_timeout, as 2.6) or a Slurm job's grace window.
    assert blocked.returncode == EXIT_RESUMABLE, said[-3000:]
    log0 = (tmp_path / "blocked" / "logs" / "rank_0.log").read_text()
    stopped, left = log0.find("stop requested ("), log0.find("tracking: the trackers did not finish within 5 s")
    assert 0 <= stopped < left and "written; exiting with status" in log0[stopped:left], log0[-3000:]


def test_a_tracker_that_is_not_installed_or_unknown_is_refused_before_anything_starts(tmp_path: Path, prepared: Path) -> None:
    from tests.conftest import run_cli

    bad = run_cli(_args(tmp_path, "bad", prepared, "tensorboard,comet"))
    assert bad.returncode == 2 and "tracking.backends: unknown comet (fix: a comma list of" in bad.stderr, bad.stderr
    secret = run_cli(_args(tmp_path, "bad", prepared, "mlflow", "--set", "tracking.mlflow_uri=https://me:pw@mlflow.example"))
    assert secret.returncode == 2 and "MLFLOW_TRACKING_USERNAME" in secret.stderr and "pw" not in secret.stderr, secret.stderr
    assert not (tmp_path / "bad").exists()


def test_a_trackers_thread_that_stops_keeps_the_node_local_stores_and_costs_no_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The node-local folder has a predictable name in a temporary folder other users share: one open to
    them is refused. The thread that stops on it (or on a full disk, a damaged store) says so once, takes no
    more rows, and its finish removes nothing (it removed the only copy of the stores)."""
    import logging
    import shutil

    from aura_hpc.config import load_config
    from aura_hpc.train.loop.trackers import Trackers

    cfg = load_config(None, ["tracking.backends=trackio", "tracking.sqlite_local=true"], output_dir=str(tmp_path / "runs"), run_name="t")
    local = node_local_store(cfg.run_dir)
    (local / "trackio").mkdir(parents=True)
    local.chmod(0o777)
    (local / "trackio" / "aura_hpc.db").write_bytes(b"rows of an earlier attempt")
    try:
        with caplog.at_level(logging.WARNING, logger="aura_hpc"):
            trackers = Trackers(cfg, 0)
            trackers.start()
            assert trackers._thread is not None
            trackers._thread.join(20)
            for step in range(cfg.tracking.queue_rows + 5):
                trackers.log({"loss": 1.0}, step)
            trackers.finish()
        assert (local / "trackio" / "aura_hpc.db").read_bytes() == b"rows of an earlier attempt"
        assert "the trackers stopped" in caplog.text and "is another user's or open to others" in caplog.text, caplog.text
        assert "rows behind" not in caplog.text
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.parametrize("outage_s", [0.5, 1000.0], ids=["short-outage", "server-gone"])
def test_a_tracker_outage_is_ridden_out_and_one_switched_off_still_ends_its_run(
    tmp_path: Path, outage_s: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One failed call switched MLflow off for the rest of the run, then five in a row did: a restarting server refuses
    at once, and rows come every second or two. A failing tracker is now paused and tried again; off only after
    failing for OFF_AFTER_S (shortened here), and its run still ended. The outage is a server's error in the middle of
    MLflow's real client, which writes a real SQLite store."""
    from mlflow.tracking import MlflowClient

    from aura_hpc.config import load_config
    from aura_hpc.train.loop import trackers as tr

    monkeypatch.setattr(tr, "OFF_AFTER_S", 2.5)
    cfg = load_config(None, ["tracking.backends=mlflow", "tracking.sqlite_local=false"], output_dir=str(tmp_path / "runs"), run_name="t")
    cfg.run_dir.mkdir(parents=True)
    trackers = tr.Trackers(cfg, 0)
    trackers.start()
    assert trackers._thread is not None
    for _ in range(200):  # started in the trackers' thread
        if "mlflow" in trackers._live:
            break
        time.sleep(0.1)
    backend = trackers._live["mlflow"]
    real, down_from = backend.log, [0.0]

    def log(values: dict[str, float], step: int) -> None:
        down_from[0] = down_from[0] or time.monotonic()
        if time.monotonic() - down_from[0] < outage_s:
            raise ConnectionError("503 Service Unavailable: the tracking server is restarting")
        real(values, step)

    backend.log = log
    with caplog.at_level(logging.INFO, logger="aura_hpc"):
        for step in range(1, 51):  # a row every 0.1 s for 5 s
            trackers.log({"loss": 1.0 / step}, step)
            time.sleep(0.1)
        trackers.finish()
    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.run_dir / 'tracking' / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED", "ended, switched off or not"
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    if outage_s < 1:  # paused 1 s after the first failure, then every row again
        assert logged and logged[0] > 1 and logged == list(range(logged[0], 51)), logged
        assert "mlflow logs again after 1 s; " in caplog.text and "switched off" not in caplog.text, caplog.text
    else:  # tried at 0, 1 and 3 s: off at the third failure, past OFF_AFTER_S
        assert logged == [] and "mlflow failed (503 Service Unavailable" in caplog.text and "switched off" in caplog.text


def test_an_attempt_that_restarts_from_step_0_does_not_log_its_steps_twice(tmp_path: Path) -> None:
    """An attempt killed before its first checkpoint: the next starts from step 0 and its rows up to the last
    one the tracker holds are held back, as at any resume (they went to MLflow and trackio a second time)."""
    from mlflow.tracking import MlflowClient

    from aura_hpc.config import load_config
    from aura_hpc.train.loop.trackers import Trackers

    cfg = load_config(None, ["tracking.backends=mlflow", "tracking.sqlite_local=false"], output_dir=str(tmp_path / "runs"), run_name="t")
    cfg.run_dir.mkdir(parents=True)
    for last in (6, 10):  # the first attempt gets to step 6 (its tracker has them all), the second from 0 to 10
        trackers = Trackers(cfg, 0)
        trackers.start()
        for step in range(1, last + 1):
            trackers.log({"loss": 1.0 / step}, step)
        trackers.finish()
    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.run_dir / 'tracking' / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 11))


def test_a_tracker_switched_off_while_rows_are_added_back_at_a_resume_leaves_the_others_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume adds back the rows a tracker lacks, one call each: a tracker switched off among them made the next
    call fail on its name, which stopped the trackers' thread (every tracker off, none finished)."""
    from mlflow.tracking import MlflowClient

    from aura_hpc.config import load_config
    from aura_hpc.train.loop import tracker_backends
    from aura_hpc.train.loop import trackers as trackers_module
    from aura_hpc.train.loop.trackers import Trackers

    cfg = load_config(None, ["tracking.backends=mlflow", "tracking.sqlite_local=false"], output_dir=str(tmp_path / "runs"), run_name="t")
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 21)))
    real_make = tracker_backends.make

    def make(*args: Any) -> Any:
        backend = real_make(*args)

        def log(values: dict[str, float], step: int) -> None:
            raise ConnectionError("503 Service Unavailable")

        backend.log = log
        return backend

    monkeypatch.setattr(tracker_backends, "make", make)
    monkeypatch.setattr(trackers_module, "OFF_AFTER_S", 0.0)  # off at its first failure, among the rows added back
    trackers = Trackers(cfg, 20)
    trackers.start()
    trackers.log({"loss": 0.01}, 21)
    trackers.finish()
    assert not trackers._broken and "mlflow" in trackers._off
    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.run_dir / 'tracking' / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"


def test_a_run_directory_made_again_is_another_tracked_run_and_its_store_starts_empty(tmp_path: Path) -> None:
    """A run directory deleted and made again is a new run. MLflow found the old run by the directory's path (a server
    or database outliving the directory), and a node-local store left by a killed attempt was opened again; either
    way the new run's first steps were taken for ones the tracker held, and never logged."""
    import shutil

    from mlflow.tracking import MlflowClient

    from aura_hpc.config import load_config
    from aura_hpc.train.loop.trackers import Trackers

    def attempt(cfg: Any, last: int, loss: float) -> Trackers:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        trackers = Trackers(cfg, 0)
        trackers.start()
        for step in range(1, last + 1):
            trackers.log({"loss": loss}, step)
        trackers.finish()
        return trackers

    def history(uri: str) -> dict[str, list[tuple[int, float]]]:
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        return {r.info.run_id: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "loss")) for r in runs}

    shared = f"sqlite:///{tmp_path / 'server.db'}"  # a store that outlives run directories, as a server does
    cfg = load_config(None, ["tracking.backends=mlflow", "tracking.sqlite_local=false", f"tracking.mlflow_uri={shared}"],
                      output_dir=str(tmp_path / "runs"), run_name="t")  # fmt: skip
    attempt(cfg, 10, 9.0)
    shutil.rmtree(cfg.run_dir)
    attempt(cfg, 6, 1.0)
    assert sorted(history(shared).values()) == [[(s, 1.0) for s in range(1, 7)], [(s, 9.0) for s in range(1, 11)]]

    # A node-local store a killed attempt left (its copy never removed), then the directory deleted and made again.
    cfg = load_config(None, ["tracking.backends=mlflow", "tracking.sqlite_local=true"], output_dir=str(tmp_path / "local"), run_name="t")
    local = node_local_store(cfg.run_dir)
    try:
        attempt(cfg, 10, 9.0)
        local.mkdir(mode=0o700)
        shutil.copy(cfg.run_dir / "tracking" / "mlflow.db", local / "mlflow.db")
        shutil.rmtree(cfg.run_dir)
        # In a process of its own, as every attempt is (MLflow keeps one engine per store address in a process).
        code = (
            "import sys\nfrom aura_hpc.config import load_config\nfrom aura_hpc.train.loop.trackers import Trackers\n"
            "cfg = load_config(None, ['tracking.backends=mlflow', 'tracking.sqlite_local=true'], output_dir=sys.argv[1], run_name='t')\n"
            "cfg.run_dir.mkdir(parents=True)\ntrackers = Trackers(cfg, 0)\ntrackers.start()\n"
            "for step in range(1, 7):\n    trackers.log({'loss': 1.0}, step)\ntrackers.finish()\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "local")], env=cli_env(), capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert not local.exists()  # its stores copied into the run directory, the node-local folder removed
        assert list(history(f"sqlite:///{cfg.run_dir / 'tracking' / 'mlflow.db'}").values()) == [[(s, 1.0) for s in range(1, 7)]]
    finally:
        shutil.rmtree(local, ignore_errors=True)


def test_the_node_local_stores_of_a_run_begun_by_an_older_release_are_adopted_not_replaced(tmp_path: Path) -> None:
    """An older release kept no run key: its run's ids.json and node-local folder have none. That folder holds rows newer
    than the run directory's copy: it is this run's, and was deleted as another run's."""
    import shutil

    from aura_hpc.config import load_config
    from aura_hpc.train.loop.trackers import IDS, Trackers

    cfg = load_config(None, ["tracking.backends=mlflow", "tracking.sqlite_local=true"], output_dir=str(tmp_path), run_name="t")
    local = node_local_store(cfg.run_dir)
    try:
        (cfg.run_dir / "tracking").mkdir(parents=True)
        (cfg.run_dir / "tracking" / IDS).write_text(json.dumps({"mlflow": "0123abcd"}))  # an older release's
        local.mkdir(mode=0o700)
        (local / "mlflow.db").write_bytes(b"the newest rows")
        trackers = Trackers(cfg, 0)
        trackers.start()
        trackers.finish()  # MLflow cannot read the stand-in store: what matters is what is left of it
        assert (local / "mlflow.db").read_bytes() == b"the newest rows" and (local / "run_key").read_text().strip() == trackers.run_key
    finally:
        shutil.rmtree(local, ignore_errors=True)


def test_a_store_copied_back_in_is_not_rewound_by_a_write_ahead_log_a_killed_process_left(tmp_path: Path) -> None:
    """SQLite replays a -wal file it finds beside a database: the node-local store a killed attempt left (database,
    -wal, -shm) took the run directory's newer copy back to that attempt's rows when it was copied in."""
    import shutil
    import sqlite3

    from aura_hpc.train.loop.trackers import copy_in

    killed = tmp_path / "killed"
    killed.mkdir()
    con = sqlite3.connect(killed / "store.db")
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA wal_autocheckpoint = 0")
    con.execute("CREATE TABLE rows (v REAL)")
    con.executemany("INSERT INTO rows VALUES (?)", [(1.0,)] * 300)
    con.commit()
    local = tmp_path / "local"
    shutil.copytree(killed, local)  # what the killed process left: its log never checkpointed into the database
    con.close()
    kept = tmp_path / "kept.db"
    newer = sqlite3.connect(kept)
    newer.execute("CREATE TABLE rows (v REAL)")
    newer.executemany("INSERT INTO rows VALUES (?)", [(2.0,)] * 1000)
    newer.commit()
    newer.close()
    assert (local / "store.db-wal").stat().st_size > 0
    copy_in(kept, local / "store.db")
    read = sqlite3.connect(local / "store.db")
    assert read.execute("SELECT v, COUNT(*) FROM rows GROUP BY v").fetchall() == [(2.0, 1000)]
    read.close()


def test_a_store_that_could_not_be_copied_back_in_is_never_written_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume on another node copies the run directory's stores back in. SQLite read a path with '#' as a URI's
    fragment (it opened an empty database elsewhere), and any copy that failed (an NFS error) left the tracker on an
    empty store, which the next copy out renamed over the run's whole history."""
    import errno
    import shutil
    import sqlite3

    from aura_hpc.config import load_config
    from aura_hpc.train.loop import trackers as tr

    def rows(db: Path) -> int:
        con = sqlite3.connect(db)
        try:
            return int(con.execute("SELECT COUNT(*) FROM rows").fetchone()[0])
        finally:
            con.close()

    cfg = load_config(None, ["tracking.backends=tensorboard", "tracking.sqlite_local=true"], output_dir=str(tmp_path / "runs#1%41"))
    t = tr.Trackers(cfg, 0)
    kept = t.folder / "mlflow.db"
    try:
        t.local.mkdir(parents=True, mode=0o700)
        con = sqlite3.connect(t.local / "mlflow.db")
        con.execute("CREATE TABLE rows (v REAL)")
        con.executemany("INSERT INTO rows VALUES (?)", [(1.0,)] * 500)
        con.commit()
        con.close()
        t._copy_out()
        assert rows(kept) == 500 and not t._copy_failed
        shutil.rmtree(t.local)  # the next attempt, on another node
        t.local.mkdir(mode=0o700)
        t._copy_in()
        assert rows(t.local / "mlflow.db") == 500
        # The copy back in fails: the tracker starts empty, and the run directory's copy is never written over.
        shutil.rmtree(t.local)
        t.local.mkdir(mode=0o700)

        def stale(src: Path, dst: Path) -> None:
            raise OSError(errno.ESTALE, "Stale file handle")

        monkeypatch.setattr(tr, "copy_in", stale)
        t._copy_in()
        con = sqlite3.connect(t.local / "mlflow.db")
        con.execute("CREATE TABLE rows (v REAL)")
        con.execute("INSERT INTO rows VALUES (2.0)")
        con.commit()
        con.close()
        t._copy_out()
        assert rows(kept) == 500 and t._copy_failed and rows(t.local / "mlflow.db") == 1
    finally:
        shutil.rmtree(t.local, ignore_errors=True)


def test_a_wandb_attempt_killed_seconds_after_its_start_keeps_its_run_record_and_rows(tmp_path: Path) -> None:
    """W&B writes its offline file every 15 s by default: an attempt killed sooner left a 7-byte file (no run record,
    no config), and W&B is the one tracker a resume does not fill in from metrics.jsonl."""
    code = (
        "import os, sys, time\nfrom aura_hpc.config import load_config\nfrom aura_hpc.train.loop.trackers import Trackers\n"
        "cfg = load_config(None, ['tracking.backends=wandb'], output_dir=sys.argv[1], run_name='t')\n"
        "cfg.run_dir.mkdir(parents=True)\ntrackers = Trackers(cfg, 0)\ntrackers.start()\n"
        "for step in range(1, 11):\n    trackers.log({'loss': 1.0 / step}, step)\n"
        # Seconds after W&B took the rows (its start on a busy machine can outlast a fixed 4 s).
        "deadline = time.monotonic() + 120\n"
        "while not ('wandb' in trackers._live and trackers._queue.empty()) and time.monotonic() < deadline:\n    time.sleep(0.1)\n"
        "time.sleep(3)\nos._exit(9)\n"  # killed: nothing finished, nothing flushed on the way out
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=cli_env(), capture_output=True, text=True, timeout=200)
    assert r.returncode == 9, r.stderr[-2000:]
    [log] = glob.glob(str(tmp_path / "t" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = _wandb_records(Path(log))
    assert [r.run.run_id for r in records if r.WhichOneof("record_type") == "run"], f"no run record in {os.path.getsize(log)} bytes"
    assert sum(r.WhichOneof("record_type") == "history" for r in records) >= 5


def test_a_worker_whose_node_lacks_a_tracker_refuses_before_it_builds_anything(tmp_path: Path, prepared: Path) -> None:
    """Under Slurm no launcher checks the compute node's packages: rank 0 found a missing tracker only once the model
    was built, resumed and warmed up (GPU time), on its way to the first metrics row."""
    from aura_hpc.config import load_config

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # not installed on this node\n")
    cfg = load_config(
        None, ["tracking.backends=wandb", f"data.path={prepared}", *SMALL_MODEL[1::2]], output_dir=str(tmp_path), run_name="t"
    )
    cfg.run_dir.mkdir()
    (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml())
    env = cli_env(PYTHONPATH=f"{hide}{os.pathsep}{cli_env().get('PYTHONPATH', '')}")
    r = subprocess.run(
        [sys.executable, "-m", "aura_hpc.train", str(cfg.run_dir / "config.yaml")], env=env, capture_output=True, text=True, timeout=300
    )
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "tracking.backends asks for wandb, not installed here (fix: pip install" in said, said[-3000:]
    assert "parameters" not in said and not (cfg.run_dir / "checkpoints").exists(), said[-3000:]


def test_mlflow_names_a_deleted_experiment_and_takes_one_another_job_just_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow finds a deleted experiment by its name, then refuses runs in it: every later run lost MLflow with a line
    that named no fix. Two jobs starting a new project together both made the experiment: the second was refused."""
    from mlflow.tracking import MlflowClient

    from aura_hpc.config import load_config
    from aura_hpc.train.loop.trackers import Trackers

    uri = f"sqlite:///{tmp_path / 'server.db'}"  # a server's store, shared by the runs
    client = MlflowClient(tracking_uri=uri)

    def attempt(name: str) -> Trackers:
        sets = ["tracking.backends=mlflow", "tracking.sqlite_local=false", f"tracking.mlflow_uri={uri}"]
        cfg = load_config(None, sets, output_dir=str(tmp_path / "runs"), run_name=name)
        cfg.run_dir.mkdir(parents=True)
        trackers = Trackers(cfg, 0)
        trackers.start()
        trackers.log({"loss": 1.0}, 1)
        trackers.finish()
        return trackers

    made = client.create_experiment("aura_hpc")
    real = MlflowClient.get_experiment_by_name
    calls = [0]

    def not_yet(self: Any, name: str) -> Any:  # another job makes it between this one's look-up and its create
        calls[0] += 1
        return None if calls[0] == 1 else real(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", not_yet)
    with caplog.at_level(logging.WARNING, logger="aura_hpc"):
        attempt("raced")
    assert "could not start" not in caplog.text, caplog.text
    [run] = client.search_runs([made])
    assert run.info.status == "FINISHED" and run.info.run_name == "raced"
    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", real)
    client.delete_experiment(made)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aura_hpc"):
        attempt("deleted")
    said = f"mlflow could not start (the MLflow experiment 'aura_hpc' (id {made}) was deleted (fix: restore it with `mlflow experiments"
    assert said in caplog.text and "--set tracking.project=ANOTHER" in caplog.text, caplog.text
    assert client.get_experiment(made).lifecycle_stage == "deleted"  # the user's deletion stands
