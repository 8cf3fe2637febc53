"""Shared fixtures: a tiny prepared dataset and helpers that run the real CLI in subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

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


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE)
    # Two ranks on two cores: one thread each (oversubscription cost 2.6x on this machine kind).
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aura_hpc", *args],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in corpus, prepared once for the whole session."""
    from aura_hpc.data.prepare import PrepareSpec, prepare

    out = tmp_path_factory.mktemp("data") / "aura-es"
    prepare(PrepareSpec(out_dir=out, builtin=True, vocab_size=1024, val_fraction=0.05))
    return out


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from aura_hpc.train import checkpoint

    newest = checkpoint.list_complete(run_dir / "checkpoints")[0]
    return load_file(str(newest.path / "model" / "model.safetensors"))
