"""Every install ships every command: the wheel built from this tree, installed without -e into a
fresh venv, runs every command's --help, a tiny `local` and a tiny `ps` + `worker` from outside the
source tree (so nothing is imported from the checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import OFFLINE, REPO, SMALL_MODEL, free_port

COMMANDS = ["prepare", "local", "submit", "check", "monitor", "status", "logs", "cancel", "history", "config", "generate", "ps", "worker"]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed alone (--no-deps) into a fresh venv, whose dependencies are this venv's
    (a .pth line: the editable install's own .pth is not read from there). What the wheel carries is
    tested; resolving the dependencies from the registry is .ci/run's install, with the same pins."""
    import sysconfig

    root = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheels = list((root / "dist").glob("aura_hpc-*.whl"))
    assert len(wheels) == 1, wheels
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "deps-from-the-test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


def _run(venv: Path, args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e.update(OFFLINE, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    return subprocess.run([str(venv / "bin" / "python"), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def test_the_installed_wheel_runs_every_command(wheel_venv: Path, tmp_path: Path, prepared: Path) -> None:
    where = _run(wheel_venv, ["-c", "import aura_hpc; print(aura_hpc.__file__)"], tmp_path)
    assert str(wheel_venv) in where.stdout and str(REPO) not in where.stdout, where.stdout + where.stderr
    top = _run(wheel_venv, ["-m", "aura_hpc", "--help"], tmp_path)
    assert top.returncode == 0
    for command in COMMANDS:
        assert command in top.stdout, command
        r = _run(wheel_venv, ["-m", "aura_hpc", command, "--help"], tmp_path)
        assert r.returncode == 0 and "usage:" in r.stdout, (command, r.stderr)
    # The shipped presets and cluster profiles are inside the wheel.
    r = _run(wheel_venv, ["-m", "aura_hpc", "config", "--list"], tmp_path)
    assert r.returncode == 0 and "gpt2-small" in r.stdout, r.stdout + r.stderr
    r = _run(wheel_venv, ["-m", "aura_hpc", "submit", "--dry-run", "--cluster", "h100-ib", "--nodes", "2", "--gpus", "8"], tmp_path)
    assert r.returncode == 0 and "#SBATCH" in r.stdout, r.stdout + r.stderr

    # A tiny local run on the built-in corpus.
    small = [*SMALL_MODEL, "--set", "train.max_steps=4", "--set", "train.checkpoint_every=4", "--set", "data.vocab_size=512"]
    r = _run(wheel_venv, ["-m", "aura_hpc", "local", "--output-dir", str(tmp_path / "runs"), "--run-name", "w", *small], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "runs" / "w" / "summary.json").exists()

    # A tiny parameter-server run: the server and one worker, both from the wheel.
    port = free_port()
    common = ["--output-dir", str(tmp_path / "runs"), "--run-name", "p", "--set", f"data.path={prepared}", *SMALL_MODEL]
    common += ["--set", "train.max_steps=30", "--set", "train.checkpoint_every=0"]
    env = dict(os.environ, **OFFLINE, OMP_NUM_THREADS="1", AURA_PS_SECRET="wheel-test-secret-0123456789")
    env.pop("PYTHONPATH", None)
    py = str(wheel_venv / "bin" / "python")
    with open(tmp_path / "ps.log", "w") as out:
        server = subprocess.Popen(
            [py, "-m", "aura_hpc", "ps", "--workers", "1", "--port", str(port), *common],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while "keep this line private" not in (tmp_path / "ps.log").read_text() and time.monotonic() < deadline:
                assert server.poll() is None, (tmp_path / "ps.log").read_text()
                time.sleep(0.2)
            worker = subprocess.run(
                [py, "-m", "aura_hpc", "worker", "--server", f"127.0.0.1:{port}", *common],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert worker.returncode == 0, worker.stdout[-2000:] + worker.stderr[-2000:]
            assert server.wait(timeout=120) == 0, (tmp_path / "ps.log").read_text()
        finally:
            if server.poll() is None:
                server.kill()
    assert "training finished at version 30" in (tmp_path / "ps.log").read_text()
