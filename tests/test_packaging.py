"""A declared version range is a tested one: the floors in pyproject.toml are the ones CI installs."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import REPO


def _floors() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [*project["dependencies"], *project["optional-dependencies"]["s3"]]
    return {m.group(1): m.group(2) for d in deps if (m := re.match(r"^([A-Za-z0-9_.-]+)>=([0-9.]+)", d))}


def _pins() -> dict[str, str]:
    text = (REPO / ".ci" / "floor-requirements.txt").read_text()
    return {m.group(1): m.group(2) for line in text.splitlines() if (m := re.match(r"^([A-Za-z0-9_.-]+)==([0-9.]+)$", line.strip()))}


def test_the_floor_venv_installs_the_declared_floors() -> None:
    floors, pins = _floors(), _pins()
    # Every declared floor, not only torch's: a cluster image pins deepspeed or datasets as often as torch.
    assert set(pins) == set(floors), f"floors without a pin: {set(floors) - set(pins)}; pins of nothing declared: {set(pins) - set(floors)}"
    for name, pinned in pins.items():
        declared = floors[name].split(".")
        assert pinned.split(".")[: len(declared)] == declared, f"{name}: pyproject says >={floors[name]}, CI tests {pinned}"


def test_ci_runs_the_floor_venv() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert "floor-requirements.txt" in ci and "test_training.py" in ci and "test_slurm.py" in ci
