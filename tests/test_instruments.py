"""The loop's seam to fault injection and probes (train/instruments/seam.py): inert unless enabled,
and each fault where its variable says, once."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aura_hpc.train.instruments import faults
from aura_hpc.train.instruments.seam import Instruments

VARIABLES = (
    "AURA_FAULT_NAN",
    "AURA_FAULT_GRADINF",
    "AURA_FAULT_LOSSINF",
    "AURA_FAULT_KILL",
    "AURA_FAULT_SLOW",
    "AURA_FAULT_CUDA",
    "AURA_PROBE_STEPS",
    "AURA_PROBE_RUN",
    "AURA_PROBE_HEAP",
)


class _Loss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).pow(2).mean()


def _steps(tmp_path: Path, rank: int, steps: int) -> list[tuple[float, bool]]:
    """(loss, every gradient finite) of each step run through the seam as the trainer runs them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    module = _Loss(model)
    seen = []
    inst = Instruments(tmp_path, rank)
    with inst.whole_run("false", torch.device("cpu")), inst.around_steps(module, model, False, lambda: False):
        for step in range(1, steps + 1):
            model.zero_grad()
            with inst.step(step, quiet=True):
                loss = module(torch.ones(2, 4))
                loss.backward()
            assert inst.read(SimpleNamespace(step=step, read=lambda: "report")) == "report"  # as the loop reads one
            seen.append((loss.item(), all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())))
    assert not module._forward_hooks and not model[1]._forward_hooks, "the seam left a hook armed"
    return seen


def test_the_instruments_are_inert_unless_enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    seen = _steps(tmp_path, 0, 3)
    assert all(math.isfinite(loss) and finite for loss, finite in seen), seen
    assert not list(tmp_path.iterdir()), "nothing written without a variable"
    assert Instruments(tmp_path, 0).summary() == {}


def test_a_poisoned_loss_and_gradient_come_at_their_steps_on_their_rank_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AURA_FAULT_NAN", "1:2")
    monkeypatch.setenv("AURA_FAULT_GRADINF", "1:3")
    monkeypatch.setenv("AURA_FAULT_LOSSINF", "1:5")
    monkeypatch.setattr(faults, "_poisoned", set())
    monkeypatch.setattr(faults, "_grad_poisoned", set())
    monkeypatch.setattr(faults, "_loss_inf", set())
    assert all(math.isfinite(loss) and finite for loss, finite in _steps(tmp_path / "r0", 0, 5)), "rank 0 is not the one poisoned"
    seen = _steps(tmp_path / "r1", 1, 5)
    assert math.isfinite(seen[0][0]) and seen[0][1]
    assert math.isnan(seen[1][0]) and not seen[1][1], "step 2: the loss (and so every gradient) is NaN"
    assert math.isfinite(seen[2][0]) and not seen[2][1], "step 3: a finite loss, an inf gradient"
    assert math.isfinite(seen[3][0]) and seen[3][1], "step 4: clean again"
    assert seen[4][0] == math.inf and seen[4][1], "step 5: an inf loss, finite gradients"
    again = _steps(tmp_path / "r1", 1, 5)
    assert again[1][1] and math.isfinite(again[4][0]), "each fault fires once per process"
