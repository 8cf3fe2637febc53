"""Meta-device construction and shard-by-shard initialisation (train/model/meta_init.py), on one process;
ZeRO-3's partitioned build (strategies/zero.py) on two.

Under FSDP on 2 ranks the same path is proven end to end by tests/test_strategies.py (fsdp ends
20 steps bit for bit where ddp does, and ddp builds on the host)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from aura_hpc.train.model.gpt import GPT, GPTConfig
from aura_hpc.train.model.meta_init import build_on_meta

CFG = GPTConfig(vocab_size=3001, n_positions=64, n_embd=48, n_layer=4, n_head=4)


def _on_meta(seed: int, cfg: GPTConfig = CFG) -> tuple[GPT, Any]:
    torch.manual_seed(seed)
    built = build_on_meta(lambda: GPT(cfg))
    assert built is not None
    model, record = built
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    # Outside FSDP, to_empty gives the tied output matrix a tensor of its own (FSDP2 keeps the tie).
    model.lm_head.weight = model.transformer.wte.weight
    return model, record  # type: ignore[return-value]


def test_weights_and_the_random_stream_are_those_of_the_host_built_model() -> None:
    torch.manual_seed(7)
    host = GPT(CFG)
    after_host = torch.get_rng_state()
    model, record = _on_meta(7)
    record.materialize(model, torch.float32)
    assert torch.equal(torch.get_rng_state(), after_host)  # dropout masks drawn next are the same too
    want = host.state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    assert torch.equal(model(x), host(x))
    # Another seed, other weights: the record replays the seed it was made under.
    other, record = _on_meta(8)
    record.materialize(other, torch.float32)
    assert not torch.equal(other.transformer.wte.weight, host.transformer.wte.weight)


_PEAK = r"""
import re, sys, torch
from aura_hpc.train.model.gpt import GPT, GPTConfig
from aura_hpc.train.model.meta_init import build_on_meta
model, record = build_on_meta(lambda: GPT(GPTConfig(vocab_size=4000, n_positions=64, n_embd=512, n_layer=16, n_head=8)))
model.to_empty(device="cpu")
model.lm_head.weight = model.transformer.wte.weight
with torch.no_grad():
    for p in model.parameters():
        p.zero_()  # the model's own pages resident before the measurement
def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
# The high-water mark starts again from here (a busy machine may have evicted library pages since the
# imports' peak, so the process's lifetime peak says nothing about the replay).
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
record.materialize(model, torch.float32)
extra = status("VmHWM") - before
largest = max(p.numel() * p.element_size() for p in model.parameters())
total = sum(p.numel() * p.element_size() for p in model.parameters())
print(extra, largest, total)
"""


def test_the_host_holds_a_parameter_or_two_at_a_time_not_the_model() -> None:
    """Measured in a fresh process: the resident set's high-water mark while the weights are made,
    above what the (already resident) parameters take."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    extra, largest, total = (int(x) for x in out.stdout.split())
    assert total > 20 * largest  # a replay that held every value at once would show
    assert extra < 3 * largest + 16 * 2**20, (extra, largest, total)


def test_the_host_copy_for_samples_leaves_the_training_rng_alone_and_refuses_weights_that_do_not_fit() -> None:
    """Under sharded strategies rank 0 samples from a host copy it builds once per process: its initial weights
    were drawn from the training's CPU stream (a restart, building it again, moved dropout's masks), and
    weights under other names were loaded in silence (strict=False): a random model's samples."""
    from aura_hpc.train.loop.evaluation import host_model

    like = GPT(CFG)
    gathered = {k: v for k, v in like.state_dict().items() if k != "lm_head.weight"}  # the tied matrix saved once
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    host = host_model(like, gathered)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(host.state_dict()[k], v) for k, v in like.state_dict().items())
    with pytest.raises(RuntimeError, match="do not fit the model"):
        host_model(like, {f"lm.{k}": v for k, v in gathered.items()})


def test_an_untied_output_matrix_is_a_weight_of_its_own_and_exported() -> None:
    """GPTConfig.tie_word_embeddings=False was exported as untied while the model tied them: the export held
    the embedding once, and transformers drew the missing lm_head at random."""
    import dataclasses

    from aura_hpc.train.checkpoint.files import unique_weights

    untied = GPT(dataclasses.replace(CFG, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight and "lm_head.weight" in unique_weights(untied)
    tied = GPT(CFG)
    assert tied.lm_head.weight is tied.transformer.wte.weight and "lm_head.weight" not in unique_weights(tied)


def test_bf16_parameters_get_the_host_models_weights_cast_once() -> None:
    torch.manual_seed(3)
    host = GPT(CFG).to(torch.bfloat16)
    model, record = _on_meta(3)
    model.to(torch.bfloat16)
    record.materialize(model, torch.bfloat16)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in host.state_dict().items())


class _Derived(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(4, 4)
        self.weight = nn.Parameter(base @ base.T)  # one tensor computed from another: no replay for that


class _Uninitialised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 3))


def test_what_cannot_be_replayed_is_built_on_the_host_and_nothing_is_left_uninitialised() -> None:
    assert build_on_meta(_Derived) is None
    built = build_on_meta(_Uninitialised)
    assert built is not None
    model, record = built
    model.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match=r"no initialisation recorded for \['weight'\]"):
        record.materialize(model, torch.float32)


_ZERO3 = r"""
import os, re, sys, torch, torch.distributed as dist
from aura_hpc.train.process.malloc_tuning import pin_thresholds
pin_thresholds()  # as the worker does
dist.init_process_group("gloo")
from aura_hpc.train.process.deepspeed_import import quiet_deepspeed
quiet_deepspeed(needed=True)  # as the worker does: DeepSpeed does not pull in MLflow or transformers...
import importlib.util
import deepspeed
# ...and both, where installed, still import afterwards (our tracker's MLflow, generate's transformers)
def kept(m):
    return m not in sys.modules and (importlib.util.find_spec(m) is None or bool(__import__(m).__version__))
mlflow_kept = int(kept("mlflow") and kept("transformers"))
from aura_hpc.config import load_config
from aura_hpc.train.model.gpt import GPT, GPTConfig
from aura_hpc.train.process import distributed
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.strategies.zero import build_partitioned
shape = GPTConfig(vocab_size=4000, n_positions=64, n_embd=512, n_layer=16, n_head=8)
cfg = load_config(None, ["dist.strategy=zero3"])
rt = Runtime(torch.device("cpu"), "gloo", torch.float32, None)
def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
# Once small first: DeepSpeed's comm op and our recorder's imports are loaded outside the measurement.
build_partitioned(lambda: GPT(GPTConfig(vocab_size=64, n_positions=8, n_embd=8, n_layer=1, n_head=2)), cfg, rt, 2)
torch.manual_seed(5)
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
before = status("VmRSS")
model = build_partitioned(lambda: GPT(shape), cfg, rt, 2)
extra = status("VmHWM") - before
total = sum(p.ds_numel * 4 for p in model.parameters())
held = sum(p.ds_tensor.numel() * 4 for p in model.parameters())
names = [n for n, _ in model.named_parameters()]
probe = dict(model.named_parameters())["transformer.h.3.mlp.c_fc.weight"]
with deepspeed.zero.GatheredParameters([probe]):
    got = probe.detach().clone()
torch.manual_seed(5)
want = dict(GPT(shape).named_parameters())["transformer.h.3.mlp.c_fc.weight"]
# The fallback for layouts a rank cannot write alone (gathered, written from rank 0) writes the same.
from aura_hpc.train.strategies.zero import _place_gathered
_place_gathered(probe, want.detach() * 2)
with deepspeed.zero.GatheredParameters([probe]):
    fallback = torch.equal(probe, want.detach() * 2)
if dist.get_rank() == 0:
    print(mlflow_kept, extra, held, total, int(torch.equal(got, want) and fallback), int(probe.numel() == 0), flush=True)
distributed.shutdown()  # not destroy_process_group alone: torch < 2.8's gloo could deadlock there
# Out without the interpreter's native teardown: in about one run of four a C++ thread object of the
# DeepSpeed/gloo pair was destroyed still joinable there ("terminate called without an active exception"),
# after everything this script checks was printed.
import os
os._exit(0)
"""


def test_zero3_builds_partitioned_and_no_rank_holds_the_model() -> None:
    """Two gloo ranks build a 210 MB model under ZeRO-3: each rank's resident high-water mark grows by
    its half and a module at a time, not by the model, and a gathered parameter holds the bits of
    the model built whole from the same seed. (DeepSpeed imported as the worker does: without MLflow
    and transformers, which stay importable.)"""
    pytest.importorskip("deepspeed")
    from tests.conftest import free_port

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", _ZERO3], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    mlflow_kept, extra, held, total, same, empty = (int(x) for x in outs[0][0].split()[-6:])
    assert same == 1 and empty == 1 and mlflow_kept == 1
    assert total > 200 * 2**20 and abs(held - total / 2) < 2**20  # this rank's half, from construction on
    # Built whole first, a rank would peak at the model and its half (+315 MB) before DeepSpeed freed the
    # whole; gathered for writing, 1.2x the model (measured). Written piece by piece: 1.1-1.5x its half.
    assert extra < 0.9 * total, (extra, held, total)


_NEEDS_A_KEPT_OUT_MODULE = r"""
import sys
from aura_hpc.train.process import deepspeed_import
# A DeepSpeed release that imports a kept-out module unguarded, as every release imports pydantic (its config).
deepspeed_import.KEPT_OUT = (*deepspeed_import.KEPT_OUT, "pydantic")
deepspeed_import.quiet_deepspeed(needed=True)
import deepspeed
from deepspeed.runtime.zero.partition_parameters import Init
print(int("pydantic" in sys.modules), int(callable(Init)), flush=True)
"""


def test_a_deepspeed_that_needs_a_kept_out_module_as_it_imports_still_imports() -> None:
    """The modules DeepSpeed is imported without (start-up time: deepspeed_import.py) are a saving, never a failure:
    our DeepSpeed range is open, and a release that needs one of them at import is imported again with it."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-c", _NEEDS_A_KEPT_OUT_MODULE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["1", "1"], r.stdout
