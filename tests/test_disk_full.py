"""A disk that fills up during a checkpoint, for real: the run directory on a small tmpfs.

Reproduced before the fix: under ddp torch's "unexpected pos ..." with no word about disk space and
the partial `.tmp-step_*` left behind (so the disk stayed full and the re-run crashed in its setup);
under fsdp no reason anywhere (DCP's error went to a stderr log on the full disk)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SMALL_MODEL, run_cli_together


def _mount(where: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True, capture_output=True, timeout=20)


def _resize(where: Path, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(where)], check=True, capture_output=True, timeout=20)


@pytest.fixture
def small_disks(tmp_path: Path) -> Iterator[dict[str, Path]]:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    disks = {s: tmp_path / f"disk-{s}" for s in ("ddp", "fsdp")}
    mounted = []
    try:
        for d in disks.values():
            d.mkdir()
            _mount(d, "64m")
            mounted.append(d)
    except (subprocess.CalledProcessError, OSError) as exc:
        for d in mounted:
            subprocess.run(["umount", str(d)], capture_output=True)
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    yield disks
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_full_disk_mid_checkpoint_names_the_disk_keeps_the_previous_one_and_the_rerun_goes_on(
    small_disks: dict[str, Path], prepared: Path
) -> None:
    def args(strategy: str, steps: int) -> list[str]:
        disk = small_disks[strategy]
        return [
            "local", "--output-dir", str(disk), "--run-name", "r", "--set", f"data.path={prepared}", *SMALL_MODEL,
            "--set", f"dist.strategy={strategy}", "--set", f"train.max_steps={steps}", "--set", "train.checkpoint_every=5",
        ]  # fmt: skip

    # Two checkpoints with room to spare, then the disk is shrunk to hold half of a third one.
    first = run_cli_together([args(s, 10) for s in small_disks], timeout=300)
    for r in first:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for disk in small_disks.values():
        one = _du(disk / "r" / "checkpoints" / "step_00000010")
        _resize(disk, _du(disk) + 64 * 1024 + one // 2)

    full = run_cli_together([args(s, 30) for s in small_disks], timeout=300)
    for (strategy, disk), r in zip(small_disks.items(), full, strict=True):
        line = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1, (strategy, r.stdout[-3000:], r.stderr)
        assert f"no space left on {disk} (tmpfs) while writing checkpoint step 15" in line, (strategy, line)
        assert "previous checkpoint step 10 is intact" in line and "the partial write was removed" in line and "(fix: free space" in line
        assert "Traceback" not in r.stderr, r.stderr
        ckpts = sorted(p.name for p in (disk / "r" / "checkpoints").iterdir())
        assert ckpts == ["step_00000005", "step_00000010"], (strategy, ckpts)  # nothing partial keeps the disk full

    # The re-runs: under ddp on the same full disk, it starts (no crash in its setup), resumes and says the
    # same; under fsdp the user freed space first, and it resumes and finishes.
    _resize(small_disks["fsdp"], 64 * 2**20)
    again = dict(zip(small_disks, run_cli_together([args(s, 30) for s in small_disks], timeout=300), strict=True))
    for strategy, r in again.items():
        assert "resumed from checkpoint step_00000010" in r.stdout, (strategy, r.stdout[-2000:], r.stderr)
    assert again["ddp"].returncode == 1 and "no space left on" in again["ddp"].stderr.strip().splitlines()[-1], again["ddp"].stderr
    assert again["fsdp"].returncode == 0, (again["fsdp"].stdout[-2000:], again["fsdp"].stderr[-2000:])
    assert (small_disks["fsdp"] / "r" / "checkpoints" / "step_00000030").is_dir()
