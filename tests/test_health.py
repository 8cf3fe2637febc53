"""Resource monitor and GPU circuit breaker. Without a GPU, NVML readings are replayed from a
file (the same reader interface the real NVML path uses); the webhook goes to a real local HTTP
server that fails the first delivery."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from aura_hpc.ops.gpu_health import THROTTLE_BITS, HealthRules, Thresholds
from aura_hpc.ops.webhook import body
from tests.conftest import run_cli, run_cli_together

HEALTHY = {
    "index": 0,
    "name": "NVIDIA H100 80GB HBM3",
    "util_pct": 97,
    "mem_used_mb": 60000.0,
    "temp_c": 61,
    "temp_slowdown_c": 87,
    "temp_shutdown_c": 92,
    "power_w": 650.0,
    "sm_clock_mhz": 1980,
    "throttle_reasons": 0,
    "ecc_uncorrected_volatile": 0,
}
FAULTS = {
    "ecc": dict(HEALTHY, ecc_uncorrected_volatile=2),
    "thermal": dict(HEALTHY, temp_c=86),
    "throttle": dict(HEALTHY, throttle_reasons=THROTTLE_BITS["hw_slowdown"], sm_clock_mhz=900),
}
REASON = {"ecc": "uncorrectable ECC", "thermal": "slowdown threshold", "throttle": "clocks throttled (hw_slowdown)"}


def _rules() -> HealthRules:
    return HealthRules(Thresholds(temp_margin_c=3, throttle_samples=3))


def test_rules_trip_on_faults_and_not_on_healthy_readings() -> None:
    r = _rules()
    assert all(r.evaluate([HEALTHY, dict(HEALTHY, index=1)]) is None for _ in range(10))
    r = _rules()
    assert r.evaluate([HEALTHY]) is None
    fault = r.evaluate([FAULTS["ecc"]])
    assert fault is not None and REASON["ecc"] in fault.reason and "2 new uncorrectable ECC error(s)" in fault.reason
    # One hot reading (a sensor's spike) stopped the run with exit 76, "drain the node": as throttling, in a row.
    r = _rules()
    assert r.evaluate([FAULTS["thermal"]]) is None and r.evaluate([FAULTS["thermal"]]) is None
    fault = r.evaluate([FAULTS["thermal"]])
    assert fault is not None and "within 3 C of the 87 C slowdown threshold for 3 samples in a row" in fault.reason
    r = _rules()
    r.evaluate([FAULTS["thermal"]])
    r.evaluate([HEALTHY])
    assert r.evaluate([FAULTS["thermal"]]) is None, "the count restarts after a cool sample"
    no_slowdown = {k: v for k, v in FAULTS["thermal"].items() if k != "temp_slowdown_c"} | {"temp_c": 90}
    r = _rules()
    assert [r.evaluate([no_slowdown]) for _ in range(3)][-1].reason.startswith("temperature 90 C within 3 C of the 92 C shutdown")  # type: ignore[union-attr]
    # A GPU fallen off the bus answers nothing: it vanished from the watch (no UUID, no field a rule reads).
    lost = _rules().evaluate([HEALTHY, {"index": 3, "uuid": "GPU-dddd", "lost": True}])
    assert lost is not None and lost.gpu_index == 3 and "answers nothing" in lost.reason
    r = _rules()
    assert r.evaluate([FAULTS["throttle"]]) is None and r.evaluate([FAULTS["throttle"]]) is None, "a short throttle is not a fault"
    fault = r.evaluate([FAULTS["throttle"]])
    assert fault is not None and REASON["throttle"] in fault.reason
    r = _rules()
    r.evaluate([FAULTS["throttle"]])
    r.evaluate([HEALTHY])
    assert r.evaluate([FAULTS["throttle"]]) is None, "the count restarts after a healthy sample"
    # SW thermal slowdown is NVML's normal clock control of a GPU at its temperature target (a consumer card in a
    # warm room, all day): by default it stopped healthy training with exit 76 after 15 s. The temperature rule judges heat.
    from aura_hpc.config.tree import HealthConfig

    warm, r = dict(HEALTHY, throttle_reasons=THROTTLE_BITS["sw_thermal"]), _rules()
    assert all(r.evaluate([warm]) is None for _ in range(10)) and "sw_thermal" not in HealthConfig().throttle_reasons
    assert _rules().evaluate([dict(HEALTHY, recovery_action=2)]).reason == "the driver asks to reboot the node"  # type: ignore[union-attr]
    # An ECC count already there when the job starts: an uncorrectable error since the GPU's last reset, which NVIDIA
    # answers with a reset. Taken as the baseline, the damaged GPU was trained on.
    fault = _rules().evaluate([dict(HEALTHY, ecc_uncorrected_volatile=5)])
    assert fault is not None and "5 uncorrectable ECC error(s) since the GPU was last reset" in fault.reason


def test_a_full_disk_or_a_failing_tracker_costs_the_samples_never_the_breaker(caplog: pytest.LogCaptureFixture) -> None:
    """The breaker's rules run in the monitor's thread, which also writes the samples and hands them to the
    trackers: a write to a full disk (/dev/full) or a tracker's error stopped the thread, and the breaker with it."""
    import time

    from aura_hpc.ops.resources import BackgroundMonitor

    class Readings:
        rows = iter([[HEALTHY], [HEALTHY], [FAULTS["ecc"]]])

        def sample(self, full: bool = True) -> dict[str, object]:
            return {"gpus": next(self.rows, [FAULTS["ecc"]])}

    def tracker(row: dict[str, object]) -> None:
        raise RuntimeError("tracker down")

    with caplog.at_level(logging.WARNING, logger="aura_hpc"):
        monitor = BackgroundMonitor(Readings(), 0.01, Path("/dev/full"), _rules(), tracker).start()  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while monitor.fault is None and time.monotonic() < deadline:
            time.sleep(0.01)
        monitor.stop()
    assert monitor.fault is not None and "uncorrectable ECC" in monitor.fault.reason, caplog.text
    assert "no longer written to /dev/full" in caplog.text and "no longer sent to the trackers (tracker down)" in caplog.text


def test_the_breaker_and_the_samples_keep_their_own_cadences_on_one_sampling_thread(tmp_path: Path) -> None:
    """One thread sampled at the shorter cadence for both: the rules counted throttle_samples at that rate
    (monitor_interval_s=1 made 3 x 5 s of throttling a 3 s blip that drained the node) and rows went out at the
    breaker's 5 s when 60 s was asked. A clock of the test's own: the breaker every 5 s, rows every 7 s."""
    from aura_hpc.ops.resources import BackgroundMonitor

    now = [0.0]
    evaluated: list[float] = []
    written: list[float] = []
    fulls: list[bool] = []

    class Clocked:
        def sample(self, full: bool = True) -> dict[str, object]:
            fulls.append(full)
            return {"gpus": [HEALTHY]}

    class Rules:
        def evaluate(self, gpus: list[dict]) -> None:
            evaluated.append(now[0])

    def wait(timeout: float) -> bool:  # the thread's sleep, on the test's clock
        now[0] += timeout
        return now[0] > 36

    monitor = BackgroundMonitor(Clocked(), 5.0, None, Rules(), lambda row: written.append(now[0]), 5.0, 7.0, lambda: now[0])  # type: ignore[arg-type]
    monitor._stop.wait = wait  # type: ignore[method-assign]
    monitor._run()
    assert evaluated == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0], evaluated
    assert written == [7.0, 14.0, 21.0, 28.0, 35.0], written
    # A sample for the rules alone reads the GPUs alone (the disk's statvfs on a hung shared filesystem blocked it).
    assert fulls.count(True) == len(written) and fulls.count(False) == 6, fulls
    # With no file and no trackers to write to (monitor_interval_s=0, the default), no sample is a full one.
    now[0], fulls[:] = 0.0, []
    quiet = BackgroundMonitor(Clocked(), 5.0, None, Rules(), None, 5.0, 0.0, lambda: now[0])  # type: ignore[arg-type]
    quiet._stop.wait = wait  # type: ignore[method-assign]
    quiet._run()
    assert fulls == [False] * 7, fulls


def test_a_replay_on_a_cuda_machine_starts_at_its_first_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is, the breaker first probes NVML with one read: on a replay that read was its first line, and
    the ECC baseline came from the second (an incident whose counter rose between them was never seen)."""
    import time
    import types

    from aura_hpc.config import load_config
    from aura_hpc.train.loop import health

    replay = tmp_path / "incident.jsonl"
    replay.write_text(json.dumps([HEALTHY]) + "\n" + json.dumps([FAULTS["ecc"]]) + "\n")
    sets = [f"health.nvml_replay={replay}", "health.breaker_interval_s=0.05", "health.monitor_interval_s=0"]
    cfg = load_config(None, sets, output_dir=str(tmp_path), run_name="r")
    monkeypatch.setattr(health, "_cuda", lambda: True)
    monkeypatch.setattr(health, "_visible_uuids", lambda: None)
    watch = health.HealthWatch(cfg, types.SimpleNamespace(local_rank=0, local_world_size=1, node_rank=0))  # type: ignore[arg-type]
    watch.start(None)
    try:
        deadline = time.monotonic() + 20
        while watch.fault is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watch.stop()
    assert watch.fault is not None and "2 new uncorrectable ECC error(s)" in watch.fault.reason


def test_the_breaker_watches_the_gpus_the_nodes_ranks_train_on_not_every_one_it_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every GPU a process saw was watched: on an 8-GPU workstation without CUDA_VISIBLE_DEVICES, a 2-process run (on GPUs
    0 and 1) stopped with 76, "drain this node", for a fault on GPU 3, another user's."""
    import time
    import types

    from aura_hpc.config import load_config
    from aura_hpc.train.loop import health

    monkeypatch.setattr(health, "_cuda", lambda: True)
    monkeypatch.setattr(health, "_visible_uuids", lambda: [f"GPU-{c}" for c in "abcd"])
    monkeypatch.setattr(health, "_bound_per_task", lambda local_world: False)
    for faulty, stops in ((3, False), (1, True)):
        gpus = [dict(HEALTHY, index=i, uuid=f"GPU-{c}") for i, c in enumerate("abcd")]
        replay = tmp_path / f"gpu{faulty}.jsonl"
        replay.write_text(
            "".join(
                json.dumps(rows) + "\n"
                for rows in [
                    gpus,
                    [*gpus[:faulty], dict(FAULTS["ecc"], **{k: gpus[faulty][k] for k in ("index", "uuid")}), *gpus[faulty + 1 :]],
                ]
                * 5
            )
        )
        sets = [f"health.nvml_replay={replay}", "health.breaker_interval_s=0.02", "health.monitor_interval_s=0"]
        cfg = load_config(None, sets, output_dir=str(tmp_path), run_name=f"r{faulty}")
        watch = health.HealthWatch(cfg, types.SimpleNamespace(local_rank=0, local_world_size=2, node_rank=0))  # type: ignore[arg-type]
        watch.start(None)
        try:
            deadline = time.monotonic() + (20 if stops else 1.5)  # 1.5 s: the ten readings many times over
            while watch.fault is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            watch.stop()
        assert (watch.fault is not None) == stops, (faulty, watch.fault)
        assert not stops or watch.fault.gpu_index == 1  # type: ignore[union-attr]


def test_webhook_bodies_per_kind() -> None:
    event = {"event": "gpu.fault", "host": "n1", "gpu_index": 3, "reason": "hot", "job_id": "42", "run_dir": "/r", "step": 7}
    assert body("generic", event) == event
    assert "GPU 3" in body("discord", event)["content"] and "hot" in body("slack", event)["text"]


def test_a_webhook_url_that_is_not_one_is_said_without_its_value_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    """deliver() runs before exit 76 and inside the hang watchdog: a URL from an environment variable or a
    file is never checked by the config, and urllib's errors about it carry the value (a token)."""
    from aura_hpc.ops.webhook import deliver

    event = {"event": "gpu.fault", "host": "n1", "gpu_index": 0, "reason": "hot"}
    for url in (
        "hooks.slack.com/services/T0/SECRET-7",
        "https://hooks.slack.com/SECRET-7\nX: y",
        "https://h:99999/SECRET-7",
        "ftp://h/SECRET-7",
    ):
        with caplog.at_level(logging.WARNING, logger="aura_hpc"):
            assert deliver(url, "slack", event, timeout_s=0.5, retries=0) is False
    assert "SECRET-7" not in caplog.text and caplog.text.count("is not an http(s) URL") == 4, caplog.text


def test_a_webhook_that_redirects_is_a_failure_not_a_get_that_says_delivered(caplog: pytest.LogCaptureFixture) -> None:
    """urllib followed a 301 as a GET without the alert (an http:// Discord URL redirects to https, and Discord
    answers a GET with 200): the log said delivered. Now the redirect is the failure, said once, not retried."""
    from aura_hpc.ops.webhook import deliver

    seen: list[tuple[str, str]] = []

    class Redirects(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(("POST", self.path))
            self.send_response(301)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/elsewhere")
            self.end_headers()

        def do_GET(self) -> None:
            seen.append(("GET", self.path))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Redirects)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="aura_hpc"):
            ok = deliver(
                f"http://127.0.0.1:{server.server_address[1]}/api/webhooks/1/SECRET",
                "discord",
                {"event": "gpu.fault", "host": "n1", "gpu_index": 0, "reason": "hot"},
                2.0,
                2,
                0.1,
            )
    finally:
        server.shutdown()
    assert ok is False and seen == [("POST", "/api/webhooks/1/SECRET")], seen
    assert "HTTP 301: the URL redirects elsewhere (fix: give the final https:// URL" in caplog.text and "delivered" not in caplog.text
    assert "attempt 1 of 3 failed" in caplog.text and "attempt 2" not in caplog.text and "SECRET" not in caplog.text


def test_monitor_json_samples_at_the_interval(tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    res = run_cli(["monitor", "--interval", "0.3", "--count", "4", "--json", str(out), "--disk", str(tmp_path)])
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert {"time", "host", "cpu_pct", "ram_used_gb", "disk_free_gb", "net_rx_mbps", "net_tx_mbps"} <= row.keys()
        assert "gpus" not in row  # no GPU here: GPU columns absent, not faked
    # Never faster than the interval; on a busy machine a sample may come late, not early.
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(rows)]
    assert all(g >= 0.25 for g in gaps) and sum(gaps) / len(gaps) < 2.0, gaps


def test_the_network_columns_leave_loopback_out() -> None:
    """One machine's ranks talk over 127.0.0.1: 40 MB sent there between two samples is not network traffic."""
    import socket
    import time

    from aura_hpc.ops.gpu_health import NoGpus
    from aura_hpc.ops.resources import Sampler

    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    sampler = Sampler(NoGpus())
    t0 = time.monotonic()
    got, block = 0, b"x" * (1 << 20)
    for _ in range(40):
        sender.sendall(block)
        while got < (_ + 1) << 20:
            got += len(receiver.recv(1 << 20))
    row = sampler.sample()
    loopback_mbps = got * 8 / (time.monotonic() - t0) / 1e6
    for s in (sender, receiver, server):
        s.close()
    assert row["net_rx_mbps"] < loopback_mbps / 4 and row["net_tx_mbps"] < loopback_mbps / 4, (row, loopback_mbps)


def test_the_network_columns_count_a_bonds_bytes_once_and_never_go_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bond's members' bytes were counted again in the bond (twice the traffic), and an interface gone between two
    samples (a NIC reset, a USB adapter pulled) took its whole counter off the sum: a negative rate."""
    import os
    from types import SimpleNamespace

    from aura_hpc.ops.gpu_health import NoGpus
    from aura_hpc.ops.resources import Sampler

    members = {"eth0", "eth1"}  # enslaved to bond0
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p in {f"/sys/class/net/{m}/master" for m in members} or real_exists(p))
    readings = iter(
        [
            {"bond0": (1000, 0), "eth0": (500, 0), "eth1": (500, 0), "wlan0": (9_000_000, 0)},
            {"bond0": (1_001_000, 0), "eth0": (500_500, 0), "eth1": (500_500, 0)},  # wlan0 gone
            {"bond0": (0, 0), "eth0": (0, 0), "eth1": (0, 0), "wlan0": (0, 0)},  # the bond reset: counters from 0
        ]
    )
    import psutil

    monkeypatch.setattr(
        psutil,
        "net_io_counters",
        lambda pernic=True: {n: SimpleNamespace(bytes_recv=r, bytes_sent=t) for n, (r, t) in next(readings).items()},
    )
    sampler = Sampler(NoGpus())
    sampler._t -= 1.0  # one second between the samples
    row = sampler.sample()
    assert 7.9 <= row["net_rx_mbps"] <= 8.0, row  # 1 MB in ~1 s: the bond's, once
    row = sampler.sample()
    assert row["net_rx_mbps"] == 0.0 and row["net_tx_mbps"] == 0.0, row


def test_monitor_shows_gpu_readings_when_there_are_some(tmp_path: Path) -> None:
    replay = tmp_path / "nvml.jsonl"
    replay.write_text(json.dumps([HEALTHY]) + "\n")
    res = run_cli(["monitor", "--interval", "0.1", "--count", "2", "--json", "-", "--replay", str(replay)])
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout.splitlines()[-1])
    assert row["gpus"][0]["temp_c"] == 61 and row["gpus"][0]["name"].startswith("NVIDIA")


def test_the_monitor_table_shows_a_readable_time() -> None:
    import time

    from aura_hpc.console import resources_table

    row = {"host": "n1", "time": 1_700_000_000.25, "cpu_pct": 5.0, "ram_used_gb": 1.0, "ram_pct": 3.0, "disk_free_gb": 9}
    row |= {"net_rx_mbps": 0.1, "net_tx_mbps": 0.2}
    title = str(resources_table(row).title)
    assert title == f"n1  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(1_700_000_000.25))}" and "1700000000" not in title


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []
    calls = 0

    def do_POST(self) -> None:
        type(self).calls += 1
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).calls == 1:
            self.send_response(503)  # the first delivery fails: the trainer must retry once
            self.end_headers()
            return
        type(self).received.append(json.loads(data))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook_server() -> Iterator[tuple[str, type[_Hook]]]:
    _Hook.received, _Hook.calls = [], 0
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/SECRET-TOKEN-123", _Hook
    server.shutdown()


@pytest.mark.parametrize("kind", ["ecc", "thermal", "throttle"])
def test_breaker_stops_all_ranks_checkpoints_alerts_and_exits_distinctly(
    kind: str, tmp_path: Path, prepared: Path, webhook_server: tuple[str, type[_Hook]]
) -> None:
    url, hook = webhook_server
    # The three ways to give the secret URL, one per fault kind: literal, an environment variable, a file.
    url_file = tmp_path / "hook.url"
    url_file.write_text(url + "\n")
    source = {"ecc": f"health.webhook_url={url}", "thermal": "health.webhook_url_env=AURA_TEST_HOOK"}.get(
        kind, f"health.webhook_url_file={url_file}"
    )
    replay = tmp_path / "nvml.jsonl"
    replay.write_text(json.dumps([HEALTHY]) + "\n" + json.dumps([FAULTS[kind]]) + "\n")
    res = run_cli(
        [
            "local",
            "--nproc-per-node",
            "2",
            "--output-dir",
            str(tmp_path / "runs"),
            "--run-name",
            "hot",
            "--set",
            f"data.path={prepared}",
            *["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "data.seq_len=32"],
            *[
                "--set",
                "train.max_steps=100000",
                "--set",
                "train.warmup_steps=2",
                "--set",
                "train.eval_every=0",
                "--set",
                "train.checkpoint_every=0",
            ],
            "--set",
            f"health.nvml_replay={replay}",
            "--set",
            "health.breaker_interval_s=0.2",
            "--set",
            source,
            "--set",
            "health.webhook_retries=1",
        ],
        timeout=240,
        AURA_TEST_HOOK=url,
    )
    assert res.returncode == 76, res.stdout + res.stderr
    run_dir = tmp_path / "runs" / "hot"
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("rank_*.log")}
    assert set(logs) == {"rank_0.log", "rank_1.log"}
    assert "GPU circuit breaker OPEN" in logs["rank_0.log"] and REASON[kind] in logs["rank_0.log"]
    assert "stopped at step" in logs["rank_0.log"] and "status 76" in logs["rank_0.log"]
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert ckpts and (ckpts[-1] / "COMPLETE.json").exists(), "a checkpoint is written while the GPU still answers"
    assert hook.calls == 2 and len(hook.received) == 1, "one delivery, after one retried failure"
    event = hook.received[0]
    assert event["event"] == "gpu.fault" and event["gpu_index"] == 0 and REASON[kind] in event["reason"]
    assert event["readings"]["name"].startswith("NVIDIA") and event["host"] and event["run_dir"] == str(run_dir)
    stored = [p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl", ".log")]
    everything = res.stdout + res.stderr + "".join(stored)
    assert (run_dir / "config.yaml").exists() and len(stored) > 4
    assert "SECRET-TOKEN-123" not in everything, "the webhook URL is a secret"
    if kind == "ecc":
        assert "webhook_url: http://127.0.0.1:" in (run_dir / "config.yaml").read_text() and "<redacted>" in everything
    assert oct((run_dir).stat().st_mode & 0o777) == "0o750", "run directories are not world-readable"


def test_a_gpu_fault_surfacing_where_the_host_waits_for_a_step_is_a_gpu_fault(
    tmp_path: Path, prepared: Path, webhook_server: tuple[str, type[_Hook]]
) -> None:
    """A step never waits for the GPU: an asynchronous CUDA error (an Xid) surfaces where the host next
    waits, most often as the loop reads a step's report. There too it is the GPU's fault: the alert, exit
    76 and the launcher's advice to take the GPU out of service (before: a crash, exit 1, no alert), unless NVML
    reads that GPU healthy."""
    url, hook = webhook_server
    args = ["local", "--nproc-per-node", "2", "--output-dir", str(tmp_path / "runs"), "--run-name", "xid"]
    args += ["--set", f"data.path={prepared}", "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2"]
    args += ["--set", "data.seq_len=32", "--set", "train.max_steps=40", "--set", "train.eval_every=0"]
    args += ["--set", f"health.webhook_url={url}", "--set", "health.webhook_retries=1"]
    # Beside it, the same error where NVML reads the GPU healthy: an illegal access (NVIDIA's Xid 13/31/43) is most
    # often a kernel reading out of bounds, and the node was called faulty ("drain this node", exit 76, an alert).
    replay = tmp_path / "healthy.jsonl"
    replay.write_text(json.dumps([HEALTHY]) + "\n")
    healthy = [*args[:5], "--run-name", "code", *args[7:], "--set", f"health.nvml_replay={replay}"]
    # --max-restarts restarts crashes, not a GPU the breaker named: the agent restarted the workers on it.
    res, code = run_cli_together([[*args, "--max-restarts", "1"], healthy], timeout=240, AURA_FAULT_CUDA="1:5")
    assert res.returncode == 76, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "runs" / "xid" / "logs" / "rank_0.log").read_text().count("start rank=") == 1, "not restarted"
    assert "take this machine's GPU out of service" in res.stdout + res.stderr
    rank1 = (tmp_path / "runs" / "xid" / "logs" / "rank_1.log").read_text()
    assert "CUDA error in the training loop: CUDA error: an illegal memory access" in rank1 and "status 76" in rank1, rank1[-2000:]
    assert "NVML cannot be read here to tell a faulty GPU from a kernel that read out of bounds" in rank1, rank1[-2000:]
    assert len(hook.received) == 1 and hook.received[0]["event"] == "gpu.fault", hook.received
    assert "illegal memory access" in hook.received[0]["reason"] and hook.received[0]["step"] in (5, 6), hook.received
    assert code.returncode == 1 and "out of service" not in code.stdout + code.stderr, code.stdout[-3000:] + code.stderr[-3000:]
    rank1 = (tmp_path / "runs" / "code" / "logs" / "rank_1.log").read_text()
    assert "NVML reads GPU 0 healthy" in rank1 and "rerun with CUDA_LAUNCH_BLOCKING=1" in rank1, rank1[-2000:]


def test_cuda_errors_that_mean_a_broken_gpu_are_recognised() -> None:
    from aura_hpc.ops.gpu_health import blames_the_gpu, is_gpu_error

    assert is_gpu_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_gpu_error(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert not is_gpu_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 4x8)"))
    assert not is_gpu_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    access = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert blames_the_gpu(access, None) is None and blames_the_gpu(access, HEALTHY) is False
    assert blames_the_gpu(access, FAULTS["ecc"]) is True and blames_the_gpu(access, dict(HEALTHY, recovery_action=1)) is True
    assert blames_the_gpu(access, {"index": 3, "uuid": "GPU-dddd", "lost": True}) is True  # a GPU that answers nothing
    assert blames_the_gpu(RuntimeError("CUDA error: uncorrectable ECC error encountered"), HEALTHY) is True


def test_the_breaker_watches_only_the_jobs_own_gpus() -> None:
    from aura_hpc.ops.gpu_health import selection_from_env

    assert selection_from_env({}).keeps(HEALTHY)
    only0 = selection_from_env({"CUDA_VISIBLE_DEVICES": "0"})
    assert only0.keeps(HEALTHY) and not only0.keeps(dict(HEALTHY, index=1))
    slurm = selection_from_env({"SLURM_STEP_GPUS": "2,3"})
    assert slurm.keeps(dict(HEALTHY, index=3)) and not slurm.keeps(HEALTHY)
    by_uuid = selection_from_env({"CUDA_VISIBLE_DEVICES": "0"}, uuids=["aaaa-1111"])
    assert by_uuid.keeps(dict(HEALTHY, index=5, uuid="GPU-AAAA-1111")) and not by_uuid.keeps(dict(HEALTHY, uuid="GPU-bbbb"))
    assert not selection_from_env({"CUDA_VISIBLE_DEVICES": ""}).keeps(HEALTHY), "no GPU visible: none is ours"
    short = selection_from_env({"CUDA_VISIBLE_DEVICES": "GPU-aaaa"})  # CUDA takes a unique prefix of the UUID
    assert short.keeps(dict(HEALTHY, index=5, uuid="GPU-AAAA-1111")) and not short.keeps(dict(HEALTHY, uuid="GPU-bbbb-aaaa"))


def test_a_job_given_some_of_a_nodes_gpus_reads_those_and_is_told_when_it_reads_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML counts every GPU of the node; under Slurm's ConstrainDevices a job given GPUs 4 and 5 may not open
    the others (NO_PERMISSION), and a GPU fallen off the bus answers GPU_IS_LOST. The first refused handle ended
    the reader, so the breaker was off in silence. No GPU here: the real pynvml module with its device calls
    answering as such a node's driver does."""
    import types

    import pynvml

    from aura_hpc.ops.gpu_health import GpuSelection, NoGpus, open_reader
    from aura_hpc.train.loop import health

    allowed: set[int] = {4, 5}

    def handle(i: int) -> str:
        if i == 2:  # another job's GPU fallen off the bus: the node's other GPUs are still read
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if i not in allowed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return f"h{i}"

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 8)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h}")
    reader = open_reader("", GpuSelection(indices=frozenset({4, 5})))
    assert not isinstance(reader, NoGpus)
    assert [(g["index"], g["uuid"]) for g in reader.read()] == [(4, "GPU-h4"), (5, "GPU-h5")]

    # GPU 4 falls off the bus mid-run: its row kept no UUID (the job's selection dropped it) and no field a rule reads.
    def name(h: str) -> str:
        if h == "h4":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", name)
    by_uuid = open_reader("", GpuSelection(uuids=("h4", "h5")))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: name(h) and f"GPU-{h}")  # lost: no UUID either
    rows = by_uuid.read()
    assert rows[0] == {"index": 4, "uuid": "GPU-h4", "lost": True} and rows[1]["uuid"] == "GPU-h5" and "lost" not in rows[1], rows
    assert HealthRules(Thresholds()).evaluate(rows).gpu_index == 4  # type: ignore[union-attr]

    # A driver before R535 has no "event reasons" call, where pynvml names it: the older call, not throttling unseen.
    def event_reasons(h: str) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", event_reasons)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", lambda h: 0x48)
    assert by_uuid.read()[1]["throttle_reasons"] == 0x48

    # GPU 5 answers "Unknown Error" to every call but its name (a driver answers it from what it kept): it kept its UUID
    # and is lost, not dropped from the watch.
    def unknown(*args: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
    for call in ("nvmlDeviceGetUUID", "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature"):
        monkeypatch.setattr(pynvml, call, unknown)
    rows = by_uuid.read()
    assert rows[1] == {"index": 5, "uuid": "GPU-h5", "name": "NVIDIA H100 80GB HBM3", "lost": True}, rows
    allowed.clear()  # a driver that lets this job read none of them: said once, not silent
    monkeypatch.setattr(health, "_cuda", lambda: True)
    monkeypatch.setattr(health, "_visible_uuids", lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    cfg = types.SimpleNamespace(health=types.SimpleNamespace(nvml_replay="", breaker=True, monitor_interval_s=0))
    env = types.SimpleNamespace(local_rank=0, local_world_size=1)
    watch = health.HealthWatch(cfg, env)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="aura_hpc"):
        watch.start(None)
    assert watch.monitor is None and "NVML reads none of this job's GPUs" in caplog.text, caplog.text


def test_a_cuda_error_reads_this_processs_gpu_by_uuid_where_slurm_renumbered_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Slurm's ConstrainDevices CUDA_VISIBLE_DEVICES counts the job's GPUs from 0 while NVML counts the node's:
    an illegal access on a healthy GPU 4 read GPU 0 (another job's, faulty), blamed the node (exit 76, drain) and
    named GPU 0."""
    import types

    from aura_hpc.errors import EXIT_GPU_FAULT, EXIT_TRAIN_FAILED
    from aura_hpc.train.loop import health

    replay = tmp_path / "nvml.jsonl"
    node = [dict(FAULTS["ecc"], index=0, uuid="GPU-aaaa-0000"), dict(HEALTHY, index=4, uuid="GPU-eeee-4444")]
    replay.write_text(json.dumps(node) + "\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(health, "_visible_uuids", lambda: ["GPU-eeee-4444"])
    quiet = {"webhook_url": "", "webhook_url_env": "", "webhook_url_file": ""}  # no alert to send
    cfg = types.SimpleNamespace(health=types.SimpleNamespace(nvml_replay=str(replay), breaker=False, monitor_interval_s=0, **quiet))
    watch = health.HealthWatch(cfg, types.SimpleNamespace(local_rank=1, local_world_size=2, node_rank=0))  # type: ignore[arg-type]
    monkeypatch.setattr(health, "_bound_per_task", lambda local_world: False)
    watch.start(None)
    assert watch.uuids == ["GPU-eeee-4444"]
    device = types.SimpleNamespace(index=0, type="cuda")
    assert watch.gpu_error(RuntimeError("CUDA error: an illegal memory access was encountered"), device, 7) == EXIT_TRAIN_FAILED
    watch.uuids = ["MIG-5e1f-0000"]  # a MIG instance's UUID is no GPU's of NVML: by index then, as before (GPU 0 here)
    assert watch.gpu_error(RuntimeError("CUDA error: an illegal memory access was encountered"), device, 7) == EXIT_GPU_FAULT


def test_another_jobs_faulty_gpu_does_not_stop_training(tmp_path: Path, prepared: Path) -> None:
    replay = tmp_path / "nvml.jsonl"
    other = dict(FAULTS["ecc"], index=1)
    replay.write_text(json.dumps([HEALTHY, dict(HEALTHY, index=1)]) + "\n" + json.dumps([HEALTHY, other]) + "\n")
    args = ["local", "--nproc-per-node", "1", "--output-dir", str(tmp_path / "runs"), "--set", f"data.path={prepared}"]
    args += ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "data.seq_len=32"]
    args += ["--set", "train.max_steps=60", "--set", "train.warmup_steps=2", "--set", "train.eval_every=0"]
    args += ["--set", f"health.nvml_replay={replay}", "--set", "health.breaker_interval_s=0.05"]
    mine = run_cli(args, timeout=240, CUDA_VISIBLE_DEVICES="0")
    assert mine.returncode == 0, mine.stdout[-2000:] + mine.stderr[-2000:]
    assert "circuit breaker OPEN" not in mine.stdout
    theirs = run_cli([*args, "--run-name", "gpu1"], timeout=240, CUDA_VISIBLE_DEVICES="1")
    assert theirs.returncode == 76, "the same reading on the job's own GPU does open the breaker"
