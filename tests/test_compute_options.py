"""The speed options of the trainer change how it computes, not what it learns (checked on CPU). torch.compile's
case is tests/test_gpu_contract.py's compile test, whose compiled run is compared there with an eager one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_MODEL, cli_env, final_weights, max_diff, run_cli

pytestmark = pytest.mark.slow


def _args(tmp: Path, name: str, prepared: Path, *extra: str, nproc: int = 1) -> list[str]:
    args = ["local", "--nproc-per-node", str(nproc), "--output-dir", str(tmp), "--run-name", name, "--set", f"data.path={prepared}"]
    args += [*SMALL_MODEL, "--set", "train.max_steps=6", "--set", "train.warmup_steps=1", "--set", "train.batch_size=4"]
    return [*args, *extra]


def _train(tmp: Path, name: str, prepared: Path, *extra: str, nproc: int = 1, env: dict[str, str] | None = None) -> str:
    r = run_cli(_args(tmp, name, prepared, *extra, nproc=nproc), timeout=300, **(env or {}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _train_together(tmp: Path, prepared: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Several one-process runs at once (each spends most of its time starting up): their outputs by name."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "aura_hpc", *_args(tmp, name, prepared, *extra)],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, extra in runs.items()
    }
    outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: {outs[name][-3000:]}"
    return outs


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> dict[str, torch.Tensor]:
    """The default CPU route (eager, no activation checkpointing, full loss): what the options must match."""
    out = tmp_path_factory.mktemp("plain")
    _train(out, "plain", prepared)
    return final_weights(out / "plain")


def test_chunked_loss_trains_like_the_full_loss(tmp_path: Path, prepared: Path) -> None:
    # fp64 and SGD: the two routes differ only in summation order (~1e-16); Adam would amplify
    # that on near-zero gradients (update ~ g / eps), SGD passes it through as is.
    fp64 = ("--set", "train.precision=fp64", "--set", "train.optimizer=sgd", "--set", "train.lr=0.05")
    # "init": the weights before any update (a run of 0 optimizer steps does not exist: SGD at lr ~0).
    init = ("--set", "train.precision=fp64", "--set", "train.optimizer=sgd", "--set", "train.lr=1e-300")
    outs = _train_together(
        tmp_path, prepared, {"chunked": (*fp64, "--set", "train.loss=chunked"), "full": (*fp64, "--set", "train.loss=full"), "init": init}
    )
    assert "loss chunked" in outs["chunked"]
    diff = max_diff(final_weights(tmp_path / "chunked"), final_weights(tmp_path / "full"))
    assert diff < 1e-12, f"chunked and full cross-entropy trained apart by {diff}"
    assert max_diff(final_weights(tmp_path / "full"), final_weights(tmp_path / "init")) > 1e-4, "the runs must have trained"


def test_activation_checkpointing_recomputes_the_same_numbers(tmp_path: Path, prepared: Path, plain: dict[str, torch.Tensor]) -> None:
    out = _train(tmp_path, "ac", prepared, "--set", "train.activation_checkpointing=true")
    assert "activation checkpointing on" in out
    a = final_weights(tmp_path / "ac")
    assert all(torch.equal(a[k], plain[k]) for k in a), "recomputed activations must give bit-identical training"


def test_fused_optimizer_skips_a_non_finite_step_on_the_device(tmp_path: Path, prepared: Path) -> None:
    """The fused AdamW path (CUDA's default) drops a NaN step without a host round trip."""
    nan = {"AURA_FAULT_NAN": "1:3:1"}
    out = _train(tmp_path, "fused", prepared, "--set", "train.fused_optimizer=true", nproc=2, env=nan)
    assert "optimizer AdamW (fused)" in out and "non-finite loss or gradient on rank(s) [1] at step 3: update skipped" in out
    _train(tmp_path, "foreach", prepared, "--set", "train.fused_optimizer=false", nproc=2, env=nan)
    fused, foreach = final_weights(tmp_path / "fused"), final_weights(tmp_path / "foreach")
    assert all(torch.isfinite(t).all() for t in fused.values())
    # Same skipped step, same Adam step count: only the kernels' rounding differs.
    assert max_diff(fused, foreach) < 1e-5


def test_padded_vocabulary_trains_saves_and_samples(tmp_path: Path, prepared: Path) -> None:
    tokenizer_vocab = json.loads((prepared / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    padded = -(-tokenizer_vocab // 128) * 128 + 128
    out = _train(tmp_path, "padded", prepared, "--set", f"model.padded_vocab_size={padded}")
    assert f"embedding padded to {padded}" in out
    w = final_weights(tmp_path / "padded")
    assert w["transformer.wte.weight"].shape[0] == padded
    # An empty prompt starts a new document (transformers' generate raised an IndexError on no tokens).
    g = run_cli(["generate", "--run", str(tmp_path / "padded"), "--max-new-tokens", "12", "--prompt", ""], timeout=120)
    assert g.returncode == 0 and g.stdout.strip(), g.stderr
    too_few = f"model.padded_vocab_size={tokenizer_vocab - 1}"
    small = run_cli(["local", "--output-dir", str(tmp_path), "--set", f"data.path={prepared}", "--set", too_few], timeout=60)
    assert small.returncode == 2 and "is smaller than the data's tokenizer" in small.stderr and "fix:" in small.stderr
