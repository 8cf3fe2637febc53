"""Shared fixtures: a tiny prepared dataset and helpers that run the real CLI in subprocesses."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_CORPUS = REPO.parent / "shared" / "data" / "quijote.txt"

# Nothing in the tests may reach a hub.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)


# The small model and quiet logging that the multi-process tests train (seconds per run on CPU).
SMALL_MODEL = [
    "--set",
    "model.n_layer=2",
    "--set",
    "model.n_embd=64",
    "--set",
    "model.n_head=2",
    "--set",
    "data.seq_len=64",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.log_every=5",
]


RUN_SECRET = "tests-run-secret-0123456789"


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE)
    # Two ranks on two cores: one thread each (oversubscription cost 2.6x on this machine kind).
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # LAN tests start their nodes as a user who chose one secret for the run on every machine does
    # (each node otherwise needs the one node 0 prints); the secret tests set their own, or none.
    env.setdefault("AURA_RUN_SECRET", RUN_SECRET)
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aura_hpc", *args],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_PORTS_HANDED: list[int] = []
PORT_BLOCK = 1000


def free_port() -> int:
    """A free port for a test to give a launcher, which binds it seconds later. Below the kernel's ephemeral range
    (where bind(0) and every outgoing connection take their ports, so one picked there can be taken meanwhile:
    a run that failed to start in the suite), each xdist worker in a block of its own, never the same twice."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 0
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    base = 20000 + worker * PORT_BLOCK
    if base + PORT_BLOCK > first:  # the ephemeral range starts low here: only bind(0) is left
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(PORT_BLOCK):
        port = base + (len(_PORTS_HANDED) + os.getpid()) % PORT_BLOCK
        _PORTS_HANDED.append(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_BLOCK - 1}")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in corpus, prepared once for the whole session."""
    from aura_hpc.data.prepare import PrepareSpec, prepare

    out = tmp_path_factory.mktemp("data") / "aura-es"
    prepare(PrepareSpec(out_dir=out, builtin=True, vocab_size=1024, val_fraction=0.05))
    return out


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from aura_hpc.train.checkpoint import files as checkpoint

    newest = checkpoint.list_complete(run_dir / "checkpoints")[0]
    return load_file(str(newest.path / "model" / "model.safetensors"))


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard shows them with its Python loader (--load_fast=false, or where its Rust
    data server does not run): that one drops a crashed attempt's points only on a session start after a first."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    runs = EventMultiplexer(tensor_size_guidance={"scalars": 0})  # 0: every point, not a sample
    runs.AddRunsFromDirectory(str(folder))
    runs.Reload()
    [name] = runs.Runs()
    return [e.step for e in runs.Tensors(name, tag)]


def max_diff(a: dict, b: dict) -> float:
    """The largest elementwise difference between two state dicts with the same keys."""
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


CLUSTER_SH = REPO / "tests" / "slurm" / "cluster.sh"
SLURM_STATE = Path(os.environ.get("AURA_SLURM_STATE", "/tmp/aura-slurm"))
SLURM_CONF = SLURM_STATE / "etc" / "slurm.conf"


def _slurm_ping() -> bool:
    env = dict(os.environ, SLURM_CONF=str(SLURM_CONF))
    try:
        return subprocess.run(["scontrol", "ping"], env=env, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Path]:
    """A real Slurm on this machine, started for the session (and stopped if we started it)."""
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
        pytest.skip("needs Debian's slurm-wlm, munge, slurmdbd and mariadb-server (.ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("starting munged/slurmctld/slurmd needs root (CI runs as root)")
    started = False
    if not _slurm_ping():
        t0 = time.perf_counter()
        subprocess.run([str(CLUSTER_SH), "up"], check=True, timeout=180)
        print(f"slurm cluster up in {time.perf_counter() - t0:.1f}s")
        started = True
    os.environ["SLURM_CONF"] = str(SLURM_CONF)
    yield SLURM_CONF
    if started:
        subprocess.run([str(CLUSTER_SH), "down"], timeout=120)


def run_cli_together(
    runs: list[list[str]], timeout: float = 600, prefixes: list[list[str]] | None = None, **env: str
) -> list[subprocess.CompletedProcess[str]]:
    """Several CLI runs at once: a short training run spends most of its time starting up (imports,
    rendezvous), which overlaps well on two cores. Results in the order given. `prefixes`: what each
    command runs under (`nsenter --net=...`: a machine of its own on the network)."""
    procs = [
        subprocess.Popen(
            [*pre, sys.executable, "-m", "aura_hpc", *args],
            env=cli_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, pre in zip(runs, prefixes or [[] for _ in runs], strict=True)
    ]
    done = []
    for args, p in zip(runs, procs, strict=True):
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(args, p.returncode, out, err))
    return done


def make_two_hosts() -> tuple[str, str] | str:
    """Two network namespaces joined by a veth pair, 10.77.1.1 and 10.77.1.2: two machines on one link
    (their names), or why they cannot be made here."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "network namespaces need root and iproute2 (CI runs as root)"
    tag = uuid.uuid4().hex[:6]
    a, b = f"aura-a-{tag}", f"aura-b-{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    cmds = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
        ["ip", "link", "set", va, "netns", a],
        ["ip", "link", "set", vb, "netns", b],
        ["nsenter", f"--net=/run/netns/{a}", "ip", "addr", "add", "10.77.1.1/24", "dev", va],
        ["nsenter", f"--net=/run/netns/{b}", "ip", "addr", "add", "10.77.1.2/24", "dev", vb],
    ]
    for ns, dev in ((a, va), (b, vb)):
        cmds += [
            ["nsenter", f"--net=/run/netns/{ns}", "ip", "link", "set", dev, "up"],
            ["nsenter", f"--net=/run/netns/{ns}", "ip", "link", "set", "lo", "up"],
        ]
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True, timeout=20)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        remove_hosts((a, b))
        return f"cannot create network namespaces here: {exc}"
    return a, b


def remove_hosts(names: tuple[str, ...]) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[tuple[str, str]]:
    hosts = make_two_hosts()
    if isinstance(hosts, str):
        pytest.skip(hosts)
    yield hosts
    remove_hosts(hosts)


@pytest.fixture(scope="session")
def s3() -> Iterator[Any]:
    """A real S3-compatible server (moto's server mode) on a local port, signing checked."""
    pytest.importorskip("moto", reason="needs moto[server] (the dev extra)")
    pytest.importorskip("s3fs", reason="needs s3fs (the s3 and dev extras)")
    from tests.s3_server import start

    server = start(free_port())
    yield server
    server.stop()


# Parallel runs (`pytest -n auto`, pytest-xdist with `--dist loadgroup`, set in pyproject.toml): each
# file runs whole on one worker, so its module fixtures (a baseline run, a built wheel) are made once.
# Files that share one machine-wide resource form one group: the test Slurm cluster is started and
# stopped by whichever worker holds the group, and its four nodes would queue two files' jobs.
_SHARED_GROUP = {"test_slurm.py": "slurm", "test_containers.py": "slurm", "test_script_safety.py": "slurm"}
# test_containers.py last in its group: CI builds the image its real containers run beside the first tests
# (2.5 minutes on an idle machine, one core of two idle, that the suite no longer waits for), and the group's Slurm tests come first.
_LAST_IN_GROUP = ("test_containers.py",)
# The order the groups are handed out in. xdist (3.7+) keeps it only with `--no-loadscope-reorder`
# (pyproject.toml's addopts): by default it sorts the groups by their number of tests, which ran the
# one-process refusals of test_bad_inputs.py (71 tests) beside the Slurm group first, both cores
# half idle for the first five minutes (a per-test profile, 2026-11-28).
# The Slurm group goes first: it waits on the scheduler and on its jobs (outside pytest) most of its
# 340 s, which the other worker fills with the groups that use both cores most (CPU-s per second of
# wall, measured beside it); then the longest first, so that no long file starts last.
_FIRST = ("slurm", "test_users_shapes.py", "test_memory_plan.py", "test_slow_links.py", "test_disk_full.py")
# Seconds per group on one of two busy workers (`-n 2` on 2 cores in this order, a per-test profile,
# 2026-11-28, 15:28 in all; test_faults.py less the 62 s its file alone gained when its stopped runs started together).
_GROUP_SECONDS = {
    "slurm": 339,
    "test_faults.py": 286,
    "test_strategies.py": 122,
    "test_users_shapes.py": 100,
    "test_training.py": 90,
    "test_slow_links.py": 86,
    "test_ps.py": 84,
    "test_s3.py": 71,
    "test_memory_plan.py": 70,
    "test_bad_inputs.py": 56,
    "test_gpu_contract.py": 53,
    "test_tracking.py": 50,
    "test_compute_options.py": 37,
    "test_wire.py": 36,
    "test_disk_full.py": 35,
    "test_check.py": 34,
    "test_ps_hostile.py": 31,
    "test_health.py": 27,
    "test_stream.py": 25,
    "test_exit_statuses.py": 25,
    "test_hang_watch.py": 19,
    "test_meta_init.py": 15,
    "test_screen.py": 15,
    "test_data_position.py": 15,
    "test_prepare.py": 13,
    "test_benchmarks.py": 12,
    "test_wheel.py": 11,
    "test_submit_dryrun.py": 8,
}


def _order(group: str) -> tuple[int, int]:
    return (_FIRST.index(group), 0) if group in _FIRST else (len(_FIRST), -_GROUP_SECONDS.get(group, 0))


def _group(item: pytest.Item) -> str:
    return _SHARED_GROUP.get(item.path.name, item.path.name)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids (else every file is split)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    # A stable sort: within a file the tests keep their order.
    items.sort(key=lambda it: (_order(_group(it)), _group(it), it.path.name in _LAST_IN_GROUP))
