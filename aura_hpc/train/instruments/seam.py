"""The loop's one seam to its instruments: fault injection (faults.py) and probes (probes.py).

The trainer holds one `Instruments` and calls it around the run, around the steps and around each
step; nothing else in the loop knows an instrument exists. Each is inert unless its environment
variable is set. Two kinds of fault must land inside the code they break, so they are called there
instead: a checkpoint writer's stages (checkpoint/files.py, checkpoint/background_shards.py) and
the first-choice backend failing at start-up (process/distributed.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from aura_hpc.train.instruments import faults, probes


class Instruments:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.step_probe = probes.StepProbe.from_env()
        self.run_probe: probes.RunProbe | None = None
        self.heap: probes.HeapSampler | None = None
        self._module: torch.nn.Module | None = None
        self._model: torch.nn.Module | None = None
        self._compiled = False
        self._cuda = False

    @contextlib.contextmanager
    def whole_run(self, compile_setting: str, device: torch.device) -> Iterator[None]:
        """From the runtime's start to the end: the run's probe and the heap sampler (each when enabled)."""
        with probes.whole_run(compile_setting, device, self.run_dir, self.rank) as self.run_probe:
            self.heap = probes.HeapSampler.from_env()
            self._cuda = device.type == "cuda"
            yield

    @contextlib.contextmanager
    def around_steps(
        self, module: torch.nn.Module, model: torch.nn.Module, compiled: bool, reseed_allowed: Callable[[], bool]
    ) -> Iterator[None]:
        """Around the training steps: `module` is what a step calls (its output, the loss), `model` the
        GPT-2 inside it. The step probe's report is written however training ends."""
        self._module, self._model, self._compiled = module, model, compiled
        with probes.reporting(self.step_probe, self.run_dir, self.rank, self.run_probe, reseed_allowed):
            yield

    def screen_slowness(self, restart_count: int) -> float:
        """The share of the pre-flight screen's time this rank idles (AURA_FAULT_SCREEN_SLOW; 0 otherwise)."""
        return faults.screen_slow(self.rank, restart_count)

    def entering(self, section: str, step: int) -> None:
        """As the rank enters a section (the progress page calls it): a rank stopped inside a checkpoint."""
        faults.entering(self.rank, section, step, self.run_dir)

    def read(self, outcome: Any) -> Any:
        """A step's report (loop/step.py's StepOutcome), read where the host first waits for the GPU's
        work, and where a GPU's asynchronous fault surfaces (AURA_FAULT_CUDA)."""
        faults.cuda_error(self.rank, outcome.step)
        return outcome.read()

    @contextlib.contextmanager
    def step(self, step: int, quiet: bool) -> Iterator[None]:
        """Around step `step`: its probe (a quiet step in range), the poisons armed for it, and after it
        (when it completed) a slowed or killed rank."""
        disarm = self._arm(step)
        try:
            with probes.watching(self.step_probe, step, quiet, self._compiled, self._cuda):
                yield
        finally:
            disarm()
        faults.after_step(self.rank, step, self.run_dir)

    def _arm(self, step: int) -> Callable[[], None]:
        if self._module is None or self._model is None:
            return _nothing
        undo = [faults.poison_gradient(self.rank, step, self._model)]
        if faults.poison_loss(self.rank, step):
            # Every micro-step's loss of this step becomes NaN on this rank, as a diverged forward would.
            undo.append(self._module.register_forward_hook(_nan_output).remove)
        if faults.infinite_loss(self.rank, step):
            undo.append(self._module.register_forward_hook(_inf_output).remove)

        def disarm() -> None:
            for u in undo:
                u()

        return disarm

    def first_step_done(self) -> None:
        if self.step_probe is not None:
            self.step_probe.after_first_step()

    def summary(self) -> dict[str, float]:
        """What the instruments add to summary.json (the heap's peak, when sampled)."""
        return probes.heap_summary(self.heap)


def _nan_output(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * float("nan")


def _inf_output(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    # The inf is a constant added to the loss: the gradients are the clean step's.
    return output + torch.full_like(output.detach(), float("inf"))


def _nothing() -> None:
    return None
