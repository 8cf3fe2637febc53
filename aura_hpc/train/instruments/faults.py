"""Fault injection for the fault-tolerance tests, driven by environment variables.

Inert unless one of these is set (never set them in production):
    AURA_FAULT_KILL=RANK:STEP         SIGKILL that rank right after it finishes STEP (once per run dir)
    AURA_FAULT_STOP=RANK:STEP         SIGSTOP that rank right after it finishes STEP (once per run dir): a hung
                                      process, for the hang watchdog
    AURA_FAULT_STOP=RANK:STEP:SECTION the same as that rank enters SECTION (checkpoint, meeting, evaluation)
                                      after STEP: a rank hung inside a checkpoint or a DiLoCo meeting
    AURA_FAULT_SLOW_SECTION=RANK:STEP:SECTION:S  that rank idles S seconds as it enters SECTION after STEP: rank 0's
                                      sample (evaluation) from a big model's CPU copy while the others wait
    AURA_FAULT_NAN=RANK:STEP[:COUNT]  poison the loss on that rank for COUNT steps from STEP (each step once)
    AURA_FAULT_GRADINF=RANK:STEP      an inf in one element of the gradient of the last bias in the model
                                      on that rank (the no-decay group) at STEP (once); the loss stays finite
                                      (a forward hook: a compiled model recompiles for that step)
    AURA_FAULT_LOSSINF=RANK:STEP      that rank's loss is inf at STEP (once) while its gradients stay finite, as a
                                      log-probability underflowing to zero gives
    AURA_FAULT_CUDA=RANK:STEP         a CUDA error ("an illegal memory access") as that rank reads STEP's report,
                                      where the host first waits for the step: a GPU's asynchronous fault (an Xid)
    AURA_FAULT_CKPT=MODE:STAGE        while writing a checkpoint, after STAGE (model, trainer_state, meta,
                                      config, tokenizer, files, marker): MODE=kill (SIGKILL the writer)
                                      or MODE=enospc (fail as a full disk would) or MODE=slow[:S] (hold the
                                      writer S seconds, 3 unless given: a slow disk). STAGE=shards: a rank's background shard
                                      writer, after its files; STAGE=capture: a rank's copy of its ZeRO
                                      shards to host memory, before it. Once per run dir.
    AURA_FAULT_SLOW=RANK:FRACTION     that rank (a `local` rank, or a `worker` rank) idles FRACTION of every
                                      step: a slower PC, for bench/bench_ps.py
    AURA_FAULT_SCREEN_SLOW=RANK:FRACTION  that rank's device idles FRACTION of the pre-flight screen's matmuls, in
                                      the run's first attempt only: a node found slow before training
    AURA_FAULT_BACKEND=RANK           the process group's first choice cannot start on that rank: on CPU the
                                      NCCL-or-gloo decision is made as on GPUs, with gloo standing in for NCCL
    AURA_FAULT_TORCH_VERSION=RANK:V   that rank says it runs torch V: a LAN node with another torch
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_poisoned: set[int] = set()
_grad_poisoned: set[int] = set()
_loss_inf: set[int] = set()
_step_ended: dict[int, float] = {}


def _once(run_dir: Path, name: str) -> bool:
    """True the first time a fault fires for this run directory (survives restarts)."""
    marker = run_dir / f".fault-{name}"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def slow_down(rank: int) -> None:
    spec = os.environ.get("AURA_FAULT_SLOW")
    if not spec:
        return
    r, fraction = spec.split(":")
    if int(r) != rank:
        return
    if fraction.startswith("+"):  # "+S": S seconds more for every step (a machine slower than any timeout)
        time.sleep(float(fraction[1:]))
        return
    f = min(max(float(fraction), 0.0), 0.95)
    last = _step_ended.get(rank)
    if last is not None:
        time.sleep((time.perf_counter() - last) * f / (1 - f))
    _step_ended[rank] = time.perf_counter()


def screen_slow(rank: int, restart_count: int) -> float:
    """AURA_FAULT_SCREEN_SLOW: the share of the screen's time this rank idles (first attempt only)."""
    spec = os.environ.get("AURA_FAULT_SCREEN_SLOW", "").split(":")
    if len(spec) != 2 or int(spec[0]) != rank or restart_count:
        return 0.0
    return min(max(float(spec[1]), 0.0), 0.95)


def primary_backend() -> str | None:
    """AURA_FAULT_BACKEND: gloo plays the first-choice backend (NCCL's part), so its fallback runs on CPU."""
    return "gloo" if os.environ.get("AURA_FAULT_BACKEND") else None


def backend_fails(rank: int, stage: str = "") -> str:
    """AURA_FAULT_BACKEND=R: rank R says it cannot start the backend; R:connect: it fails inside the set-up, the others in it;
    R:device: its GPU cannot run the kernels (`stage` asks for which)."""
    r, _, when = os.environ.get("AURA_FAULT_BACKEND", "").partition(":")
    return "fault injection: the backend cannot start on this rank" if r and int(r) == rank and when == stage else ""


def torch_version(rank: int) -> str:
    """AURA_FAULT_TORCH_VERSION=R:V: the torch version rank R says it runs ("" elsewhere)."""
    r, _, version = os.environ.get("AURA_FAULT_TORCH_VERSION", "").partition(":")
    return version if r and int(r) == rank else ""


def after_step(rank: int, step: int, run_dir: Path) -> None:
    slow_down(rank)
    for name, sig in (("KILL", signal.SIGKILL), ("STOP", signal.SIGSTOP)):
        spec = os.environ.get(f"AURA_FAULT_{name}")
        if not spec:
            continue
        parts = spec.split(":")
        if len(parts) != 2:
            continue  # a section's stop: entering() below
        r, s = int(parts[0]), int(parts[1])
        if r == rank and s == step and _once(run_dir, name.lower()):
            print(f"fault injection: SIG{name} rank {rank} after step {step} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), sig)


def entering(rank: int, section: str, step: int, run_dir: Path) -> None:
    """AURA_FAULT_STOP=RANK:STEP:SECTION: stopped as it enters that section after STEP. AURA_FAULT_SLOW_SECTION: slow in it."""
    slow = os.environ.get("AURA_FAULT_SLOW_SECTION", "").split(":")
    if len(slow) == 4 and int(slow[0]) == rank and int(slow[1]) == step and slow[2] == section:
        print(f"fault injection: rank {rank} idles {slow[3]} s in {section} after step {step}", flush=True)
        time.sleep(float(slow[3]))
    spec = os.environ.get("AURA_FAULT_STOP", "").split(":")
    if len(spec) == 3 and int(spec[0]) == rank and spec[2] == section and step >= int(spec[1]) and _once(run_dir, "stop"):
        print(f"fault injection: SIGSTOP rank {rank} entering {section} after step {step} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def cuda_error(rank: int, step: int) -> None:
    spec = os.environ.get("AURA_FAULT_CUDA")
    if spec and [int(x) for x in spec.split(":")] == [rank, step]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected: AURA_FAULT_CUDA)")


def poison_loss(rank: int, step: int) -> bool:
    spec = os.environ.get("AURA_FAULT_NAN")
    if not spec:
        return False
    parts = [int(x) for x in spec.split(":")]
    r, s, count = parts[0], parts[1], parts[2] if len(parts) > 2 else 1
    if r == rank and s <= step < s + count and step not in _poisoned:
        _poisoned.add(step)
        return True
    return False


def infinite_loss(rank: int, step: int) -> bool:
    spec = os.environ.get("AURA_FAULT_LOSSINF")
    if not spec:
        return False
    r, s = (int(x) for x in spec.split(":"))
    if r == rank and s == step and step not in _loss_inf:
        _loss_inf.add(step)
        return True
    return False


def poison_gradient(rank: int, step: int, model: torch.nn.Module) -> Callable[[], None]:
    """Arms AURA_FAULT_GRADINF for this step's forward passes; returns what disarms it. The inf enters
    through the forward of the last module with a bias of its own, where every strategy has the real
    parameter in hand (a hook on the parameter itself would miss FSDP's flat or sharded copies)."""
    spec = os.environ.get("AURA_FAULT_GRADINF")
    if not spec:
        return _nothing
    r, s = (int(x) for x in spec.split(":"))
    if r != rank or s != step or step in _grad_poisoned:
        return _nothing
    _grad_poisoned.add(step)
    import torch

    class InfGradient(torch.autograd.Function):
        """Zero forward; backward: an inf in the first element of the bias's gradient."""

        @staticmethod
        def forward(ctx: Any, bias: torch.Tensor) -> torch.Tensor:
            ctx.shape = bias.shape
            return bias.new_zeros(())

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
            out.view(-1)[:1].fill_(float("inf"))
            return out

    owner = [m for m in model.modules() if isinstance(getattr(m, "bias", None), torch.nn.Parameter)][-1]

    def add_zero(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + InfGradient.apply(module.bias)

    return owner.register_forward_hook(add_zero).remove


def _nothing() -> None:
    return None


def checkpoint_stage(stage: str, run_dir: Path) -> None:
    spec = os.environ.get("AURA_FAULT_CKPT")
    if not spec:
        return
    mode, where, *held = spec.split(":")
    if where != stage or not _once(run_dir, f"ckpt-{mode}"):
        return
    if mode == "kill":
        print(f"fault injection: SIGKILL checkpoint writer after {stage} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if mode == "slow":
        seconds = float(held[0]) if held else 3.0
        print(f"fault injection: checkpoint writer held {seconds:g} s after {stage} at {time.time():.3f}", flush=True)
        time.sleep(seconds)


def slow_evaluation(cancel: Any = None) -> bool:
    """AURA_FAULT_SLOW_EVAL=S: the parameter server's evaluation takes S seconds more (a big model on its CPU), or until
    `cancel` (a threading.Event) is set, as a real one stops at its next batch: True then."""
    spec = os.environ.get("AURA_FAULT_SLOW_EVAL")
    if not spec:
        return False
    if cancel is not None:
        return bool(cancel.wait(float(spec)))
    time.sleep(float(spec))
    return False
