"""The global sample order over many shards, and a data position that survives any change of
world size: resumed 2 -> 3 -> 1 ranks, every sample of the global order is trained on exactly once
(the sample ids each rank read are recorded and compared)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aura_hpc.data.corpus import generate
from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.packed import PackedTokens
from aura_hpc.data.prepare import PrepareSpec, prepare
from tests.conftest import SMALL_MODEL, run_cli


def test_one_window_is_the_permutation_of_every_sequence() -> None:
    """With one window (the default) the order is the permutation runs always used: checkpoints
    taken before shards existed resume on the same samples."""
    order = GlobalOrder([40, 25, 35], seed=7)
    assert order.indices(0, 100) == np.random.default_rng([7, 0]).permutation(100).tolist()
    assert order.indices(100, 100) == np.random.default_rng([7, 1]).permutation(100).tolist()


def test_windows_shuffle_within_their_shards_and_cover_each_epoch_once() -> None:
    counts = [30, 0, 45, 12, 50, 33, 20]
    starts = np.concatenate([[0], np.cumsum(counts)])
    order = GlobalOrder(counts, seed=3, window=2)
    n = sum(counts)
    for epoch in (0, 1):
        ids = order.indices(epoch * n, n)
        assert sorted(ids) == list(range(n)), "each epoch is a permutation of all sequences"
        p = epoch * n
        for w in range(4):  # 7 shards in windows of 2: 4 windows
            shards = order.window_shards(epoch, w)
            allowed = {i for s in shards for i in range(starts[s], starts[s + 1])}
            size = len(allowed)
            assert set(order.indices(p, size)) == allowed, f"window {w} reads only its own shards"
            assert order.windows_for(p, size) == ([(epoch, w)] if size else [])
            p += size
    # Another epoch is another shard order; another seed another order.
    assert order.window_shards(0, 0) != order.window_shards(1, 0) or order.indices(0, 20) != order.indices(n, 20)
    assert GlobalOrder(counts, seed=4, window=2).indices(0, 50) != order.indices(0, 50)


def test_a_window_of_unknown_sizes_is_named_before_any_of_its_positions_is_read() -> None:
    """A stream's order knows its shards' sizes only once they are encoded (-1 until then)."""
    from aura_hpc.data.order import NeedWindow

    order = GlobalOrder([-1, -1, 30, 20], seed=3, window=2)
    assert order.window_shards(0, 0) == [3, 2] and order.window_shards(0, 1) == [1, 0]  # seed 3's shard order
    assert order.unknown_window(0, 50) is None and order.windows_for(0, 50) == [(0, 0)]
    assert order.unknown_window(10, 41) == (0, 1)
    with pytest.raises(NeedWindow):
        order.indices(50, 1)
    order.learn([7, 9, 30, 20])
    assert order.unknown_window(10, 41) is None and order.windows_for(10, 41) == [(0, 0), (0, 1)]
    assert sorted(order.indices(0, 66)) == list(range(66))


def _sharded(root: Path) -> Path:
    text = root / "corpus.txt"
    text.write_text(generate(1200, seed=5), encoding="utf-8")
    out = root / "sharded"
    m = prepare(PrepareSpec(out_dir=out, inputs=[str(text)], vocab_size=400, shard_mb=0.03))
    assert len([s for s in m["shards"] if s["split"] == "train"]) >= 4
    return out


@pytest.mark.slow
def test_resume_at_2_then_3_then_1_ranks_trains_every_sample_exactly_once(tmp_path: Path) -> None:
    data = _sharded(tmp_path)
    samples = tmp_path / "samples"
    common = ["--output-dir", str(tmp_path), "--run-name", "resharded", "--set", f"data.path={data}", *SMALL_MODEL]
    # A token budget, not a number of steps: 9,216 tokens = 18 steps of 2 x 4 x 64 at the first world size,
    # a horizon the resumes at 3 and 1 processes keep (12 or 36 steps at their own world size).
    common += ["--set", "data.shuffle_window=2", "--set", "train.batch_size=4", "--set", "train.max_tokens=9216"]
    common += ["--set", "train.checkpoint_every=0", "--set", "train.warmup_steps=2"]
    plan = [(2, 6), (3, 12), (1, 18)]
    for nproc, stop in plan:
        # The last part at half the learning rate: the checkpoint's optimizer and scheduler held the old one, and
        # the re-run trained on at it (what a divergence's "fix: lower train.lr" asks for was ignored).
        lr = ["--set", "train.lr=0.0005"] if nproc == 1 else []
        r = run_cli(
            ["local", "--nproc-per-node", str(nproc), *common, *lr, "--set", f"train.stop_at={stop}"],
            timeout=300,
            AURA_PROBE_SAMPLES=str(samples),
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        # The first run sets the horizon; each resume keeps it.
        assert ("keeping this run's schedule horizon of 18 steps" in r.stdout) == (nproc != 2), r.stdout[-2000:]
        assert stop == 18 or f"stopped at step {stop} of 18" in r.stdout, r.stdout[-2000:]
        if nproc == 2:  # another order (what the cache-size refusal suggests on a smaller node) is refused at resume
            for changed in ("data.shuffle_window=3", "train.seed=7"):
                other = run_cli(["local", "--nproc-per-node", "3", *common, "--set", changed], timeout=120)
                setting, was = changed.split("=")[0], "2" if changed.startswith("data") else "1234"
                assert other.returncode == 2 and f"sample order of {setting}={was};" in other.stderr, other.stderr
                assert f"(fix: resume with --set {setting}={was}, or use a new --run-name)" in other.stderr, other.stderr
    assert json.loads((tmp_path / "resharded" / "summary.json").read_text())["step"] == 18
    from aura_hpc.train.parts.schedule import lr_factor

    rows = [json.loads(line) for line in (tmp_path / "resharded" / "metrics.jsonl").read_text().splitlines()]
    lrs = {row["step"]: row["lr"] for row in rows if "lr" in row}
    assert lrs[15] == pytest.approx(0.0005 * lr_factor(14, 2, 18, "cosine", 0.1), rel=1e-6), lrs
    assert lrs[10] == pytest.approx(0.001 * lr_factor(9, 2, 18, "cosine", 0.1), rel=1e-6), lrs
    rows = [json.loads(line) for f in sorted(samples.glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert {f.name for f in samples.glob("*.jsonl")} == {
        "samples_rank0_world2.jsonl", "samples_rank1_world2.jsonl",
        "samples_rank0_world3.jsonl", "samples_rank1_world3.jsonl", "samples_rank2_world3.jsonl",
        "samples_rank0_world1.jsonl",
    }  # fmt: skip
    positions = sorted(p for row in rows for p in range(row["start"], row["start"] + len(row["ids"])))
    total = 6 * 2 * 4 + 6 * 3 * 4 + 6 * 1 * 4
    # Each batch loaded ahead is one its rank then trained on: none past a stop or the end (there, a stream
    # encoded a window and a bucket's shards were fetched that no step read).
    for f in samples.glob("*.jsonl"):
        trained = {json.loads(line)["start"] for line in f.read_text().splitlines()}
        ahead = [s for line in (samples / "prefetched" / f.name).read_text().splitlines() for s in json.loads(line)["starts"]]
        assert ahead and set(ahead) <= trained, (f.name, sorted(set(ahead) - trained))
    assert positions == list(range(total)), "every position of the global order once: none twice, none skipped"
    # The ids are the global order's, computed here independently of the trainer.
    packed = PackedTokens(data, 64)
    order = GlobalOrder(packed.counts("train"), seed=1234, window=2)
    by_start = {row["start"]: row["ids"] for row in rows}
    for start, ids in by_start.items():
        assert ids == order.indices(start, len(ids))
    seen = [i for row in rows for i in row["ids"]]
    assert total <= packed.num_sequences("train") and len(seen) == len(set(seen)), "no sequence twice within an epoch"


def test_a_raised_token_budget_extends_the_run_and_another_world_size_keeps_the_horizon(tmp_path: Path) -> None:
    """The horizon recorded in the newest checkpoint won whatever changed: doubling train.max_tokens to train
    on said "nothing to do" (and blamed another world size). It is kept only for the budget it was set for."""
    import types

    from aura_hpc.config import RunConfig, fit_to_horizon
    from aura_hpc.train.parts.build import _horizon
    from aura_hpc.train.parts.schedule import lr_factor

    cfg = RunConfig()
    cfg.output_dir, cfg.run_name = str(tmp_path), "run"
    cfg.train.batch_size, cfg.train.grad_accum, cfg.data.seq_len = 8, 1, 128
    cfg.train.max_tokens = 10 * 2 * 8 * 128  # 10 steps at 2 ranks
    env = types.SimpleNamespace(is_main=True)
    assert _horizon(cfg, 2, env) == 10  # type: ignore[arg-type]
    meta = cfg.run_dir / "checkpoints" / "step_00000010" / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"max_steps": 10, "max_tokens": cfg.train.max_tokens}))
    assert _horizon(cfg, 4, env) == 10  # type: ignore[arg-type]  # another world size: the schedule kept
    # A warmup of 8 fits the run's 10 steps, not the 3 that the budget makes at 8 ranks: the resume there keeps
    # the warmup with the horizon (the launcher clamped the setting to 3 at the new world size: another schedule).
    cfg.train.warmup_steps = 8
    # The launcher judges against the same horizon: no warning that the warmup is clamped to 3 (it is not), and a
    # stop_at within the recorded 10 steps is not refused as "after the end of the run (3 steps)".
    cfg.train.stop_at = 9
    assert fit_to_horizon(cfg, 8) == [] and cfg.train.warmup_steps == 8
    cfg.train.warmup_steps, cfg.train.stop_at = 12, 0
    assert "is longer than the run (10 steps): using 10" in fit_to_horizon(cfg, 8)[0]
    cfg.train.warmup_steps = 8
    resumed = [lr_factor(s, cfg.train.warmup_steps, _horizon(cfg, 8, env), "cosine", 0.1) for s in range(10)]  # type: ignore[arg-type]
    assert resumed == [lr_factor(s, 8, 10, "cosine", 0.1) for s in range(10)] and resumed[6] == 7 / 8
    cfg.train.max_tokens *= 2
    assert _horizon(cfg, 2, env) == 20  # type: ignore[arg-type]  # a new budget: a new horizon
