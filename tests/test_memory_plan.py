"""The memory plan: printed by both dry runs, refusing what cannot fit, and checked against measurements."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aura_hpc.config import load_config
from aura_hpc.launch.memory import ACT_BYTES_PER_TOKEN_LAYER_FP32, ACT_DROPOUT_PER_TOKEN_LAYER, GIB, plan
from tests.conftest import run_cli

# Run in a fresh interpreter: in a test process, other tests' objects are freed at random moments.
_MEASURE = """
import ctypes, torch
from transformers import GPT2Config, GPT2LMHeadModel
NAMES = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in NAMES]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = M
def in_use():
    m = libc.mallinfo2(); return m.uordblks + m.hblkhd
import sys
drop = float(sys.argv[1])
cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
                 resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop)
cfg._attn_implementation = "sdpa"
model = GPT2LMHeadModel(cfg)
x = torch.randint(0, 512, (8, 128))
del model.transformer(input_ids=x).last_hidden_state  # first-call allocations are not activations
before = in_use()
logits = model(input_ids=x).logits
print(in_use() - before - logits.numel() * 4)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_estimate_matches_the_allocators_statistics(dropout: float) -> None:
    """What a forward pass leaves allocated for the backward one (fp32, CPU), against the plan's per-token-layer bytes."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(dropout)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    measured = int(r.stdout.strip().splitlines()[-1])
    per = ACT_BYTES_PER_TOKEN_LAYER_FP32 + (ACT_DROPOUT_PER_TOKEN_LAYER if dropout else 0)
    estimate = per * 256 * 8 * 128 * 4
    assert abs(measured - estimate) / measured < 0.15, f"measured {measured / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB"


def test_the_gpu_anchor_is_within_15_percent() -> None:
    """gpt2-1b at 4x2048 under DDP measured 56.7 GiB peak on one H100 (eager, full logits, vocab 22,074)."""
    cfg = load_config("gpt2-1b", ["train.batch_size=4", "data.seq_len=2048", "train.loss=full", "model.padded_vocab_size=0"])
    total = plan(cfg, 22074, 1).total / GIB
    assert abs(total - 56.7) / 56.7 < 0.15, total


def test_sharding_shrinks_the_static_part_as_the_strategies_promise() -> None:
    cfg = load_config("gpt2-3b")
    p = {s: plan(cfg, 50304, 8, strategy=s) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    assert p["ddp"].params + p["ddp"].grads + p["ddp"].optimizer > 48 * GIB  # 16 bytes per parameter
    assert p["zero1"].optimizer < p["ddp"].optimizer / 4 and p["zero1"].grads >= p["zero2"].grads * 7
    assert p["zero3"].params < p["zero2"].params / 4 and p["fsdp"].total < p["ddp"].total


@pytest.mark.parametrize("preset", ["hrm-small-8xh200", "hrm-1b-8xh200", "gpt2-3b"])
def test_presets_pass_submit_dry_run_with_their_memory_plan(preset: str, tmp_path: Path) -> None:
    res = run_cli(["submit", "--config", preset, "--output-dir", str(tmp_path / "runs"), "--dry-run"], timeout=60)
    assert res.returncode == 0, res.stderr
    assert "memory plan per device of" in res.stdout and "total per GPU" in res.stdout and "effective batch" in res.stdout
    assert not (tmp_path / "runs").exists()


def test_a_plan_that_cannot_fit_is_refused_naming_a_strategy_that_does(tmp_path: Path) -> None:
    res = run_cli(["submit", "--config", "gpt2-3b", "--set", "dist.strategy=ddp", "--output-dir", str(tmp_path), "--dry-run"], timeout=60)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "needs ~91 GiB per GPU with ddp on 8 GPU(s), more than the 79 GiB" in lines[0] and "--set dist.strategy=" in lines[0]


def test_local_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    res = run_cli(["local", "--dry-run", "--output-dir", str(tmp_path), "--set", "dist.strategy=fsdp"], timeout=60)
    assert res.returncode == 0, res.stderr
    assert "dist.strategy=fsdp on 2 ranks" in res.stdout and "activation checkpointing" in res.stdout
    assert "nothing was written or started" in res.stdout and not any(tmp_path.iterdir())
