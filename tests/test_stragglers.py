"""Straggler scores (train/loop/stragglers.py) without processes; a slowed rank named in a real run is
test_faults.py::test_stop_signal_checkpoints_once_and_exits_resumable (rank 0 idles 3/4 of each step)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from aura_hpc.train.loop.stragglers import BusyClock, StragglerWatch, scores


def test_a_rank_twice_as_slow_as_the_others_scores_half() -> None:
    assert scores([1.0, 1.0, 2.0, 1.0]) == [1.0, 1.0, 0.5, 1.0]
    assert scores([0.01, 0.02]) == [2.0, 0.5]  # of two ranks, the slow one is below 0.75
    assert scores([0.0, 0.02]) == [1.0, 1.0]  # nothing timed on a rank: no verdict on anyone
    assert scores([0.5]) == [1.0]


def test_a_rank_is_named_after_three_slow_intervals_in_a_row_and_only_once(caplog: pytest.LogCaptureFixture) -> None:
    watch = StragglerWatch(["pc-a", "pc-b"])
    with caplog.at_level(logging.WARNING, logger="aura_hpc"):
        rows = [watch.interval([0.01, 0.03], step) for step in (5, 10)]
        assert not caplog.records, "two intervals are not yet a pattern"
        watch.interval([0.01, 0.01], 15)  # caught up: the count starts again
        for step in (20, 25, 30, 35):
            watch.interval([0.01, 0.03], step)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and named[0].startswith("straggler: rank 1 on pc-b has scored below 0.75 for 3 logging intervals"), named
    assert "at step 30" in named[0] and "3.0x" in named[0]
    assert rows[0] == {"straggler_scores": [3.0, 0.333], "slowest_rank": 1, "slowest_score": 0.333}


def test_the_clock_counts_the_time_between_exchanges_and_not_across_a_pause() -> None:
    """The step after a pause (a logged, evaluated or saved step) is timed from the pause's end: it was not
    timed at all, and under train.log_every=1 (every step logged) no step was, every score 1.0."""
    import time

    clock = BusyClock(torch.device("cpu"))
    clock.exchange_begins()  # no exchange yet: nothing to count
    clock.exchange_done()
    clock.exchange_begins()
    clock.exchange_done()
    time.sleep(0.3)  # an evaluation or a checkpoint: not a step's work
    clock.pause()
    clock.exchange_begins()
    assert clock.steps == 2
    assert 0 < clock.take() < 0.1 and clock.take() == 0.0


def _record_many(run_dir: str, prefix: str) -> None:
    from aura_hpc.ops import excluded_nodes

    for i in range(40):
        excluded_nodes.record(Path(run_dir), f"{prefix}{i}", "a test")


def test_nodes_left_out_by_several_writers_at_once_are_all_kept_and_an_unreadable_list_is_never_written_over(tmp_path: Path) -> None:
    """Each node's Slurm watchdog and rank 0 add to one list: each read it, added its node and renamed its copy over the
    others', which lost nodes. A list that could not be read (an NFS error) was taken for empty and written over."""
    import multiprocessing

    from aura_hpc.ops import excluded_nodes

    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_record_many, args=(str(tmp_path), p)) for p in ("a", "b", "c")]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert all(w.exitcode == 0 for w in writers)
    assert sorted(excluded_nodes.wanted(tmp_path)) == sorted(f"{p}{i}" for p in "abc" for i in range(40))
    (tmp_path / excluded_nodes.FILE).write_text('{"n1": {"why": "hung"}, "n2"')  # not what aura_hpc writes
    with pytest.raises(OSError, match="is not the list aura_hpc writes"):
        excluded_nodes.record(tmp_path, "n3", "a straggler")
    assert (tmp_path / excluded_nodes.FILE).read_text() == '{"n1": {"why": "hung"}, "n2"'
