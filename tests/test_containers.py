"""Containers: the compose file (validated by docker-compose itself, and golden), the launch
variables the Docker guide uses, and real containers of the CPU image (docker/build-cpu-image.sh,
built by CI beside the first tests): `check`, a plain program, and two containers training as two LAN nodes.
The GPU service (NVIDIA Container Toolkit) cannot run without a GPU: only its configuration is
checked here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, SMALL_MODEL, cli_env, free_port, run_cli

IMAGE = os.environ.get("AURA_TEST_IMAGE", "aura-hpc:cpu")
GOLDEN = REPO / "tests" / "golden" / "compose-config.yaml"
TINY = [*SMALL_MODEL, *[x for kv in ("data.vocab_size=1024", "train.max_steps=12", "train.checkpoint_every=6") for x in ("--set", kv)]]
TINY += ["--set", "train.log_every=4", "--set", "train.sample_tokens=4"]


def _compose_config(**env: str) -> str:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (CI installs Debian's docker-compose)")
    r = subprocess.run(
        ["docker-compose", "-f", str(REPO / "compose.yaml"), "config"],
        cwd=REPO,
        # The golden file shows what a user's shell gives it: no run secret from the test env.
        env={**{k: v for k, v in cli_env().items() if k != "AURA_RUN_SECRET"}, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_compose_file_is_valid_and_reserves_the_gpus_on_the_host_network() -> None:
    env = {"AURA_RUNS": "/srv/runs", "AURA_DATA": "/srv/Data", "MASTER_ADDR": "192.168.1.10", "NNODES": "5", "NODE_RANK": "2"}
    text = _compose_config(**env).replace(str(REPO), "REPO")
    if os.environ.get("AURA_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"compose.yaml renders differently: review and regenerate {GOLDEN}"
    services = yaml.safe_load(text)["services"]
    gpu = services["trainer"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [{"capabilities": ["gpu"], "count": "all", "driver": "nvidia"}]
    assert gpu["network_mode"] == "host" and gpu["ipc"] == "host"
    assert gpu["environment"]["MASTER_ADDR"] == "192.168.1.10" and gpu["environment"]["NNODES"] == "5"
    assert gpu["environment"]["MASTER_PORT"] is None  # unset stays unset (not an empty string)
    assert gpu["environment"]["AURA_RUN_SECRET"] is None  # passed through from the shell, never baked in
    assert "/srv/runs:/work/runs:rw" in gpu["volumes"] and "/srv/Data:/work/Data:rw" in gpu["volumes"]
    assert "deploy" not in services["trainer-cpu"]
    assert {k: v for k, v in services["trainer-cpu"].items() if k != "deploy"} == {k: v for k, v in gpu.items() if k != "deploy"}


def test_dockerignore_keeps_runs_and_data_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {"runs", "data", "Data", "checkpoints", ".git"} <= ignored
    text = (REPO / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=" in text and "USER aura" in text and 'ENTRYPOINT ["/opt/aura_hpc/entrypoint.sh"]' in text


def test_the_entry_point_knows_every_command_of_the_cli() -> None:
    import argparse
    import re

    from aura_hpc.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = re.search(r'""\|-\*\|([a-z|]+)\)', (REPO / "docker" / "entrypoint.sh").read_text())
    assert listed is not None and set(listed.group(1).split("|")) == set(sub.choices)


def test_the_guides_launch_variables_fill_locals_flags(tmp_path: Path) -> None:
    env = {"AURA_LOCAL_FROM_ENV": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12355", "NNODES": "2", "NODE_RANK": "1"}
    r = run_cli(
        ["local", "--output-dir", str(tmp_path), "--dry-run", "--set", "dist.backend=gloo", "--set", "train.allow_oversubscription=true"],
        **env,
        GPUS_PER_NODE="1",
    )
    assert r.returncode == 0, r.stderr
    assert "node 1/2, 1 process, master 127.0.0.1:12355" in r.stdout, r.stdout
    flag_wins = run_cli(["local", "--output-dir", str(tmp_path), "--dry-run", "--nnodes", "1", "--node-rank", "0"], **env)
    assert "node 0/1" in flag_wins.stdout, flag_wins.stdout + flag_wins.stderr
    bad = run_cli(["local", "--output-dir", str(tmp_path), "--dry-run"], **{**env, "NNODES": "two"})
    assert bad.returncode == 2 and "NNODES='two' is not a whole number" in bad.stderr, bad.stderr
    outside = run_cli(["local", "--output-dir", str(tmp_path), "--dry-run"], MASTER_ADDR="10.9.9.9", NNODES="2")
    assert "node 0/1" in outside.stdout  # without the image's AURA_LOCAL_FROM_ENV, a shell's variables change nothing
    assert "master 127.0.0.1 (a free port)" in outside.stdout  # bound by the rendezvous store as it starts


# ---- real containers -------------------------------------------------------------------


def _wait_for_the_build(status: Path, log: Path, timeout: float = 1200) -> None:
    """CI builds the image beside the first tests (`.ci/run`: AURA_TEST_IMAGE_BUILD names the file its build
    writes its exit status to); a build that failed fails these tests with its log's last lines, never a skip."""
    deadline = time.monotonic() + timeout
    while not status.is_file():
        if time.monotonic() > deadline:
            pytest.fail(f"the image build CI started had not finished after {timeout:.0f} s (log: {log})")
        time.sleep(2)
    code = status.read_text().strip()
    if code != "0":
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.is_file() else []
        pytest.fail(f"the image build CI started exited {code} (log: {log}):\n" + "\n".join(tail))


@pytest.fixture(scope="module")
def image() -> str:
    building = os.environ.get("AURA_TEST_IMAGE_BUILD")
    if building:
        _wait_for_the_build(Path(building), Path(os.environ.get("AURA_TEST_IMAGE_LOG", "/tmp/aura-ci-image.log")))
    missing = pytest.fail if building else pytest.skip  # where CI built the image, none of this may be missing
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        missing("docker and docker-compose are not installed (CI installs docker.io and docker-compose)")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        missing("no Docker daemon is running (CI starts dockerd)")
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30).returncode != 0:
        missing(f"image {IMAGE} is not built (docker/build-cpu-image.sh builds it; CI does)")
    return IMAGE


def test_a_build_leaves_no_untagged_image_of_its_own(image: str) -> None:
    """Each build used to leave the image its tag named before and its install stage as untagged images, about
    4 GB a build: on a disk kept between CI runs, 55 GB of them made a run fail with "no space left on device".
    The script labels every image of its builds and removes the untagged ones at its exit."""
    if not os.environ.get("AURA_TEST_IMAGE_BUILD"):
        pytest.skip("the image was not built by this run (CI builds it with docker/build-cpu-image.sh)")
    label = "org.aura-hpc.built-by=docker/build-cpu-image.sh"

    def docker(*args: str) -> str:
        return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    assert docker("image", "inspect", "-f", '{{index .Config.Labels "org.aura-hpc.built-by"}}', image) == label.split("=", 1)[1]
    assert docker("images", "-q", "--filter", "dangling=true", "--filter", f"label={label}") == ""  # the install stage's too


def _runs_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    os.chown(path, 1000, 1000)  # the image's non-root user writes there, as the compose file's default uid
    return path


def _compose_run(args: list[str], runs: Path, image: str, **env: str) -> subprocess.Popen[str]:
    cmd = ["docker-compose", "-f", str(REPO / "compose.yaml"), "run", "--rm", "-T", "trainer-cpu", *args]
    full = {**cli_env(), "AURA_IMAGE": image, "AURA_RUNS": str(runs), "AURA_DATA": str(runs), **env}
    return subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def test_check_a_plain_program_and_two_containers_training_as_two_lan_nodes(tmp_path: Path, image: str) -> None:
    """Four containers at once: `check`, a plain program, and two `local` nodes of one run (each node's
    own run folder, as on two machines; node 0's holds the checkpoints)."""
    checked = _compose_run(["check", "--json"], _runs_dir(tmp_path / "check"), image)
    plain = _compose_run(["python", "-c", "import torch; print('torch', torch.__version__)"], _runs_dir(tmp_path / "plain"), image)
    port = str(free_port())
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NNODES": "2", "GPUS_PER_NODE": "1"}
    nodes = [_compose_run(["local", *TINY], _runs_dir(tmp_path / f"node{k}"), image, NODE_RANK=str(k), **launch) for k in (0, 1)]
    code, out, err = _finish(checked)
    assert code == 0, out + err
    findings = {f["name"]: f for f in json.loads(out)["findings"]}
    assert findings["backend gloo"]["ok"], findings
    code, out, err = _finish(plain)
    assert code == 0 and out.startswith("torch "), out + err  # other programs run as given (nvidia-smi on GPU hosts)
    results = [_finish(p) for p in nodes]
    for code, out, err in results:
        assert code == 0, out + err
    logs = "".join(out + err for _, out, err in results)
    assert "world_size=2" in logs and "node_rank=1" in logs, logs
    run = tmp_path / "node0" / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 12 and summary["finished"]
    assert (run / "checkpoints" / "step_00000012" / "COMPLETE.json").is_file()
    assert (run / "config.yaml").stat().st_uid == 1000  # written by the non-root user
    assert not (tmp_path / "node1" / "tiny" / "checkpoints").exists()  # rank 0 on node 0 writes the checkpoints


def test_a_slurm_job_runs_inside_an_apptainer_image(slurm_cluster: Path, prepared: Path, tmp_path: Path, image: str) -> None:
    """A real 2-node Slurm job whose tasks run `apptainer exec ... python3` as the plan renders it.
    Apptainer itself cannot be installed here: tests/containers/apptainer stands in for it (it runs
    the same command in a Docker container of the image named by the .sif file)."""
    sif = tmp_path / "aura.sif"
    sif.write_text(image + "\n")
    out = tmp_path / "runs"
    mounts = f"{tmp_path}:{tmp_path},{prepared.parent}:{prepared.parent}:ro"
    args = ["submit", "--nodes", "2", "--gpus", "0", "--time", "10", "--output-dir", str(out), "--run-name", "boxed"]
    args += ["--set", f"data.path={prepared}", *SMALL_MODEL]
    args += ["--set", "train.max_steps=8", "--container", "apptainer", "--container-image", str(sif), "--container-mounts", mounts]
    stand_in = str(REPO / "tests" / "containers")
    r = run_cli([*args, "--wait"], timeout=300, PATH=f"{stand_in}:{os.environ['PATH']}", AURA_HPC_HOME=str(tmp_path / "home"))
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = out / "boxed"
    assert "apptainer exec --bind" in (run_dir / "submission.sh").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 8 and summary["world_size"] == 2 and summary["finished"]
    errs = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_log.err"))
    assert errs.count(f"apptainer stand-in: docker run {image} python3 -u -m submitit.core._submit") == 2, errs


def test_the_first_host_of_a_slurm_nodelist_without_scontrol() -> None:
    from aura_hpc.slurm.job import first_host_of

    cases = {"n1": "n1", "n[1-4]": "n1", "gpu[007-012,020],cpu3": "gpu007", "a-b[01-02]-ib": "a-b01-ib", "r[1-2]-n[3-4]": "r1-n3"}
    for nodelist, first in cases.items():
        assert first_host_of(nodelist) == first, nodelist
    # The worker's second host (where rank 0's store must be reachable from): the text after a bracket was lost,
    # so node[1-2]-ib gave node1, node2 and rank 0 bound its store to a name that was not a node.
    from aura_hpc.train.process.dist_env import hostnames

    seconds = {"node[1-2]-ib": "node2-ib", "rack[1-2]-node[01-04]": "rack1-node02", "gpu[007],cpu3": "cpu3", "n[9-10]": "n10"}
    for nodelist, second in seconds.items():
        assert hostnames(nodelist)[1] == second, nodelist
    # The job's rendezvous port is never torchrun's or c10d's default, where other jobs on a shared node listen.
    from aura_hpc.slurm.job import rendezvous_port

    ports = {rendezvous_port(job, restarts) for job in range(18000, 19000) for restarts in (0, 1)}
    assert ports and not any(29400 <= port < 29600 for port in ports)
