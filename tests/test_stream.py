"""data.stream: training from a dataset nobody prepared (the `datasets` streaming path, with a local
dataset folder: no network), tokenized on the fly into the node's cache, with the exact resume of
prepared data: stopped and resumed (at another world size, with an empty cache) it trains on every
sample of the global order once and ends where an uninterrupted run ends."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
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
        "--set", "data.shard_mb=0.01",  # under one file: each of the dataset's files stays a piece of its own
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
    assert "trained on other data" not in second.stdout + second.stderr  # the same files: the same stream
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

    monkeypatch.setattr(sources, "dataset_shards", lambda name, subset, split, revision=None: 4)  # no network
    builds = set()
    for subset, split in (("es", "train"), ("en", "train"), ("es", "validation")):
        d = DataConfig(
            stream=True, dataset="allenai/c4", dataset_subset=subset, dataset_split=split, tokenizer=str(tok), cache_dir=str(tmp_path)
        )
        data = StreamTokens(d, seq_len=16)
        builds.add(data.build)
        data.close()
    assert len(builds) == 3


def test_a_pinned_hub_revision_is_its_own_stream_every_read_asks_for_it_and_a_local_folder_refuses_one(
    tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub dataset was streamed at whatever its newest commit was: a resume after a new commit met other text (said,
    with no way to pin it). data.dataset_revision (prepare --revision) is its own cache and reaches `datasets` at every
    read; a local folder has no commit (`datasets` ignores one in silence): refused, with the fix."""
    import datasets

    from aura_hpc.config import load_config
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data import shards, sources
    from aura_hpc.data.stream import StreamTokens
    from aura_hpc.errors import ConfigError, DataError

    monkeypatch.setattr(sources, "dataset_shards", lambda name, subset, split, revision=None: 2)  # no network
    hub = "someone/corpus-es"
    streams = {}
    for revision in ("", "4f2a9c1", "v2"):
        d = DataConfig(stream=True, dataset=hub, dataset_revision=revision, tokenizer=str(tok), cache_dir=str(tmp_path / "cache"))
        streams[revision] = StreamTokens(d, seq_len=16)
        streams[revision].close()
    assert len({s.build for s in streams.values()}) == 3
    newest = streams[""]
    newest._sizes["train"][0] = 5  # counted by the run before a new commit of the dataset changed piece 0
    with pytest.raises(DataError, match=r"piece 0 .* holds 3 sequences, not the 5 .* --set data.dataset_revision=COMMIT"):
        newest._learn(0, {"train": {"tokens": 3 * 16 + 1}, "val": {"tokens": 0}})
    asked: list[tuple[str, str | None]] = []

    def offline(name: str, *args: object, **kwargs: object) -> object:  # records what datasets was asked for; tests have no network
        asked.append((name, kwargs.get("revision")))  # type: ignore[arg-type]
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    pinned = streams["4f2a9c1"]
    with pytest.raises(DataError, match="needs the network"):
        list(shards.piece_texts(shards.Job(pinned.pieces[1], **pinned._job)))  # what the encoder of piece 1 reads
    monkeypatch.undo()
    with pytest.raises(DataError, match="needs the network"):
        monkeypatch.setattr(datasets, "load_dataset", offline)
        sources.dataset_shards(hub, None, "train", "4f2a9c1")  # how many pieces it has
    assert asked == [(hub, "4f2a9c1"), (hub, "4f2a9c1")]
    folder = _dataset(tmp_path, files=1)
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["data.stream=true", f"data.dataset={folder}", "data.dataset_revision=v2", f"data.tokenizer={tok}"])
    said = str(refused.value)
    assert "applies to a dataset on the Hugging Face Hub" in said and f"git -C {folder} checkout v2" in said, said
    with pytest.raises(ConfigError, match="no dataset is given"):
        load_config(None, [f"data.path={folder}", "data.stream=true", "data.dataset_revision=v2", f"data.tokenizer={tok}"])


def test_a_local_dataset_folder_edited_is_another_stream(tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local dataset folder was known by its name alone: the pieces encoded before an edit were
    trained on as the new text. Another node's copy of it (other mtimes) is the same stream."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data import sources
    from aura_hpc.data.stream import StreamTokens

    monkeypatch.setattr(sources, "dataset_shards", lambda name, subset, split, revision=None: 1)  # the key is what is tested
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
    # Kept at another path (LAN nodes, each its own copy: /data/c4-es here, /scratch/c4 there): the same stream.
    # The folder's path in the key refused every rank ("different prepared data"), the copies alike.
    shutil.copytree(folder, tmp_path / "elsewhere" / "copy")
    assert key(tmp_path / "elsewhere" / "copy") == first
    with open(folder / "data" / "train-01.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"texto": "Un párrafo nuevo."}) + "\n")
    assert key(folder) != first


def test_a_file_kept_through_a_link_to_another_name_is_the_same_stream_and_one_given_twice_is_read_once(tmp_path: Path, tok: Path) -> None:
    """A LAN node whose corpus.txt links to quijote_v2.txt on another disk named the file by its target: another key
    (every rank refused as "different prepared data") and another order of pieces. Read through both names, once."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data.stream import StreamTokens

    text = generate(300, seed=5)
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "otro.txt").write_text(text[: len(text) // 3], encoding="utf-8")
    (tmp_path / "a" / "corpus.txt").write_text(text, encoding="utf-8")
    (tmp_path / "disk2").mkdir()
    (tmp_path / "disk2" / "quijote_v2.txt").write_text(text, encoding="utf-8")
    (tmp_path / "b" / "corpus.txt").symlink_to(tmp_path / "disk2" / "quijote_v2.txt")

    def stream(path: str) -> StreamTokens:
        data = StreamTokens(DataConfig(stream=True, path=path, tokenizer=str(tok), cache_dir=str(tmp_path / "cache")), seq_len=16)
        data.close()
        return data

    a = stream(str(tmp_path / "a"))
    assert stream(str(tmp_path / "b")).key == a.key
    twice = stream(str(tmp_path / "b" / "*.txt"))  # a glob that takes the link and the file it names would read it twice
    (tmp_path / "b" / "también.txt").symlink_to(tmp_path / "b" / "otro.txt")
    assert stream(str(tmp_path / "b" / "*.txt")).pieces == twice.pieces


def test_a_step_across_a_windows_boundary_keeps_the_window_it_still_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards in object storage, a step whose positions span windows 0 and 1: making window 1 ready pinned windows 1
    and 2 and prefetched 2, which evicted window 0's shards while the step still read them; they were fetched again
    on one rank, outside the ranks' agreement. Window 0 stays pinned through that step. Where the cache holds two
    windows, window 2's prefetch, refused for room then, is made again once window 0 is let go; and steps longer
    than a window still have the next one fetched behind them."""
    from aura_hpc.data.cache import CacheFull
    from aura_hpc.data.order import GlobalOrder
    from aura_hpc.train.loop import data_feed

    class Bucket:
        remote = True

        def __init__(self, room: int) -> None:
            self.room = room  # shards the cache holds
            self.pinned: set[int] = set()
            self.fetched: list[list[int]] = []

        def fetch(self, split: str, ids: list[int]) -> None:
            if len(self.pinned | set(ids)) > self.room:
                raise CacheFull("the shards needed now do not fit in data.cache_gb")
            self.fetched.append(sorted(ids))

        def pin(self, split: str, ids: set[int]) -> None:
            self.pinned = set(ids)

        def close(self) -> None: ...

    monkeypatch.setattr(data_feed.distributed, "agree", lambda *a, **k: [])
    order = GlobalOrder([4] * 6, seed=0, window=2)  # windows of 2 shards, 8 sequences each
    window = [sorted(order.window_shards(0, w)) for w in range(3)]
    bucket = Bucket(room=4)  # two windows
    feed = data_feed.DataFeed(bucket, order, patience_s=5)  # type: ignore[arg-type]
    try:
        feed.ensure(0, 3)  # inside window 0: it and window 1 (fetched behind it)
        feed._fetch((0, 1)).result()
        assert bucket.pinned == {*window[0], *window[1]} and window[1] in bucket.fetched
        feed.ensure(6, 3)  # positions 6, 7 in window 0, 8 in window 1: window 0 kept
        assert {*window[0], *window[1]} <= bucket.pinned
        with pytest.raises(CacheFull):
            feed._fetch((0, 2)).result()  # no room for window 2 beside them yet
        feed.ensure(9, 3)  # window 1 alone: window 2 fetched behind it now
        feed._fetch((0, 2)).result()
        assert bucket.pinned == {*window[1], *window[2]} and window[2] in bucket.fetched
    finally:
        feed.close()
    small = GlobalOrder([4] * 6, seed=0, window=1)  # every step of 6 reads two windows of 4
    bucket = Bucket(room=6)
    feed = data_feed.DataFeed(bucket, small, patience_s=5)  # type: ignore[arg-type]
    try:
        for step in range(3):
            feed.ensure(step * 6, 6)
            ahead = feed._kept[-1]
            feed._fetch(ahead).result()
            assert small.window_shards(*ahead) in bucket.fetched, (step, ahead, bucket.fetched)
    finally:
        feed.close()


def test_nodes_whose_caches_know_different_windows_agree_on_them_in_the_same_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step over several small windows (a folder of small files, a piece each): a node whose stream cache knew
    every window's sizes (it encoded them in an earlier attempt) asked the ranks about window 0 first, one whose
    cache knew window 0 only asked about window 1 first; each waited for the other's answer until its patience
    ran out, and the run stopped with "ranks did not all report". Two DataFeeds in threads, the agreement
    through a dict as through the rendezvous store."""
    import threading
    import time

    from aura_hpc.data.stream import StreamOrder
    from aura_hpc.train.loop import data_feed

    true = [3, 2, 4, 3, 2, 3, 4, 2, 3, 3, 2, 4]  # sequences per piece

    class Pieces:
        remote = True

        def __init__(self, known: set[int]) -> None:
            self.sizes = [n if i in known else -1 for i, n in enumerate(true)]

        def counts(self, split: str = "train") -> list[int]:
            return list(self.sizes)

        def fetch(self, split: str, ids: list[int]) -> None:  # encoding a piece teaches its size
            for i in ids:
                self.sizes[i] = true[i]

        def pin(self, *args: object) -> None: ...

        def close(self) -> None: ...

    said: dict[tuple[str, int], str] = {}
    asked: dict[int, list[str]] = {0: [], 1: []}
    node = threading.local()

    def agree(topic: str, problem: str, patience_s: float, waiting: str = "") -> list[str]:
        asked[node.rank].append(topic)
        said[(topic, node.rank)] = problem or "ok"
        give_up = time.monotonic() + patience_s
        while not all((topic, r) in said for r in (0, 1)):
            if time.monotonic() > give_up:
                return [f"ranks did not all report on {topic}"]
            time.sleep(0.01)
        return []

    monkeypatch.setattr(data_feed.distributed, "agree", agree)
    first = StreamOrder(Pieces(set(range(12))), 0, 1).window_shards(0, 0)
    ended: dict[int, str] = {}

    def run(rank: int, known: set[int]) -> None:
        node.rank = rank
        order = StreamOrder(Pieces(known), seed=0, window=1)
        feed = data_feed.DataFeed(order.data, order, patience_s=5)
        try:
            feed.ensure(0, 8)
            ended[rank] = "ok"
        except data_feed.DataUnavailable as exc:
            ended[rank] = str(exc)
        finally:
            feed.close()

    nodes = [threading.Thread(target=run, args=(0, set(range(12)))), threading.Thread(target=run, args=(1, set(first)))]
    for t in nodes:
        t.start()
    for t in nodes:
        t.join(30)
    assert ended == {0: "ok", 1: "ok"} and asked[0] == asked[1] and len(asked[0]) >= 2, (ended, asked)


def test_an_encoder_killed_mid_piece_is_a_data_error_at_once_not_a_wait_forever(tmp_path: Path, tok: Path) -> None:
    """The OOM killer ends a rank's encoder process mid-piece: the rank said nothing and waited forever (a pool of
    workers replaced the dead one and never answered for its piece), holding the piece's lock, the node's
    other ranks behind it. Now: a one-line DataError naming the piece and the likely cause. Slurm's stop
    signals, which reach the encoder too, leave it encoding (they killed it: exit 74 instead of a requeue)."""
    import signal
    import threading
    import time

    import psutil

    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data.stream import StreamTokens
    from aura_hpc.errors import DataError

    (tmp_path / "a.txt").write_text(generate(2000, seed=3) * 48, encoding="utf-8")  # 22 MB: many seconds of encoding
    d = DataConfig(stream=True, path=str(tmp_path / "a.txt"), tokenizer=str(tok), cache_dir=str(tmp_path / "c"))
    data = StreamTokens(d, seq_len=16)
    said: list[str] = []

    def encode() -> None:
        try:
            data.fetch("train", [0])
            said.append("encoded")
        except DataError as exc:
            said.append(str(exc))

    try:
        worker = threading.Thread(target=encode, daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        encoders: list[psutil.Process] = []
        while not encoders or encoders[0].cpu_times().user < 1.0:  # past its imports: encoding the piece
            assert time.monotonic() < deadline and not said, said
            encoders = []
            for child in psutil.Process().children():  # earlier tests' children may linger as zombies: no command line
                with contextlib.suppress(psutil.Error):
                    if "spawn_main" in " ".join(child.cmdline()):
                        encoders.append(child)
            time.sleep(0.05)
        # Slurm's stop signals reach every process of the step: they are the rank's to act on, and the encoder goes on.
        for sig in (signal.SIGUSR2, signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            encoders[0].send_signal(sig)
        time.sleep(0.5)
        assert encoders[0].is_running() and encoders[0].status() != psutil.STATUS_ZOMBIE and not said, said
        encoders[0].kill()
        worker.join(30)
        assert not worker.is_alive(), "the rank waited for a dead encoder"
        assert len(said) == 1 and "the encoder of piece 0 of " in said[0] and "died (killed: out of memory?" in said[0], said
    finally:
        data.close()


def test_a_run_resumed_on_edited_files_says_its_position_is_in_another_order(tmp_path: Path, tok: Path) -> None:
    """A checkpoint of a stream whose files were edited before the resume: it went on silently, at the old sample
    count in the new text's order, with the old pieces' learned sizes. It goes on (new text is a use), and says so."""
    from aura_hpc.train.checkpoint.reading import read_meta

    dataset = _dataset(tmp_path)
    args = lambda cache, extra: _args(tmp_path, "edited", dataset, tok, tmp_path / cache, 1, extra)  # noqa: E731
    first = run_cli(args("cache-a", ["--set", "train.stop_at=17"]), timeout=400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = read_meta(tmp_path / "edited" / "checkpoints" / "step_00000017")["data_sha256"]
    for f in sorted((dataset / "data").iterdir()):  # each file cut to its first quarter
        rows = f.read_text(encoding="utf-8").splitlines(keepends=True)
        f.write_text("".join(rows[: len(rows) // 4]), encoding="utf-8")
    second = run_cli(args("cache-b", []), timeout=400)
    out = second.stdout + second.stderr
    assert second.returncode == 0 and "resumed from checkpoint step_00000017" in out, out[-3000:]
    line = next((x for x in out.splitlines() if "trained on other data" in x), "")
    assert f"checkpoint step_00000017 was trained on other data (data_sha256 {before[:12]}" in line, out[-3000:]
    assert "goes on at sample 68 of this data's order" in line and "(fix: for an exact resume" in line, line
    assert "its validation split may now hold text already trained on (eval_loss reads low)" in line, line
    after = read_meta(tmp_path / "edited" / "checkpoints" / "step_00000040")["data_sha256"]
    assert after != before and after[:12] in line


def test_a_stream_without_one_complete_sequence_says_so_in_one_line(tmp_path: Path, tok: Path) -> None:
    """Prepared data is refused at once; a stream learns its sizes as it encodes, and ended in a ZeroDivisionError."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data.stream import StreamOrder, StreamTokens
    from aura_hpc.errors import DataError

    (tmp_path / "a.txt").write_text("hola mundo.\n\nun texto corto.\n", encoding="utf-8")
    d = DataConfig(stream=True, path=str(tmp_path / "a.txt"), tokenizer=str(tok), cache_dir=str(tmp_path / "c"))
    data = StreamTokens(d, seq_len=256)
    try:
        order = StreamOrder(data, seed=0, window=0)
        data.fetch("train", order.window_shards(0, 0))
        with pytest.raises(DataError, match=r"no complete sequence \(fix: more data or a smaller data\.seq_len"):
            order.refresh()
    finally:
        data.close()


def test_a_folder_of_small_files_streams_them_together_with_no_tail_dropped_and_a_validation_split(tmp_path: Path, tok: Path) -> None:
    """Each file was a piece of its own, and a piece's tail shorter than a sequence is dropped: a folder of one-paragraph
    files streamed at seq_len 128 trained on half its text and kept 4 sequences of validation (at GPT-2's 1024, a
    folder of 1 KB articles trained on almost nothing). Small files are now read together up to data.shard_mb, in
    order, each still a document of its own; a large file among them is still cut, and a dataset folder likewise."""
    from aura_hpc.config.tree import DataConfig, RunConfig
    from aura_hpc.data import shards
    from aura_hpc.data.stream import StreamTokens
    from aura_hpc.train.parts.build import data_line

    paragraphs = generate(700, seed=5).split("\n\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, para in enumerate(paragraphs[:-200]):
        (docs / f"a{i:04d}.txt").write_text(para, encoding="utf-8")
    (docs / "b-big.txt").write_text("\n\n".join(paragraphs[-200:]), encoding="utf-8")  # over data.shard_mb: cut
    for i in range(20):
        (docs / f"c{i:04d}.jsonl").write_text(json.dumps({"text": paragraphs[i]}) + "\n", encoding="utf-8")
    files = sorted(docs.iterdir())
    shard_mb = 16384 / 2**20
    seq_len = 128
    d = DataConfig(stream=True, path=str(docs), tokenizer=str(tok), cache_dir=str(tmp_path / "c"), shard_mb=shard_mb, val_fraction=0.05)
    data = StreamTokens(d, seq_len=seq_len)
    try:
        pieces = data.pieces
        assert len(pieces) < len(files) / 10, len(pieces)
        # Every file once, in order (the large one in several ranges); no piece mixes text and JSON lines.
        read = [f for p in pieces for f, _ in (p.files or ((p.source, 0),))]
        assert list(dict.fromkeys(read)) == [str(f) for f in files]
        assert all(p.kind == ("jsonl" if p.source.endswith(".jsonl") else "text") for p in pieces)
        assert all(sum(n for _, n in p.files) <= 16384 for p in pieces)
        assert sum(1 for p in pieces if p.source.endswith("b-big.txt")) >= 2
        data.fetch("train", list(range(len(pieces))))
        data.fetch_validation(8, list(range(len(pieces))))
        records = [json.loads(f.read_text()) for f in sorted((data.build / shards.DONE).glob("*.json"))]
        tokens = sum(r["train"]["tokens"] for r in records)
        assert data.num_sequences("train") * seq_len > 0.95 * tokens, (data.num_sequences("train"), tokens)
        assert data.num_sequences("val") >= 4
        # Each file is a document: its end-of-text token, in whichever split its last paragraph went.
        eos = int(data.manifest["tokenizer"]["eos_id"])
        joined = next(r for r in records if len(r["piece"].get("files", [])) > 1)
        ends = sum(int((np.fromfile(data.build / r[s]["file"], dtype=data.dtype) == eos).sum()) for r in [joined] for s in ("train", "val"))
        assert ends >= len(joined["piece"]["files"])
        # A one-file piece is recorded as before: what an earlier release encoded is still found.
        assert "files" not in shards.piece_record(next(p for p in pieces if not p.files))
        assert "no validation sequence" not in data_line(RunConfig(data=d), data)
    finally:
        data.close()
    # A stream too small for one validation sequence says so where the run describes its data (eval_loss never came).
    small = DataConfig(stream=True, path=str(files[0]), tokenizer=str(tok), cache_dir=str(tmp_path / "c1"))
    data = StreamTokens(small, seq_len=8)
    try:
        data.fetch("train", [0])
        data.fetch_validation(8, [0])
        said = data_line(RunConfig(data=small), data)
        assert said.endswith("no validation sequence, so no eval_loss (fix: a larger data.val_fraction or data.shuffle_window: "
                             "a stream's validation comes from the pieces of its first window)"), said  # fmt: skip
    finally:
        data.close()

    # A local dataset folder of many small files: `datasets` reads several as one piece.
    folder = _dataset(tmp_path / "ds", files=24)
    d = DataConfig(stream=True, dataset=str(folder), text_column="texto", tokenizer=str(tok), cache_dir=str(tmp_path / "c2"))
    d.shard_mb = sum(f.stat().st_size for f in (folder / "data").iterdir()) / 3.5 / 2**20
    data = StreamTokens(d, seq_len=seq_len)
    try:
        assert len(data.pieces) == 4
        data.fetch("train", [0, 3])
        whole = sum(json.loads(f.read_text())["train"]["tokens"] for f in (data.build / shards.DONE).glob("*.json"))
        assert data.num_sequences("train") * seq_len > 0.95 * whole
    finally:
        data.close()


def test_a_streams_encoded_pieces_keep_to_data_cache_gb_and_come_back_when_needed(tmp_path: Path, tok: Path) -> None:
    """data.cache_gb bounded the shards fetched from a bucket, not a stream's encoded pieces: a stream of a large Hub
    dataset filled the node's disk. Past the bound the oldest go, never the pieces a window or validation needs."""
    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data.stream import StreamTokens
    from aura_hpc.errors import DataError

    text = generate(400, seed=3)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    shard_mb = len(text.encode()) / 6 / 2**20 * 1.05
    d = DataConfig(stream=True, path=str(tmp_path / "a.txt"), tokenizer=str(tok), cache_dir=str(tmp_path / "c"), shard_mb=shard_mb)
    d.cache_gb = 1e-6  # ~1 KB: under one piece
    data = StreamTokens(d, seq_len=16)
    try:
        n = len(data.pieces)
        data.fetch_validation(4, [0])
        data.fetch("train", list(range(n)))
        first = data.sequences("train", [2 * STRIDE])
        data.pin("train", {n - 1})
        left = sorted(int(f.stem.rsplit("-", 1)[1]) for f in (data.build / "shards").glob("*.bin"))
        assert left == [0, 0, n - 1, n - 1], left  # validation's piece and the window's, each a train and a val shard
        # A step that still reads the window before (its positions span two windows): the piece let go is encoded again
        # where it is read (it was a FileNotFoundError), then an epoch that comes back to it through the feed.
        assert (data.sequences("train", [2 * STRIDE]) == first).all()
        data.pin("train", {n - 1})
        data.fetch("train", [2])
        assert (data.sequences("train", [2 * STRIDE]) == first).all()
    finally:
        data.close()
    # A piece whose count from a checkpoint (or an earlier encoding) the text no longer gives (a Hub dataset's new commit):
    # taken in silence, positions mapped to other sequences on each node. Now one line with the fix.
    for f in (data.build / "shards").glob("*-00002.*"):
        f.unlink()
    again = StreamTokens(d, seq_len=16)
    try:
        again.learn_counts([c + 1 if i == 2 else c for i, c in enumerate(data.counts())])
        with pytest.raises(
            DataError, match=r"piece 2 of .* holds \d+ sequences, not the \d+ counted before in this run: its text changed"
        ) as said:
            again.fetch("train", [2])
        assert str(said.value).endswith(
            f"(fix: the text as it was, then re-run to resume; or, for the new text, a new --run-name after removing {again.build})"
        )
    finally:
        again.close()


def test_stream_builds_no_run_uses_go_oldest_first_past_data_cache_gb(tmp_path: Path, tok: Path) -> None:
    """Each edit of the text (another key) made a new build in the node's cache, and none was ever removed: the disk
    filled. Past data.cache_gb the builds no run holds go, the one used longest ago first; a held one stays, and
    what the cache did not write stays."""
    import os

    from aura_hpc.config.tree import DataConfig
    from aura_hpc.data.stream import StreamTokens
    from aura_hpc.data.stream_builds import _bytes

    def stream(seed: int, cache_gb: float = 1e-6) -> StreamTokens:
        (tmp_path / f"{seed}.txt").write_text(generate(60, seed=seed), encoding="utf-8")
        d = DataConfig(stream=True, path=str(tmp_path / f"{seed}.txt"), tokenizer=str(tok), cache_dir=str(tmp_path / "c"))
        d.cache_gb = cache_gb
        data = StreamTokens(d, seq_len=16)
        data.fetch("train", [0])
        return data

    foreign = tmp_path / "c" / "stream" / "notes-of-mine"
    foreign.mkdir(parents=True)
    first, second = stream(1), stream(2)  # first is held: it stays, whatever the bound
    builds = tmp_path / "c" / "stream"
    assert first.build.is_dir() and second.build.is_dir()
    for data in (first, second):
        data.close()  # its process goes on (the final checkpoint reads the build's tokenizer): still held
    early = stream(5)  # a run starting meanwhile, with room for nothing: it removes neither
    early.close()
    early.let_go()
    assert first.build.is_dir() and second.build.is_dir()
    for data in (first, second):
        data.let_go()  # as its process's exit does
    os.utime(first.build / "in-use.lock", (1e9, 1e9))  # used longest ago, then the early one
    os.utime(early.build / "in-use.lock", (1e9 + 1, 1e9 + 1))
    third = stream(3, cache_gb=2 * _bytes(second.build) / 2**30)  # room for two such builds, not three and the third's start
    try:
        assert not first.build.exists() and not early.build.exists() and second.build.is_dir() and third.build.is_dir()
    finally:
        third.close()
        third.let_go()
    for data in (second, third):
        os.utime(data.build / "in-use.lock", (1e9, 1e9))
    again = stream(3, cache_gb=1.0)  # within the bound: nothing goes
    again.close()
    again.let_go()
    assert second.build.is_dir() and third.build.is_dir() and foreign.is_dir()
    assert sorted(p.name for p in builds.iterdir()) == sorted([second.build.name, third.build.name, "notes-of-mine"])
