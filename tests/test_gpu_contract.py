"""The GPU contract, proven on CPU (issue 20): our GPT-2 equals transformers', a step that does not log,
evaluate, sample or checkpoint reads nothing back to the host and makes no tensor that would land on
the wrong device, and a compiled model compiles once.

The probes (aura_hpc/train/instruments/probes.py) watch the real trainer in real `local` runs. What a CPU test
cannot see: a CUDA kernel's own placement or stream behaviour, and syncs inside compiled graphs
(there, fullgraph=True makes any host read a graph break, and a graph break an error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aura_hpc.ops import selftest
from tests.conftest import run_cli_together

# name -> (the selftest's check whose settings it runs, processes). ddp, fsdp, zero2, zero3 and DiLoCo run
# under the same probes in the users' shape, 2 nodes x 2 processes in bf16 (tests/test_users_shapes.py);
# here the rest: one process, ZeRO-1, and PowerSGD (compressing from step 10, inside the watched steps).
STRATEGIES = {
    "single": ("ddp", 1),
    "zero1": ("zero1", 2),
    "powersgd": ("ddp+powersgd", 2),
}

# DeepSpeed's own host reads in its step, which no config turns off (named, with the reason): its
# ZeRO optimizers decide on the host whether a step overflowed (`is_invalid_grad_norm` reads the
# norm with bool(); with gradient_clipping > 0 once more for the clipping factor; bf16 with
# check_grad_overflow=false skips only the first), and they make a -1 sentinel with
# torch.tensor(-1.0, device=...) (mask_nan_or_inf_with_val_inplace, stage3's norm).
# Under bf16, ZeRO 1 runs DeepSpeed's BF16_Optimizer, which asserts on the host that the norm is > 0.
DEEPSPEED_SITES = (
    "deepspeed/runtime/utils.py",
    "deepspeed/runtime/zero/stage3.py",
    "deepspeed/runtime/zero/stage_1_and_2.py",
    "deepspeed/runtime/bf16_optimizer.py",
)


def _args(tmp: Path, name: str, prepared: Path, check: str, nproc: int, *extra: str) -> list[str]:
    """A `local` run of the selftest's check `check` (its settings) on the tests' tiny model."""
    return [
        "local", "--nproc-per-node", str(nproc), "--output-dir", str(tmp), "--run-name", name, "--set", f"data.path={prepared}",
        "--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=2", "--set", "data.seq_len=64",
        *(x for kv in selftest.settings(check, nproc) for x in ("--set", kv)), "--set", "train.max_steps=20", "--set", "train.log_every=10",
        "--set", "train.eval_every=10", "--set", "train.checkpoint_every=10", "--set", "train.sample_every=10", *extra,
    ]  # fmt: skip


def _probe(run: Path, rank: int) -> dict:
    return json.loads((run / "probes" / f"rank{rank}.json").read_text())


def test_our_gpt2_equals_transformers_and_checkpoints_convert_both_ways(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from aura_hpc.train.checkpoint import files as checkpoint
    from aura_hpc.train.model.gpt import GPT, GPTConfig, hf_config, import_weights
    from aura_hpc.train.model.language_model import load_pretrained

    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=500, n_positions=64, n_embd=48, n_layer=3, n_head=4, eos_id=3)).eval()
    x = torch.randint(0, 500, (2, 40))
    # Our weights, saved as a checkpoint's model/ folder, loaded by transformers itself.
    path = checkpoint.save(tmp_path, 1, ours, {}, {"step": 1}, None, "", keep_last=1)
    theirs = load_pretrained(str(path / "model")).eval()
    assert isinstance(theirs, GPT2LMHeadModel)
    assert (ours(x) - theirs(input_ids=x).logits).abs().max() < 1e-5
    assert theirs.config.eos_token_id == 3 and theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()
    # transformers' weights imported into ours.
    hf = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in hf_config(ours.config).items() if k != "architectures"})).eval()
    fresh = GPT(ours.config).eval()
    import_weights(fresh, hf.state_dict())
    assert (fresh(x) - hf(input_ids=x).logits).abs().max() < 1e-5
    # The same gradients, not only the same forward pass.
    ours.train()
    theirs.train()
    ours(x).square().mean().backward()
    theirs(input_ids=x).logits.square().mean().backward()
    grads = dict(theirs.named_parameters())
    assert max((p.grad - grads[n].grad).abs().max().item() for n, p in ours.named_parameters()) < 1e-5


def test_a_sample_runs_every_forward_at_one_width_and_reads_what_the_unpadded_sequence_gives() -> None:
    """A sample grew its sequence one token a step: a new shape per token (on Hopper GPUs, by torch's source, one cuDNN
    attention plan each; ~4 s for a tiny model's 40 tokens on an H200). On a GPU every forward now has one width, the context padded
    on the right; the tokens are those of the unpadded sequence, and past n_positions the window slides at that width.
    On a CPU (the host copy sharded strategies sample from) the sequence grows as before: padding there is work for nothing."""
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2)).eval()
    widths: list[int] = []
    model.transformer.h[0].register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape[1]))
    prompt = torch.tensor([[5, 6, 7]])
    grown = model.sample(prompt, 6, top_k=1)  # on a CPU, by default, one position wider a token (no padding for nothing)
    assert widths == [3, 4, 5, 6, 7, 8], widths
    widths.clear()
    out = model.sample(prompt, 6, top_k=1, one_width=True)  # a GPU's default; top-1: each token the unpadded argmax
    assert widths == [9] * 6 and torch.equal(out, grown), widths
    for t in range(3, 9):
        assert int(out[0, t]) == int(model(out[:, :t])[0, -1].argmax()), t
    widths.clear()
    long = model.sample(prompt, 20, top_k=1, generator=torch.Generator().manual_seed(1), one_width=True)
    assert long.shape == (1, 23) and widths == [16] * 20, widths
    assert int(long[0, 22]) == int(model(long[:, 6:22])[0, -1].argmax())  # the last 16 tokens, as before
    with pytest.raises(ValueError, match="a prompt of one token at least"):
        model.sample(prompt[:, :0], 1)


def test_the_probes_see_what_they_are_for() -> None:
    """Each kind of host read and of misplaced tensor is counted, with the line that made it."""
    from aura_hpc.train.instruments.probes import StepProbe

    probe = StepProbe("all")
    t = torch.ones(3)
    with probe.watch(1, compiled=False):
        t.sum().item()
        bool(t.sum() > 0)
        t.tolist()
        torch.nonzero(t)
        norm = torch.tensor(float("inf"))  # what ZeroWrapped.grad_norm did after a skipped step
        torch.zeros(2)  # a factory without a device
        torch.zeros(2, device=t.device)  # with one: fine
    report = probe.report()
    kinds = {k.split(" at ")[0] for k in report["syncs"]}
    assert {"item", "__bool__", "tolist", "nonzero.default"} <= kinds, report
    placement = " | ".join(report["placement"])
    assert "tensor from host data" in placement and "zeros without a device" in placement, report
    assert all("test_gpu_contract.py" in k for k in [*report["syncs"], *report["placement"]]), report
    assert norm.isinf()


def test_every_optimizer_skips_a_bad_step_on_the_device_when_fused() -> None:
    """train.optimizer=sgd was built unfused whatever train.fused_optimizer said: each step's skip flag was read on
    the host (strategies/base.py: bool(bad)), the host waiting for the GPU before every update."""
    from aura_hpc.config.tree import TrainConfig
    from aura_hpc.train.instruments.probes import StepProbe
    from aura_hpc.train.parts.schedule import make_optimizer
    from aura_hpc.train.strategies.base import step_unless

    for name in ("adamw", "sgd"):
        model = torch.nn.Linear(4, 4)
        opt = make_optimizer(model, TrainConfig(optimizer=name), fused=True)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in model.parameters()]
        probe = StepProbe("all")
        with probe.watch(1, compiled=False):
            step_unless(opt, torch.ones((), dtype=torch.bool), opt.step)
        assert not probe.report()["syncs"], (name, probe.report())
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), name  # skipped
        step_unless(opt, torch.zeros((), dtype=torch.bool), opt.step)
        assert not torch.equal(before[0], model.weight), name


def test_no_host_read_and_no_misplaced_tensor_in_a_quiet_step_under_every_strategy(tmp_path: Path, prepared: Path) -> None:
    """Steps 3-18 except the ones that log/evaluate/sample/checkpoint (10), with a NaN injected at step 7
    on the last rank (the skipped step is where ZeRO's norm used to become a host tensor). Fused AdamW,
    as CUDA runs use it. ZeRO 1 in bf16, as on a GPU: DeepSpeed then runs its BF16_Optimizer, whose
    assertion on the norm ended the run at the NaN (found by selftest on an H100)."""
    runs = {
        name: _args(tmp_path, name, prepared, check, nproc, "--set", "train.fused_optimizer=true")
        for name, (check, nproc) in STRATEGIES.items()
    }
    runs["zero1"] += ["--set", "train.precision=bf16"]
    env = {"AURA_PROBE_STEPS": "3-18", "AURA_PROBE_RUN": "1", "AURA_FAULT_NAN": "1:7:1"}
    single = run_cli_together([runs.pop("single")], timeout=600, **{**env, "AURA_FAULT_NAN": "0:7:1"})
    done = dict(zip(["single", *runs], [*single, *run_cli_together(list(runs.values()), timeout=900, **env)], strict=True))
    for name, r in done.items():
        assert r.returncode == 0, (name, r.stdout[-3000:], r.stderr[-3000:])
        assert "at step 7: update skipped" in r.stdout, (name, r.stdout[-2000:])
        for rank in range(STRATEGIES[name][1]):
            report = _probe(tmp_path / name, rank)
            assert report["syncs_counted"] and len(report["steps"]) == 15, (name, report["steps"])  # 3..18 but 10
            sites = [*report["syncs"], *report["placement"]]
            ours = [s for s in sites if not any(d in s for d in DEEPSPEED_SITES)]
            assert not ours, (name, rank, ours)  # nothing of ours reads the device or misplaces a tensor
            if not name.startswith("zero"):
                assert not sites, (name, rank, sites)
            whole = json.loads((tmp_path / name / "probes" / f"run_rank{rank}.json").read_text())
            assert not whole["host_tensors"] and not whole["reseeds"], (name, rank, whole)  # PowerSGD's reseed is kept off the GPU's stream


def test_a_compiled_model_and_its_loss_compile_once_with_eval_and_samples_between_steps(tmp_path: Path, prepared: Path) -> None:
    """The blocks share one graph; after step 1 a recompilation is an error (torch._dynamo's
    error_on_recompile), also across the evaluation and the samples at step 10 (they run eagerly).
    12 blocks: more than dynamo's default recompile limit of 8, so a graph per block would show.
    The compiled model trains like the eager one, and its checkpoint is a plain transformers folder."""
    from aura_hpc.train.checkpoint import files as checkpoint
    from aura_hpc.train.model.language_model import load_pretrained
    from tests.conftest import final_weights, max_diff

    shape = ("--set", "model.n_layer=12", "--set", "model.n_embd=32", "--set", "train.loss=chunked")
    extra = (*shape, "--set", "train.compile=true")
    runs = {"single": _args(tmp_path, "single", prepared, "ddp", 1, *extra)}
    runs["fsdp"] = _args(tmp_path, "fsdp", prepared, "fsdp", 2, *extra)  # FSDP2 shards each compiled block
    runs["eager"] = _args(tmp_path, "eager", prepared, "ddp", 1, *shape)
    for name, r in zip(runs, run_cli_together(list(runs.values()), timeout=900, AURA_PROBE_STEPS="2-20"), strict=True):
        assert r.returncode == 0, (name, r.stdout[-3000:], r.stderr[-3000:])
        if name == "eager":
            continue
        assert "torch.compile on (per block)" in r.stdout and "including compilation" in r.stdout
        report = _probe(tmp_path / name, 0)
        # One graph for every block, one for the chunked loss's arithmetic.
        assert report["compiled_graphs"] == 2 and not report["graph_breaks"] and not report["recompile_limit_hits"], report
    diff = max_diff(final_weights(tmp_path / "single"), final_weights(tmp_path / "eager"))
    assert diff < 1e-4, f"compiled and eager training differ by {diff}"
    newest = checkpoint.list_complete(tmp_path / "single" / "checkpoints")[0]
    assert load_pretrained(str(newest.path / "model")).config.n_layer == 12


def test_a_selftest_run_past_its_time_is_stopped_as_ctrl_c_does_and_killed_only_past_a_grace() -> None:
    """Killed at once with SIGKILL, a timed-out `local` left its workers running (in sessions of their own, a hung
    one never noticing); as Ctrl+C, the launcher stops them and says what hung. Here a stand-in launcher."""
    import os
    import sys
    import time

    answers = "import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *_: sys.exit(print('stopped its workers') or 130))\n"
    answers += "print('ready', flush=True)\ntime.sleep(600)\n"
    started = time.monotonic()
    r = selftest.run_or_interrupt([sys.executable, "-c", answers], dict(os.environ), timeout=3, grace=60)
    assert r.returncode == 124 and "stopped its workers" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.endswith("error: the run did not end within 3 s (a hang?)\n") and time.monotonic() - started < 30, r.stderr
    deaf = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)\n"
    started = time.monotonic()
    r = selftest.run_or_interrupt([sys.executable, "-c", deaf], dict(os.environ), timeout=2, grace=2)
    assert r.returncode == 124 and time.monotonic() - started < 30, r


def test_selftest_runs_its_sequence_and_writes_its_report(tmp_path: Path) -> None:
    """On a GPU node it is the check of a new image; here its CPU variant keeps the command working."""
    from tests.conftest import run_cli

    refused = run_cli(["selftest", "--out", str(tmp_path / "none")], timeout=60)
    assert refused.returncode == 2 and "selftest needs a CUDA GPU" in refused.stderr and "--cpu" in refused.stderr
    # Its sequence (NaN, probes, stop and resume) on one strategy; the throughput half is bench_gpu's
    # smoke test (tests/test_benchmarks.py) and the strategies' contract is the tests above.
    r = run_cli(["selftest", "--cpu", "--no-bench", "--strategies", "ddp", "--out", str(tmp_path / "st")], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "st" / "selftest.json").read_text())
    assert [c["ok"] for c in report["checks"]] == [True] and "resumed" in report["checks"][0]["detail"]


def test_a_failed_throughput_run_keeps_the_contract_results_in_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The throughput run comes last, after up to an hour per strategy: its LaunchError lost selftest.json and the
    table. The runs themselves are the test above's; here they are stand-ins, as is the corpus."""
    from aura_hpc.errors import LaunchError
    from aura_hpc.ops import selftest

    def failed(*args: object) -> dict:
        raise LaunchError("the trainer's throughput run failed: out of memory (fix: see RUN_DIR/logs)")

    monkeypatch.setattr(selftest, "contract", lambda strategy, *args: selftest.Check(strategy, True, "resumed at 5"))
    monkeypatch.setattr(selftest, "throughput", failed)
    monkeypatch.setattr("aura_hpc.data.prepare.prepare", lambda spec: None)
    said: list[str] = []
    report = selftest.run(tmp_path, True, 0, ["ddp"], True, said.append)
    written = json.loads((tmp_path / "selftest.json").read_text())
    assert [(c["name"], c["ok"]) for c in written["checks"]] == [("ddp", True), ("throughput", False)] and not report.ok
    assert any(line.startswith("FAIL throughput: the trainer's throughput run failed") for line in said), said
    # Whatever else the benchmark raises (the reference loop past its hour: subprocess.TimeoutExpired) keeps them too.
    import subprocess

    def timed_out(*args: object) -> dict:
        raise subprocess.TimeoutExpired(["reference_loop"], 3600)

    monkeypatch.setattr(selftest, "throughput", timed_out)
    said.clear()
    selftest.run(tmp_path / "again", True, 0, ["ddp"], True, said.append)
    written = json.loads((tmp_path / "again" / "selftest.json").read_text())
    assert [(c["name"], c["ok"]) for c in written["checks"]] == [("ddp", True), ("throughput", False)]
    assert "FAIL throughput: TimeoutExpired: Command '['reference_loop']' timed out after 3600 seconds" in said, said


def test_auto_precision_is_agreed_by_the_ranks_and_a_gpu_fault_names_the_nodes_gpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each rank's GPU decided train.precision=auto: an RTX 2080 beside a 3090 (or a rank fallen back to
    the CPU) gathered fp32 where the others gathered bf16, and FSDP/ZeRO hung. Under one GPU per task
    every rank's device is cuda:0: the fault names the GPU as nvidia-smi counts it."""
    from aura_hpc.train.loop.health import physical_index
    from aura_hpc.train.process.runtime import agreed_precision

    bf16 = (torch.float32, torch.bfloat16)
    assert agreed_precision(bf16, [True, True, True], True) == bf16
    assert agreed_precision((torch.float32, None), [False, False], True) == (torch.float32, None)
    with caplog.at_level("WARNING", logger="aura_hpc"):
        assert agreed_precision(bf16, [True, False, True, False], True) == (torch.float32, None)
    assert "rank(s) 1, 3 have no native bf16" in caplog.text and "fix: --set train.precision=bf16" in caplog.text

    class Device:
        index = 0

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert physical_index(Device()) == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f1c2d3e")  # UUIDs: no number to give but torch's
    assert physical_index(Device()) == 0
