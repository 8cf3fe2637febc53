"""data.stream: training from a dataset nobody prepared (the `datasets` streaming path, with a local
dataset folder: no network), tokenized on the fly into the node's cache, with the exact resume of
prepared data: stopped and resumed (at another world size, with an empty cache) it trains on every
sample of the global order once and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
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
