"""data.stream: training from a dataset nobody prepared (the `datasets` streaming path, with a local
dataset folder: no network), tokenized on the fly into the node's cache, with the exact resume of
prepared data: stopped and resumed (at another world size, with an empty cache) it trains on every
sample of the global order once and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from aura_hpc.data.corpus import generate
from aura_hpc.data.stream import STRIDE
from tests.conftest import SMALL_MODEL, final_weights, run_cli, run_cli_together

pytestmark = pytest.mark.slow


def _dataset(root: Path, files: int = 6) -> Path:
    """A local dataset folder of JSON-lines files: `datasets` streams one piece per file."""
    folder = root / "mi_dataset" / "data"
    folder.mkdir(parents=True)
    paragraphs = generate(1400, seed=21).split("\n\n")
    per = len(paragraphs) // files
    for i in range(files):
        rows = paragraphs[i * per : (i + 1) * per]
        (folder / f"train-{i:02d}.jsonl").write_text("".join(json.dumps({"texto": p}) + "\n" for p in rows), encoding="utf-8")
    return folder.parent


def _args(out: Path, name: str, dataset: Path, tokenizer: Path, cache: Path, nproc: int, extra: list[str]) -> list[str]:
    return [
        "local", "--nproc-per-node", str(nproc), "--output-dir", str(out), "--run-name", name,
        "--set", "data.stream=true", "--set", f"data.dataset={dataset}", "--set", "data.text_column=texto",
        "--set", f"data.tokenizer={tokenizer}", "--set", f"data.cache_dir={cache}", "--set", "data.shuffle_window=2",
        "--set", "train.batch_size=4", "--set", "train.max_steps=40", "--set", "train.warmup_steps=2",
        "--set", "train.checkpoint_every=0", "--set", "train.eval_every=20", *SMALL_MODEL, *extra,
    ]  # fmt: skip


def test_a_stream_resumed_at_another_world_size_with_an_empty_cache_trains_like_an_uninterrupted_run(
    tmp_path: Path, prepared: Path
) -> None:
    dataset = _dataset(tmp_path)
    samples = tmp_path / "samples"
    straight, first = run_cli_together(
        [
            _args(tmp_path, "straight", dataset, prepared, tmp_path / "cache-a", 2, []),
            _args(tmp_path, "cut", dataset, prepared, tmp_path / "cache-b", 2, ["--set", "train.stop_at=17"]),
        ],
        timeout=400,
        AURA_PROBE_SAMPLES=str(samples),
    )
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "streaming" in first.stdout and "6 piece(s)" in first.stdout
    # The second half on another node: an empty cache, one process instead of two (accumulating 2
    # micro-steps keeps the effective batch, so the weights must be equal).
    second = run_cli(
        _args(tmp_path, "cut", dataset, prepared, tmp_path / "cache-c", 1, ["--set", "train.grad_accum=2"]),
        timeout=400,
        AURA_PROBE_SAMPLES=str(samples / "cut"),
    )
    assert second.returncode == 0 and "resumed from checkpoint step_00000017" in second.stdout, second.stdout[-3000:]
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "cut")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a), "the resumed stream trained on other samples"
    # The resumed half encoded only what it read from step 17 on, not the stream from its start.
    encoded = sorted(p.name for p in (tmp_path / "cache-c" / "stream").glob("*/done/*.json"))
    assert 0 < len(encoded) < 6, encoded

    # Every position once, and the same sequence at each position as the uninterrupted run.
    def rows(folder: Path) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for f in folder.glob("*.jsonl"):
            for line in f.read_text().splitlines():
                r = json.loads(line)
                out[r["start"]] = r["ids"]
        return out

    cut_rows = {**rows(samples / "cut")}
    straight_rows = rows(samples)  # the straight run and the first half of the cut one wrote here
    positions = sorted(p for start, ids in cut_rows.items() for p in range(start, start + len(ids)))
    assert positions == list(range(17 * 8, 40 * 8))
    for start, ids in cut_rows.items():
        assert straight_rows[start] == ids
        assert all(i // STRIDE < 6 for i in ids)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tokenizer folder (trained in well under a second)."""
    from aura_hpc.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(iter(generate(400, seed=3).split("\n\n")), 300, out)
    return out


@pytest.mark.parametrize("pieces", [2, 3])
def test_a_stream_of_a_few_pieces_reads_every_sequence_at_the_default_window(tmp_path: Path, tok: Path, pieces: int) -> None:
    """Up to 4 pieces are one window by default (data.shuffle_window=0): the order was the permutation
    of 0..n-1, which a stream's ids (piece * STRIDE + j) are not, so it read past piece 0's end."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data.stream import StreamOrder, StreamTokens

    text = generate(400, seed=3)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    shard_mb = len(text.encode()) / pieces / 2**20 * 1.05  # just over a share: the last piece is shorter
    d = DataConfig(stream=True, path=str(tmp_path / "a.txt"), tokenizer=str(tok), cache_dir=str(tmp_path / "c"), shard_mb=shard_mb)
    data = StreamTokens(d, seq_len=16)
    try:
        assert len(data.pieces) == pieces
        order = StreamOrder(data, seed=1234, window=d.shuffle_window)
        data.fetch("train", order.window_shards(0, 0))
        order.refresh()
        ids = order.indices(0, order.n)
        assert sorted(ids) == sorted(i * STRIDE + j for i, n in enumerate(data.counts()) for j in range(n))
        assert data.sequences("train", ids).shape == (order.n, 17)
    finally:
        data.close()


def test_each_subset_and_split_of_a_dataset_has_its_own_stream_cache(tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """c4's es/train, en/train and es/validation (4 data files each) shared one cache folder, and the
    pieces one of them encoded were trained on as the other's."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data import sources
    from aura_hpc.data.stream import StreamTokens

    monkeypatch.setattr(sources, "dataset_shards", lambda name, subset, split: 4)  # no network
    builds = set()
    for subset, split in (("es", "train"), ("en", "train"), ("es", "validation")):
        d = DataConfig(
            stream=True, dataset="allenai/c4", dataset_subset=subset, dataset_split=split, tokenizer=str(tok), cache_dir=str(tmp_path)
        )
        data = StreamTokens(d, seq_len=16)
        builds.add(data.build)
        data.close()
    assert len(builds) == 3


def test_a_local_dataset_folder_edited_is_another_stream(tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local dataset folder was known by its name alone: the pieces encoded before an edit were
    trained on as the new text. Another node's copy of it (other mtimes) is the same stream."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data import sources
    from aura_hpc.data.stream import StreamTokens

    monkeypatch.setattr(sources, "dataset_shards", lambda name, subset, split: 1)  # datasets not started: the key is what is tested
    folder = _dataset(tmp_path, files=2)

    def key(dataset: Path) -> str:
        d = DataConfig(stream=True, dataset=str(dataset), tokenizer=str(tok), cache_dir=str(tmp_path / "cache"))
        data = StreamTokens(d, seq_len=16)
        data.close()
        return data.key

    first = key(folder)
    for f in (folder / "data").iterdir():
        os.utime(f, (1e9, 1e9))
    assert key(folder) == first
    with open(folder / "data" / "train-01.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"texto": "Un párrafo nuevo."}) + "\n")
    assert key(folder) != first
