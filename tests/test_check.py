"""`check`: real processes, on this host and in two network namespaces joined by a veth pair
(two "LAN machines" with their own addresses). Healthy pairs pass; each fault is one line
naming the cause and the fix, within the timeout."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aura_hpc.ops.network import loopback_interface
from tests.conftest import cli_env, free_port

# The check's own time limit where a fault makes it wait for that limit (what those tests measure).
TIMEOUT = 8
# Where every check should pass: its limit then only bounds a hang. On 2 busy cores beside another test's
# runs, a healthy pair across namespaces measured 0.02 GB/s and was still at its link advice after 8 s (CI).
HEALTHY_TIMEOUT = 90
# What a check may take on the test machine before it counts as hung: its own timeout, plus a start-up that on
# 2 busy cores (five checks importing torch at once beside another test's processes) took past 28 s in CI.
HUNG_S = HEALTHY_TIMEOUT + 150


# `check` on a node that differs: its torch says another version (a LAN machine that installed its own), or its
# clock is off. The patch runs in the check's own process, before it starts.
_PATCHED = "import runpy, sys\nexec(sys.argv.pop(1))\nrunpy.run_module('aura_hpc', run_name='__main__')"
OTHER_TORCH = (
    "from aura_hpc.comm import node_versions as v\nsaid = v.of_this_process\n"
    "v.of_this_process = lambda *a, **k: said(*a, **k) | {'torch': '2.0.0'}"
)
CLOCK_AHEAD = "import time\nreal = time.time\ntime.time = lambda: real() + 30"


def _check(
    args: list[str], netns: str | None = None, timeout: int = TIMEOUT, patch: str = "", env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    start = [sys.executable, "-c", _PATCHED, patch] if patch else [sys.executable, "-m", "aura_hpc"]
    cmd = [*start, "check", "--timeout", str(timeout), "--sizes-mb", "1,4", *args]
    if netns:
        cmd = ["nsenter", f"--net=/run/netns/{netns}", *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(**(env or {})))


def _finish(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=HUNG_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"check hung past its timeout:\n{out}\n{err}") from None
    return p.returncode, out, err


def _pair(
    extra0: list[str],
    extra1: list[str],
    addr: str = "127.0.0.1",
    ns: tuple[str | None, str | None] = (None, None),
    patch1: str = "",
    env1: dict[str, str] | None = None,
) -> list[tuple[int, str, str]]:
    """Two nodes that meet and run every check (HEALTHY_TIMEOUT: nothing in them should wait for a limit)."""
    port = str(free_port())
    base = ["--nnodes", "2", "--master-addr", addr, "--master-port", port]
    p0 = _check([*base, "--node-rank", "0", *extra0], ns[0], HEALTHY_TIMEOUT)
    time.sleep(0.3)
    p1 = _check([*base, "--node-rank", "1", *extra1], ns[1], HEALTHY_TIMEOUT, patch1, env1)
    return [_finish(p0), _finish(p1)]


def _findings(out: str) -> dict[str, dict]:
    return {f["name"]: f for f in json.loads(out)["findings"]}


def test_single_machine_check() -> None:
    code, out, err = _finish(_check(["--json"], timeout=HEALTHY_TIMEOUT))
    assert code == 0, out + err
    f = _findings(out)
    assert f["backend gloo"]["ok"] and f["python"]["ok"] and "free" in f["disk"]["detail"]


_HUNG_LOCAL_CHECK = """
import sys, time
from aura_hpc.ops import check
check.LOCAL_CHECKS_S = 0.5
check.local_checks = lambda report, output_dir, stage: time.sleep(60)  # a GPU or driver that stops answering
check.run(None, None, lambda report, stage: print("timed out in", stage, flush=True))
print("returned", flush=True)
"""


def test_a_peer_gone_mid_check_is_a_finding_and_the_report_still_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl+C on the other laptop, or a Wi-Fi drop, during the measurement: gloo's "Connection reset by peer" was a
    traceback, with no report and no fix."""
    from aura_hpc.ops import check

    def measuring(report: Any, a: Any, stage: list[str]) -> None:
        stage[0] = "bandwidth"
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4242: Connection reset by peer")

    monkeypatch.setattr(check, "local_checks", lambda report, output_dir, stage: None)
    monkeypatch.setattr(check, "cluster_checks", measuring)
    a = check.cluster_args(2, 0, "127.0.0.1", 29999)
    report = check.run(None, a, lambda report, stage: None)
    [f] = [f for f in report.findings if f.name == "bandwidth"]
    assert not f.ok and f.detail.endswith("Connection reset by peer") and "run it again on every node" in f.fix, f


def test_a_single_machine_check_that_hangs_ends_at_its_deadline() -> None:
    """Only a check between machines had a watchdog: a plain `check` on a node whose GPU hung waited for ever."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", _HUNG_LOCAL_CHECK], capture_output=True, text=True, env=cli_env(), timeout=50)
    assert res.returncode == 1 and res.stdout == "timed out in local checks\n", res.stdout + res.stderr
    assert time.monotonic() - t0 < 45


_SLOW_LOCAL_CHECK = """
import runpy, sys, time
from aura_hpc.ops import check
check.LOCAL_CHECKS_S = 0.5
def local_checks(report, output_dir, stage):  # {what}
    if {sleep} > 30:
        stage[0] = {stage!r}
    time.sleep({sleep})
check.local_checks = local_checks
sys.argv = ["aura_hpc", "check", "--json", "--timeout", "{timeout}", *{args}]
runpy.run_module("aura_hpc", run_name="__main__")
"""


@pytest.mark.parametrize(
    ("what", "sleep", "timeout", "args", "stuck"),
    [
        ("a slow CUDA start: --timeout gives the local checks more", 2, 6, [], None),
        ("a hung GPU under check --server", 60, 0.5, ["--server", "127.0.0.1:9"], "local checks"),
        # Blamed on the GPU ("see nvidia-smi"): an NFS server gone under --output-dir.
        ("an output_dir on a mount whose server is gone", 60, 0.5, ["--output-dir", "/shared/runs"], "the disk at /shared/runs"),
    ],
    ids=["slow-local-within-timeout", "server-check-hung-locally", "output-dir-mount-hung"],
)
def test_the_local_checks_get_timeout_and_check_server_has_the_watchdog_too(
    what: str, sleep: float, timeout: float, args: list[str], stuck: str | None
) -> None:
    """--timeout did not reach the local checks (a fixed 60 s, whatever it said), and `check --server` had no
    watchdog at all: a GPU that stopped answering hung it for ever."""
    script = _SLOW_LOCAL_CHECK.format(sleep=sleep, what=what, timeout=timeout, args=args, stage=stuck or "local checks")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=50)
    assert time.monotonic() - t0 < 45, "no hang"
    report = json.loads(res.stdout)
    timed_out = [f for f in report["findings"] if f["name"] == "timeout"]
    if stuck is None:
        assert not timed_out and res.returncode == 0, res.stdout + res.stderr
    else:
        assert res.returncode == 1 and timed_out and f"stuck at: {stuck}" in timed_out[0]["detail"], res.stdout + res.stderr
        assert "within 0.5s" in timed_out[0]["detail"]
        assert ("check the mount" in timed_out[0]["fix"]) == ("disk" in stuck) != ("nvidia-smi" in timed_out[0]["fix"]), timed_out


def test_healthy_pair_on_this_host_with_a_shared_dir(tmp_path: Path) -> None:
    """Node 1 is told --ifname in a shell that exports other names: the flag wins, as in `local` (the exported
    GLOO_SOCKET_IFNAME won, so check tested an interface training would not use, and here failed on it)."""
    t0 = time.perf_counter()
    exported = {"GLOO_SOCKET_IFNAME": "bogus0", "NCCL_SOCKET_IFNAME": "bogus1"}
    lo = loopback_interface() or "lo"
    results = _pair(["--json", "--shared-dir", str(tmp_path)], ["--json", "--shared-dir", str(tmp_path), "--ifname", lo], env1=exported)
    print(f"healthy pair on one host: {time.perf_counter() - t0:.1f}s")
    for code, out, err in results:
        assert code == 0, out + err
        report = json.loads(out)
        f = _findings(out)
        assert report["ok"] and f["all_reduce"]["ok"] and "verified on every rank" in f["all_reduce"]["detail"]
        assert f["shared dir"]["ok"] and f["clock skew"]["ok"] and f["inbound"]["ok"], f["inbound"]
        assert [b["size_mb"] for b in report["bandwidth"]] == [1.0, 4.0] and all(b["busbw_gbps"] > 0 for b in report["bandwidth"])
        assert 0 < report["elapsed_s"] < HEALTHY_TIMEOUT
    assert not (tmp_path / ".aura-check").exists(), "the shared-dir probe files and folders are cleaned up"


def test_a_slurm_jobs_check_leaves_nccls_interface_to_nccl_as_its_training_does() -> None:
    """`submit --check` set NCCL_SOCKET_IFNAME (and gloo's) to the route to the master, often the management Ethernet,
    where the job's training leaves NCCL to pick its own (IPoIB first): a node whose InfiniBand interface is up but
    reaches no other node passed the check, then its training hung. `check` between LAN machines sets both, as `local`."""
    from aura_hpc.ops import check

    lan = check.cluster_args(2, 0, "127.0.0.1", 29999, backend="gloo")
    job = check.cluster_args(2, 0, "127.0.0.1", 29999, backend="gloo", typed_master=False)
    assert lan is not None and job is not None and job.slurm and not lan.slurm
    from aura_hpc.ops.check_cluster import group_interfaces

    assert group_interfaces(lan, "eth0") == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert group_interfaces(job, "eth0") == {}


def test_clocks_30_s_apart_fail_the_check_as_torchs_rendezvous_would_drop_a_node() -> None:
    """torch's rendezvous stamps each node's heartbeat with its own clock and drops a node whose last one looks older than
    15 s: clocks that far apart churn or stop the run at its start. It was a warning, and `check` passed."""
    for code, out, err in _pair(["--json"], ["--json"], patch1=CLOCK_AHEAD):
        skew = _findings(out)["clock skew"]
        assert code == 1 and not skew["ok"] and not skew.get("warning"), out + err
        assert re.match(r"3\d\.\d s between the nodes' clocks", skew["detail"]) and "rendezvous" in skew["detail"], skew
        assert "timedatectl set-ntp true" in skew["fix"], skew


def test_a_backend_that_did_not_start_on_one_node_is_named_on_every_node_without_a_wait() -> None:
    """gloo failed to start in node 1's own check (here a transport it does not have): that node then numbered its
    next group apart from node 0's, and the pair's process group waited out the whole timeout, said on both nodes as
    a firewall or an interface to set."""
    results = _pair(["--json"], ["--json"], env1={"GLOO_DEVICE_TRANSPORT": "bogus"})
    for code, out, err in results:
        group = _findings(out)["process group"]
        assert code == 1 and not group["ok"], out + err
        assert group["detail"] == "gloo did not start on node(s) 1 in that node's own check, so no node tried it together", group
        assert group["fix"] == "the backend finding in node 1's report first" and json.loads(out)["elapsed_s"] < HEALTHY_TIMEOUT / 2
    assert "unsupported gloo device" in _findings(results[1][1])["backend gloo"]["detail"]


def test_nothing_listening_a_node_that_never_joins_and_a_duplicate_node_rank_are_each_named_with_the_fix() -> None:
    """The start-up mistakes on one host, started together (each waits out its timeout): node 1 with
    nothing listening at the master; node 0 whose node 1 never joins; and the usual mistake of three
    machines with "1" typed twice instead of 1 and 2. Node 0 waits for rank 2 until its timeout, so both
    "rank 1"s meet it whatever order they arrive in (with two nodes, one duplicate may finish the whole
    check before the other arrives)."""
    t0 = time.perf_counter()
    alone = _check(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())])
    never = _check(["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port())])
    base = ["--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    three = [_check([*base, "--node-rank", r]) for r in ("0", "1", "1")]
    # A LAN machine with another torch (training refuses it too): named before any process group.
    base = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    versions = [_check([*base, "--node-rank", r], timeout=HEALTHY_TIMEOUT, patch=OTHER_TORCH if r == "1" else "") for r in ("0", "1")]

    code, _, err = _finish(alone)
    assert code == 1
    assert "reach master: connection refused" in err and "fix:" in err and "start `check --node-rank 0`" in err
    assert time.perf_counter() - t0 < 2 * TIMEOUT + 60  # it gives up at its timeout: no hang (a busy machine starts slowly)

    code, _, err = _finish(never)
    assert code == 1
    assert "node rank(s) 1 never joined" in err and "fix:" in err
    assert "this machine's own firewall may drop port" in err  # node 0 is told to look at itself too

    results = [_finish(p) for p in three]
    shown = [(code, err[-600:]) for code, _, err in results]
    dup = [r for r in results if "another machine already joined as --node-rank 1" in r[2]]
    assert len(dup) == 1 and dup[0][0] == 1 and "fix:" in dup[0][2], shown
    assert results[0][0] == 1 and "node rank(s) 2 never joined" in results[0][2], shown

    for code, _, err in [_finish(p) for p in versions]:
        said = "versions: the nodes run different torch versions: node 1 (" + f"{socket.gethostname()[:64]}) runs torch 2.0.0 and node 0"
        assert code == 1 and said in err and "fix: the same torch release on every node, e.g. pip install torch==" in err, err[-1500:]
        assert "all_reduce" not in err


def test_a_master_name_that_resolves_to_loopback_here_is_refused_by_check_and_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian and Ubuntu map a machine's own name to 127.0.1.1 (/etc/hosts): node 0 started with `--master-addr mypc`
    listened on loopback, and the other nodes were told to open their firewall. Literal 127.0.0.1 (nodes on one
    host) and one machine stay allowed. The name's lookup is this test's (the CI machine's /etc/hosts is not ours)."""
    import socket

    from aura_hpc.errors import LaunchError
    from aura_hpc.launch.local import _check_master_addr
    from aura_hpc.ops.check import cluster_args

    real = socket.gethostbyname
    monkeypatch.setattr("aura_hpc.ops.network.socket.gethostbyname", lambda n: "127.0.1.1" if n == "mypc" else real(n))
    expected = r"master address mypc resolves to 127\.0\.1\.1 on this machine .* \(fix: --master-addr <node 0's LAN IP"
    for refuse in (lambda: cluster_args(2, 0, "mypc", 29500), lambda: _check_master_addr("mypc", 2, 0)):
        with pytest.raises(LaunchError, match=expected):
            refuse()
    assert cluster_args(2, 1, "127.0.0.1", 29500) is not None and _check_master_addr("127.0.0.1", 2, 0) == []
    assert cluster_args(1, 0, "mypc", 29500) is not None  # one machine: loopback is where it should listen


def test_a_directory_that_is_not_shared_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    results = _pair(["--shared-dir", str(tmp_path / "a")], ["--shared-dir", str(tmp_path / "b")])
    for code, _, err in results:
        assert code == 1
        assert "is not one shared directory" in err and "does not see the files of node" in err and "fix: mount the same NFS export" in err
    # Each node removed what it wrote (node 0 alone cleaned up: node 1 kept its folder in the folder it was given).
    assert not (tmp_path / "a" / ".aura-check").exists() and not (tmp_path / "b" / ".aura-check").exists()


def test_what_a_stranger_writes_into_the_checks_store_never_becomes_a_path_or_a_node() -> None:
    """Node 0's store takes writes from anyone who reaches its port: the folder name the other nodes
    read there and each node's facts are checked before use (a real store, as `check` makes it)."""
    from datetime import timedelta

    import torch.distributed as dist

    from aura_hpc.comm import stores
    from aura_hpc.ops.check_report import Failed, Report
    from aura_hpc.ops.check_store import node_from_store, peer_token

    tcp = stores.bound_server("127.0.0.1", 0, timedelta(seconds=5))
    store = dist.PrefixStore("aura-check", tcp)
    good = "0123456789abcdef" * 2
    for hostile in ["/etc/sudoers.d", "../../home/user/.ssh", good + "/..", good + "\n", "g" * 32, good[:31]]:
        store.set("shared-token", hostile)
        assert peer_token(store) is None, hostile
    store.set("shared-token", good)
    assert peer_token(store) == good

    facts = {"node_rank": 1, "hostname": "n1", "hostname_ip": None, "ip": "10.0.0.2", "interface": "eth0"}
    facts |= {"uid": 1000, "gid": 1000, "user": "ana", "pid": 42}
    store.set("info1", json.dumps(facts))
    assert node_from_store(Report(), store, 1) == facts
    for hostile, said in [
        (json.dumps(facts | {"node_rank": "../x"}), "not a node's facts"),
        (json.dumps(facts | {"node_rank": 0}), "it says node rank 0"),
        (json.dumps({k: v for k, v in facts.items() if k != "hostname"}), "not a node's facts"),
        ("[" * 20_000, "recursion"),  # too deep for json: RecursionError, a line, not a traceback
        (b"\xff\xfe", ""),
        ("x" * 70_000, "70000 bytes"),
        # A hostname as rich markup and terminal escapes (a link, blinking text, the window's title): never shown.
        (json.dumps(facts | {"hostname": "n1\x1b]8;;http://evil.example/fix.sh\x1b\\[blink]run this[/]"}), "control characters"),
        (json.dumps(facts | {"user": "a" * 300}), "over 255 characters"),
    ]:
        store.set("info1", hostile)
        report = Report()
        with pytest.raises(Failed):
            node_from_store(report, store, 1)
        (line,) = [f.line() for f in report.findings]
        assert line.startswith("rendezvous: node rank 1's facts in the master's store are not what `check` writes") and said in line, line
        assert "fix: another program wrote into the check's port" in line


# ---- two "machines": network namespaces with their own addresses -------------------------


def test_healthy_pair_across_two_network_namespaces(two_hosts: tuple[str, str]) -> None:
    t0 = time.perf_counter()
    results = _pair(["--json"], ["--json"], addr="10.77.1.1", ns=two_hosts)
    print(f"healthy pair across namespaces: {time.perf_counter() - t0:.1f}s")
    for code, out, err in results:
        assert code == 0, out + err
        report = json.loads(out)
        assert report["ok"]
        assert {n["ip"] for n in report["nodes"]} == {"10.77.1.1", "10.77.1.2"}
        assert {n["interface"] for n in report["nodes"]} == {f"va{two_hosts[0][-6:]}", f"vb{two_hosts[0][-6:]}"}
        assert _findings(out)["inbound"]["ok"]


def test_a_node_whose_firewall_lets_no_connection_in_is_named_before_training(two_hosts: tuple[str, str]) -> None:
    """Node 1's firewall refuses every connection coming in (its own to node 0 go out): the check met at node 0's port and
    passed, and training waited at the workers' store, which torch's rendezvous may put on node 1, and at gloo's links."""
    if shutil.which("iptables") is None:
        pytest.skip("iptables is not installed (CI installs it with docker.io)")
    rule = ["INPUT", "-p", "tcp", "--syn", "-j", "REJECT"]
    iptables = ["nsenter", f"--net=/run/netns/{two_hosts[1]}", "iptables"]
    r = subprocess.run([*iptables, "-A", *rule], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    try:
        results = _pair(["--json"], ["--json"], addr="10.77.1.1", ns=two_hosts)
    finally:  # the pair of namespaces serves the module's other tests
        subprocess.run([*iptables, "-D", *rule], capture_output=True, timeout=20, check=True)
    for code, out, err in results:
        f = _findings(out)
        assert code == 1 and not f["inbound"]["ok"] and "process group" not in f, out + err
        assert "cannot open a connection to" in f["inbound"]["detail"] and "sudo ufw allow from 10.77.1.1" in f["inbound"]["fix"], f
    assert "node 1 at 10.77.1.2: connection refused" in _findings(results[0][1])["inbound"]["detail"]


def test_a_wrong_master_address_and_a_master_not_started_across_namespaces(two_hosts: tuple[str, str]) -> None:
    """From the second machine, started together: an address nobody has, then the first machine's address
    with nothing started there."""
    t0 = time.perf_counter()
    nobody = _check(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.77.1.99", "--master-port", str(free_port())], two_hosts[1])
    idle = _check(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.77.1.1", "--master-port", str(free_port())], two_hosts[1])
    code, _, err = _finish(nobody)
    assert code == 1 and "reach master:" in err and ("no answer" in err or "no route" in err) and "fix:" in err, err
    assert time.perf_counter() - t0 < 2 * TIMEOUT + 60  # it gives up at its timeout: no hang
    code, _, err = _finish(idle)
    assert code == 1 and "connection refused" in err and "open TCP port" in err, err


def test_check_on_a_rate_limited_link_recommends_diloco(two_hosts: tuple[str, str]) -> None:
    """Both ends of the pair's link shaped to 20 Mbit/s with tc tbf: `check` with the run's config
    measures the link and names the strategy that suits it, with the expected speed-up."""
    a, b = two_hosts
    tag = a[-6:]
    for ns, dev in ((a, f"va{tag}"), (b, f"vb{tag}")):
        r = subprocess.run(
            ["nsenter", f"--net=/run/netns/{ns}", "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "20mbit",
             "burst", "64kbit", "latency", "400ms"],
            capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode:
            pytest.skip(f"tc tbf is not available here: {r.stderr.strip()}")
    try:
        model = ["--set", "model.n_layer=4", "--set", "model.n_embd=256", "--set", "model.n_head=4", "--set", "train.batch_size=8"]
        results = _pair(model, model, addr="10.77.1.1", ns=two_hosts)
    finally:
        for ns, dev in ((a, f"va{tag}"), (b, f"vb{tag}")):
            subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    code, out, err = results[0]
    assert code == 0, out + err
    line = next((ln for ln in out.splitlines() if "link advice" in ln), "")
    m = re.search(r"link (\d+) Mbit/s", line)
    assert m and 8 <= int(m.group(1)) <= 25, line
    # In Mbit/s, not "0.00 GB/s" (rounded to 3 decimals of GB/s, a link under 4 Mbit/s divided by zero in the advice).
    measured = next((ln for ln in out.splitlines() if "bus bandwidth up to" in ln), "")
    assert re.search(r"up to \d+\.\d Mbit/s \(1 MiB: ", measured), measured
    assert "use --set dist.strategy=diloco" in line and "one node)" in line, line


def test_a_gpu_machine_whose_torch_sees_no_gpu_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only wheel on a GPU laptop, or a driver older than torch's CUDA: the check said "none seen: CPU training"
    and passed, and `local` trained on the CPUs."""
    from aura_hpc.ops import check_local
    from aura_hpc.ops.check_report import Report

    monkeypatch.setattr(check_local, "gpu_device_nodes", lambda: "here")
    report = Report()
    check_local.local_checks(report, str(tmp_path))
    [f] = [f for f in report.findings if f.name == "gpus"]
    assert not f.ok and "this machine has NVIDIA GPUs, and torch sees none" in f.detail and "install a torch build" in f.fix, f
    # Devices this process may not open (a Slurm shell without --gpus): CPU training, said, and no torch to reinstall.
    monkeypatch.setattr(check_local, "gpu_device_nodes", lambda: "denied")
    report = Report()
    check_local.local_checks(report, str(tmp_path))
    [f] = [f for f in report.findings if f.name == "gpus"]
    assert f.ok and f.warning and "none of them open to this process" in f.detail and "--gpus" in f.fix, f


def test_gpu_device_nodes_a_cgroup_denies_are_told_from_none_and_from_usable_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import glob as globs
    import os

    from aura_hpc.ops import check_local

    monkeypatch.setattr(globs, "glob", lambda pattern: [])
    assert check_local.gpu_device_nodes() == ""
    monkeypatch.setattr(globs, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia1"])

    def denied(path: str, flags: int) -> int:
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(os, "open", denied)
    assert check_local.gpu_device_nodes() == "denied"
    monkeypatch.setattr(os, "open", lambda path, flags: os.dup(0) if path.endswith("1") else denied(path, flags))
    assert check_local.gpu_device_nodes() == "here"


def test_the_local_checks_name_the_disk_they_wait_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the watchdog's line names when the stat of --output-dir never returns (an NFS server gone)."""
    import shutil

    from aura_hpc.ops import check_local
    from aura_hpc.ops.check_report import Report

    class Waited(Exception):
        pass

    def never_returns(path: object) -> None:
        raise Waited

    monkeypatch.setattr(check_local, "_try_backend", lambda backend: (True, ""))
    monkeypatch.setattr(shutil, "disk_usage", never_returns)
    stage = ["local checks"]
    with pytest.raises(Waited):
        check_local.local_checks(Report(), "/shared/runs", stage)
    assert stage == ["the disk at /shared/runs"]
