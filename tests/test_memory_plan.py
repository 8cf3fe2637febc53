"""The memory plan: printed by both dry runs, refusing what cannot fit, and checked against measurements."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aura_hpc.config import load_config
from aura_hpc.launch.memory import ACT_BYTES, ACT_DROPOUT, GIB, check_fits, plan
from tests.conftest import run_cli

# Run in a fresh interpreter: in a test process, other tests' objects are freed at random moments.
_MEASURE = """
import ctypes, sys, torch
from aura_hpc.train.model.gpt import GPT, GPTConfig
NAMES = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in NAMES]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = M
def in_use():
    m = libc.mallinfo2(); return m.uordblks + m.hblkhd
precision, drop = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = GPT(GPTConfig(512, 128, 256, 4, 4, drop, 0))
x = torch.randint(0, 512, (8, 128))
ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cpu", enabled=False)
with ctx:
    h = model.hidden(x)  # first-call allocations are not activations
h.float().sum().backward(); model.zero_grad(set_to_none=True); del h
before = in_use()
with ctx:
    h = model.hidden(x)
print(in_use() - before - h.numel() * h.element_size())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
@pytest.mark.parametrize(("precision", "dropout"), [("fp32", 0.0), ("fp32", 0.1), ("bf16", 0.0)])
def test_the_activation_coefficients_are_our_blocks_measured(precision: str, dropout: float) -> None:
    """What a forward pass of our GPT-2 leaves allocated for the backward one (CPU, eager), against the
    plan's bytes per token per layer per unit of width."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, precision, str(dropout)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    measured = int(r.stdout.strip().splitlines()[-1])
    per = ACT_BYTES[(precision, False)] + (ACT_DROPOUT[(precision, False)] if dropout else 0)
    estimate = per * 256 * 8 * 128 * 4 + 8 * 128 * 256 * 8  # + embeddings and the final norm, as the plan counts them
    assert abs(measured - estimate) / measured < 0.15, f"measured {measured / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_the_plan_matches_the_measured_peak_under_ddp_and_fsdp(tmp_path: Path, prepared: Path) -> None:
    """Real 2-rank runs on CPU, rank 0's heap peak sampled by the trainer (AURA_PROBE_HEAP), against the
    plan. A checkpoint at step 2 of 3: under ddp the host copy rank 0 keeps for its checkpoints is part of
    the peak that follows (-20% without it); fsdp's shards are copied only while they are written."""
    from tests.conftest import run_cli_together

    shape = ["model.n_layer=8", "model.n_embd=384", "model.n_head=6", "data.seq_len=128", "train.batch_size=8"]
    shape += ["train.max_steps=3", "train.checkpoint_every=2"]
    runs = {}
    for strategy in ("ddp", "fsdp"):
        args = ["local", "--nproc-per-node", "2", "--output-dir", str(tmp_path), "--run-name", strategy, "--set", f"data.path={prepared}"]
        for kv in [*shape, f"dist.strategy={strategy}", "train.eval_every=0"]:
            args += ["--set", kv]
        runs[strategy] = args
    for strategy, r in zip(runs, run_cli_together(list(runs.values()), timeout=600, AURA_PROBE_HEAP="1"), strict=True):
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        measured = json.loads((tmp_path / strategy / "summary.json").read_text())["peak_heap_gib"] * GIB
        estimate = plan(load_config(None, [*shape, f"dist.strategy={strategy}"]), 983, 2, gpu=False)
        assert (estimate.checkpoint_copy > 0) == (strategy == "ddp")
        assert abs(estimate.total - measured) / measured < 0.15, (
            f"{strategy}: measured {measured / GIB:.3f} GiB, plan {estimate.total / GIB:.3f} GiB "
            f"(without the checkpoint copy {estimate.training_total / GIB:.3f})"
        )


def test_gpt2_1b_at_8x2048_on_h100s_is_planned_not_refused() -> None:
    """The issue's case: refused at 100 GiB by the old plan (fitted to an eager transformers run)."""
    cfg = load_config("gpt2-1b", ["train.batch_size=8", "data.seq_len=2048", "model.padded_vocab_size=50304"])
    total = plan(cfg, 50304, 8).total / GIB
    assert 40 < total < 79, total
    refusal, warning = check_fits(cfg, 50304, 8, 79.0)
    assert refusal is None and warning is None, (refusal, warning)


def test_refused_only_beyond_the_margin_warned_near_it_and_forced_past_it() -> None:
    cfg = load_config("gpt2-3b", ["dist.strategy=ddp", "train.batch_size=4"])
    total = plan(cfg, 50304, 8).total / GIB
    refusal, _ = check_fits(cfg, 50304, 8, total / 1.2)
    assert refusal and "even allowing for the plan's 15% error" in refusal and "--force" in refusal and "dist.strategy=" in refusal
    refusal, warning = check_fits(cfg, 50304, 8, total / 1.05)
    assert refusal is None and warning and "margin" in warning
    refusal, warning = check_fits(cfg, 50304, 8, total / 1.2, force=True)
    assert refusal is None and warning


def test_sharding_shrinks_the_static_part_as_the_strategies_promise() -> None:
    cfg = load_config("gpt2-3b")
    p = {s: plan(cfg, 50304, 8, strategy=s) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")}
    assert p["ddp"].params + p["ddp"].grads + p["ddp"].optimizer > 48 * GIB  # 16 bytes per parameter
    assert p["zero1"].optimizer < p["ddp"].optimizer / 4 and p["zero1"].grads >= p["zero2"].grads * 7
    assert p["zero3"].params < p["zero2"].params / 4 and p["fsdp"].total < p["ddp"].total
    # Under bf16 DeepSpeed's stage 2 keeps its gradient partition in bf16 whatever grad_accum_dtype says; stage 3, fp32.
    b = {s: plan(load_config("gpt2-3b", ["train.precision=bf16"]), 50304, 8, strategy=s) for s in ("zero2", "zero3")}
    assert b["zero2"].grads * 2 == pytest.approx(b["zero3"].grads)


def test_the_checkpoints_host_copy_is_counted_once_per_holder_and_only_in_host_ram() -> None:
    """Rank 0's copy under ddp (12 bytes per parameter) once per node, not per process; each rank's
    shard under sharded strategies on a GPU, outside the GPU total; nothing when the only save is the last."""
    from aura_hpc.launch.memory import parameter_count

    over = ["train.max_steps=100", "train.checkpoint_every=10"]
    n = parameter_count(load_config("gpt2-small", over), 50304)
    cpu = plan(load_config("gpt2-small", over), 50304, 2, gpu=False)
    assert cpu.checkpoint_copy == 12 * n and cpu.checkpoint_copies_on_node(2) == 12 * n
    assert cpu.total == cpu.training_total + 12 * n
    gpu = plan(load_config("gpt2-small", [*over, "dist.strategy=zero3"]), 50304, 8)
    assert gpu.total == gpu.training_total and gpu.checkpoint_copies_on_node(8) == 8 * gpu.checkpoint_copy > 0
    assert "host RAM" in dict(gpu.rows())["checkpoint host copy"]
    assert plan(load_config("gpt2-small", ["train.max_steps=100", "train.checkpoint_every=0"]), 50304, 2, gpu=False).checkpoint_copy == 0
    assert plan(load_config("gpt2-small", [*over, "dist.strategy=zero2"]), 50304, 2, gpu=False).checkpoint_copy == 0


@pytest.mark.parametrize("preset", ["hrm-small-8xh200", "hrm-1b-8xh200", "gpt2-3b"])
def test_presets_pass_submit_dry_run_with_their_memory_plan(preset: str, tmp_path: Path) -> None:
    res = run_cli(["submit", "--config", preset, "--output-dir", str(tmp_path / "runs"), "--dry-run"], timeout=60)
    # The preset's data (`prepare`'s output) is not made here: a dry run exits 2 where the run would refuse, and the
    # one refusal allowed is that data missing; the memory plan is what is checked.
    refusals = [ln for ln in res.stderr.splitlines() if "would refuse this" in ln]
    assert all(re.search(r"data\.path \S+ does not exist", ln) for ln in refusals), res.stderr
    assert res.returncode == (2 if refusals else 0), res.stderr
    assert "memory plan per device of" in res.stdout and "total per GPU" in res.stdout and "effective batch" in res.stdout
    assert not (tmp_path / "runs").exists()


def test_a_plan_that_cannot_fit_is_refused_naming_a_strategy_that_does(tmp_path: Path) -> None:
    args = ["submit", "--config", "gpt2-3b", "--set", "dist.strategy=ddp", "--set", "train.batch_size=4", "--output-dir", str(tmp_path)]
    res = run_cli([*args, "--dry-run"], timeout=60)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "needs ~95 GiB per GPU with ddp on 8 GPU(s), more than the 79 GiB" in lines[0] and "--set dist.strategy=" in lines[0]
    forced = run_cli([*args, "--dry-run", "--force"], timeout=60)
    # Forced past the plan, the dry run's one refusal left is the preset's data, not made here (exit 2, as the run's).
    refusals = [ln for ln in forced.stderr.splitlines() if "would refuse this" in ln]
    assert all(re.search(r"data\.path \S+ does not exist", ln) for ln in refusals), forced.stderr
    assert forced.returncode == (2 if refusals else 0) and "may not fit" in forced.stdout + forced.stderr, forced.stderr


def test_local_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    res = run_cli(["local", "--dry-run", "--output-dir", str(tmp_path), "--set", "dist.strategy=fsdp"], timeout=60)
    assert res.returncode == 0, res.stderr
    assert "dist.strategy=fsdp on 2 ranks" in res.stdout and "activation checkpointing" in res.stdout
    assert "nothing was written or started" in res.stdout and not any(tmp_path.iterdir())


def test_a_gpu_without_bf16_is_planned_in_the_fp32_it_trains_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.precision=auto trains in fp32 below compute capability 8.0 (T4, V100, RTX 20xx), and the plan assumed
    bf16 there: gpt2-small at batch 24 on a 15 GiB T4 was only warned about (13.3 GiB planned, 18.3 GiB in fp32)."""
    from types import SimpleNamespace

    import torch

    from aura_hpc.launch.local import _plan_memory

    cfg = load_config("gpt2-small", ["train.batch_size=24"])
    for major, refused in ((7, True), (9, False)):
        props = SimpleNamespace(total_memory=15 * GIB, major=major, minor=5)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, props=props: props)
        local = SimpleNamespace(cfg=cfg, nproc=1, nnodes=1, memory=None, warnings=[], gpu_mem_gib=None)
        if refused:
            with pytest.raises(Exception, match="even allowing for the plan's 15% error"):
                _plan_memory(local, True, False)  # type: ignore[arg-type]
        else:
            _plan_memory(local, True, False)  # type: ignore[arg-type]
    assert cfg.train.precision == "auto"  # the run's own config is left as it was
