"""The goodput ledger's arithmetic (launch/goodput.py) from the files a launch and its attempts leave,
without processes; a real hang's ledger is checked in test_faults.py (the stopped-rank restart)."""

from __future__ import annotations

import json
from pathlib import Path

from aura_hpc.launch import goodput
from aura_hpc.train.process.time_ledger import FOLDER


def _write(folder: Path, name: str, record: dict) -> None:
    (folder / name).write_text(json.dumps(record))


def test_a_hung_attempt_splits_into_kept_steps_recomputed_steps_the_hang_and_the_restart(tmp_path: Path) -> None:
    folder = tmp_path / FOLDER
    folder.mkdir()
    # The launch starts at 100; its first attempt's process at 102, first step at 110, checkpoint at step 10
    # after 20 s of steps, last ledger write at 135 (step 12, 24 s of steps), last progress at 136; the hang
    # is declared and the workers killed at 170; the next attempt starts at 172, resumes from step 10 and
    # finishes at 200; the launch ends at 201.
    _write(folder, "launch-L.json", {"started": 100.0, "hangs": [{"last_progress": 136.0, "killed_at": 170.0}]})
    first = {"started": 102.0, "first_step_at": 110.0, "resumed_from": 0, "updated": 135.0, "finished": False}
    first |= {"spent": {"start-up": 8.0, "step": 24.0, "checkpoint": 1.0}, "saves": [[10, 20.0]]}
    second = {"started": 172.0, "first_step_at": 180.0, "resumed_from": 10, "updated": 200.0, "finished": True}
    second |= {"spent": {"start-up": 8.0, "step": 19.0, "checkpoint": 1.0}, "saves": [[20, 19.0]]}
    _write(folder, "attempt-L-102.000-1.json", first)
    _write(folder, "attempt-L-172.000-2.json", second)
    _write(folder, "attempt-OTHER-50.000-3.json", first)  # another launch's attempt: not this one's
    split = goodput.ledger(tmp_path, "L", 201.0)
    assert split is not None
    sec = split["seconds"]
    assert sec["start-up"] == 16.0 and sec["checkpoints"] == 2.0
    assert sec["productive steps"] == 20.0 + 19.0  # the first attempt's steps up to step 10, all of the second's
    assert sec["recomputed"] == 24.0 - 20.0 + 1.0  # after step 10, to its last progress (136, past its last write)
    assert sec["hangs"] == 34.0 and sec["restarts"] == 2.0
    assert sec["set-up and exit"] == 2.0 + 1.0
    assert split["wall_s"] == 101.0 and abs(sum(sec.values()) - 101.0) < 1e-6
    assert abs(sec["other"] - (101.0 - 16 - 2 - 39 - 5 - 34 - 2 - 3)) < 1e-6
    line = goodput.line(split)
    assert line.startswith("time: 39% productive steps, 34% hangs") and line.endswith("of 1m41s (goodput ledger)"), line
    assert goodput.line({**split, "wall_s": 119.6}).endswith("of 2m00s (goodput ledger)")  # it read "1m60s"


def test_status_reads_a_summary_only_when_the_newest_launch_wrote_it(tmp_path: Path) -> None:
    """A finished run extended with a larger train.max_steps that crashed before its first new row read COMPLETED:
    the summary.json was the earlier launch's (each launch writes config.yaml before anything else)."""
    import os

    from aura_hpc.launch.run_status import goodput_note, local_status

    (tmp_path / "summary.json").write_text(
        json.dumps({"step": 100, "finished": True, "goodput": {"fractions": {"step": 1.0}, "wall_s": 50}})
    )
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 200\n")
    os.utime(tmp_path / "summary.json", (1_000_000, 1_000_000))  # before this launch's config.yaml
    row = local_status(tmp_path, {"step": 100})
    assert row["state"] == "STOPPED" and "resume" in row["reason"] and goodput_note(tmp_path, "STOPPED") is None, row
    os.utime(tmp_path / "summary.json")  # written by this launch
    assert local_status(tmp_path, {"step": 100})["state"] == "COMPLETED"
    assert goodput_note(tmp_path, "COMPLETED") == "time: 100% step of 0m50s (goodput ledger)"


def test_status_of_a_copied_run_directory_goes_by_the_launch_its_summary_names_not_by_file_times(tmp_path: Path) -> None:
    """`cp -r` and `scp -r` give a run directory's files new times in the order they copy them: a finished run whose
    config.yaml was copied after its summary.json read STOPPED, and the newest launch was the one copied last."""
    import os

    from aura_hpc.launch.run_status import local_status

    folder = tmp_path / goodput.FOLDER
    folder.mkdir()
    for launch, started in (("100.000-7", 100.0), ("200.000-8", 200.0)):
        (folder / f"launch-{launch}.json").write_text(json.dumps({"started": started, "hangs": [], "requeues": []}))
    os.utime(folder / "launch-100.000-7.json", (3_000_000, 3_000_000))  # copied after the newer one
    os.utime(folder / "launch-200.000-8.json", (2_000_000, 2_000_000))
    assert goodput.newest_launch(tmp_path) == "200.000-8"
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 100\n")
    summary = {"step": 100, "finished": True, "launch": "200.000-8"}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    os.utime(tmp_path / "summary.json", (1_000_000, 1_000_000))  # copied before config.yaml
    row = local_status(tmp_path, {"step": 100})
    assert row["state"] == "COMPLETED" and row["reason"] == "", row
    # The earlier launch's summary, copied last: the newest launch (extended, then crashed) wrote none.
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "launch": "100.000-7"}))
    row = local_status(tmp_path, {"step": 100})
    assert row["state"] == "STOPPED" and "resume" in row["reason"], row
