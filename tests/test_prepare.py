"""`prepare`: local txt/jsonl/parquet and the datasets (hub) path, idempotence, atomicity."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aura_hpc.data.packed import PackedTokens
from aura_hpc.data.prepare import PrepareSpec, prepare, read_manifest, split_paragraphs
from aura_hpc.errors import DataError
from tests.conftest import cli_env, run_cli, run_cli_together

DOCS = [
    "En un pueblo pequeño vivía una panadera que madrugaba cada día.",
    "El molinero abrió la puerta del molino y miró el camino largo.",
    "La maestra leyó una carta junto al río, bajo los olivos.",
    "Los arrieros cantaron en la venta del camino hasta el amanecer.",
] * 20


def _write_inputs(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    txt = root / "a.txt"
    txt.write_text("\n\n".join(DOCS[:40]) + "\n", encoding="utf-8")
    jsonl = root / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS[40:])), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = root / "c.parquet"
    pq.write_table(pa.table({"text": DOCS[:30], "n": list(range(30))}), parquet)
    return {"txt": txt, "jsonl": jsonl, "parquet": parquet}


def _expected_tokens(out: Path, files: dict[str, Path]) -> int:
    """Independent count: encode every unit with the saved tokenizer (the end-of-text tokens aside)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    n = 0
    text = files["txt"].read_text(encoding="utf-8")
    n += sum(len(tok.encode(p, add_special_tokens=False)) for p in split_paragraphs(text))
    for line in files["jsonl"].read_text(encoding="utf-8").splitlines():
        n += len(tok.encode(json.loads(line)["text"], add_special_tokens=False))
    n += sum(len(tok.encode(d, add_special_tokens=False)) for d in DOCS[:30])
    return n


def test_prepare_txt_jsonl_parquet_counts_match_the_tokenizer(tmp_path: Path) -> None:
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "prepared"
    m = prepare(PrepareSpec(out_dir=out, inputs=[str(tmp_path / "in")], vocab_size=300, val_fraction=0.1))
    assert len(m["sources"]) == 3
    eos = m["tokenizer"]["eos_id"]
    shards = {f.name: np.fromfile(f, dtype=np.uint16) for f in sorted((out / "shards").glob("*.bin"))}
    assert sum(int((t != eos).sum()) for t in shards.values()) == _expected_tokens(out, files)
    # Every document ends with an end-of-text token in each split it reached (a document whose last paragraph went to
    # validation ran into the next one in train): here every piece ends documents, so every shard ends with one.
    ended = [name for name, t in shards.items() if len(t)]
    assert ended and all(shards[name][-1] == eos for name in ended), {n: t[-3:].tolist() for n, t in shards.items()}
    docs = 1 + len(files["jsonl"].read_text(encoding="utf-8").splitlines()) + 30
    assert docs <= sum(int((t == eos).sum()) for t in shards.values()) <= 2 * docs
    assert m["val_tokens"] > 0 and m["dtype"] == "uint16"
    data = PackedTokens(out, seq_len=16)
    assert data.vocab_size == m["tokenizer"]["vocab_size"] <= 300
    # An evaluation reads every input's validation share: the split's first N were the first file's alone.
    from aura_hpc.data.packed import eval_set

    # The three inputs' validation shares are one shard, in the inputs' order (small shards are joined: each is cut into
    # sequences on its own), and an evaluation's sequences are spread evenly over it.
    counts, n_val = data.counts("val"), data.num_sequences("val")
    assert counts == [n_val] and n_val > 0 and m["pieces"] == 3, (counts, m["shards"])
    for wanted in (4, 7, n_val):
        picked = eval_set(n_val, wanted)
        assert len(set(picked)) == len(picked) == min(wanted, n_val) and max(picked) < n_val
        assert all(abs(i - k * n_val / len(picked)) < 1 for k, i in enumerate(picked)), (wanted, picked)
    # The packed stream decodes back to the input text.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    decoded = tok.decode(np.asarray(data.splits["train"][:200]).tolist())
    assert "panadera" in decoded or "molinero" in decoded
    assert tok.eos_token == "<|endoftext|>"


def test_rerun_is_a_noop_and_changed_input_is_not(tmp_path: Path) -> None:
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "p"
    spec = PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300)
    first = prepare(spec)
    mtime = (out / "manifest.json").stat().st_mtime_ns
    again = prepare(spec)
    assert again["up_to_date"] is True and (out / "manifest.json").stat().st_mtime_ns == mtime
    files["txt"].write_text("Otra cosa distinta.\n\n" * 30, encoding="utf-8")
    before = _snapshot(out)
    # Other inputs would replace data that runs may be trained on: only with --force.
    with pytest.raises(DataError, match=r"already holds data prepared from other inputs .*--force"):
        prepare(spec)
    assert _snapshot(out) == before
    spec.force = True
    changed = prepare(spec)
    assert changed["up_to_date"] is False and changed["input_key"] != first["input_key"]
    assert not list(tmp_path.glob(".p.*")), "no temporary or old sibling is left behind"


def test_globs_and_max_tokens(tmp_path: Path) -> None:
    _write_inputs(tmp_path / "in")
    m = prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=[str(tmp_path / "in" / "*.jsonl")], vocab_size=300, max_tokens=100))
    assert m["train_tokens"] + m["val_tokens"] == 100
    assert m["sources"] == [str((tmp_path / "in" / "b.jsonl").resolve())]


def test_hub_dataset_path_with_a_local_dataset_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--dataset goes through datasets.load_dataset(name, subset, split, streaming=True): the hub code path."""
    ds = tmp_path / "my_dataset"
    (ds / "data").mkdir(parents=True)
    rows = [{"content": d} for d in DOCS]
    (ds / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "p"
    r = run_cli(
        [
            "prepare",
            "--dataset",
            str(ds),
            "--split",
            "train",
            "--text-column",
            "content",
            "--vocab-size",
            "300",
            "--max-tokens",
            "500",
            "--out",
            str(out),
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = read_manifest(out)
    assert m is not None and m["dataset"]["name"] == str(ds) and m["train_tokens"] + m["val_tokens"] == 500
    # An --out inside the dataset's own folder was accepted, and the same command then refused (its output changed the input).
    inside = run_cli(
        ["prepare", "--dataset", str(ds), "--text-column", "content", "--vocab-size", "300", "--out", str(ds / "p")], timeout=120
    )
    assert inside.returncode == 2 and f"is inside the input folder {ds}" in inside.stderr and not (ds / "p").exists(), inside.stderr
    bad = run_cli(["prepare", "--dataset", str(ds), "--text-column", "text", "--out", str(tmp_path / "q")], timeout=120)
    assert bad.returncode == 2 and "column 'text' not in" in bad.stderr and "--text-column" in bad.stderr
    # A folder Dataset.save_to_disk wrote (load_dataset refused it: "use load_from_disk", with the wrong fix).
    import datasets

    from aura_hpc.data.sources import dataset_shards, records, resolve_inputs

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert dataset_shards(str(tmp_path / "saved"), None, "train") == 1
    assert list(records("", None, str(tmp_path / "saved"), None, "train", "content", "saved")) == DOCS
    # The same folders given as text: their Arrow files skipped with advice to rename them to .txt, their metadata JSON
    # refused for a --text-column.
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    for folder, fix in (
        ("saved", f"--dataset {tmp_path / 'saved'})"),
        ("saved_dict", f"--dataset {tmp_path / 'saved_dict' / 'train'}, one"),
    ):
        with pytest.raises(DataError, match=r"save_to_disk.*not text files \(fix: " + re.escape(fix)):
            prepare(PrepareSpec(out_dir=tmp_path / "r", inputs=[str(tmp_path / folder)], vocab_size=300))
    # A Hub snapshot (`hf download --repo-type dataset`) given as text: its card and its test split were trained with the
    # train one. Refused, card and splits each; as a --dataset its train split alone is read.
    repo = tmp_path / "snapshot"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "train-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (repo / "data" / "test-00000-of-00001.jsonl").write_text(json.dumps({"content": "la prueba"}) + "\n", encoding="utf-8")
    at = re.escape(str(repo))
    refused = rf"input '{at}' is a dataset repository \(%s\).* \(fix: prepare --dataset {at}, or data.dataset="
    with pytest.raises(DataError, match=refused % "its files are the Hub's shards of the splits test, train"):
        prepare(PrepareSpec(out_dir=tmp_path / "r", inputs=[str(repo)], vocab_size=300))
    assert list(records("", None, str(repo), None, "train", "content", "snapshot")) == DOCS
    (repo / "data" / "test-00000-of-00001.jsonl").unlink()
    (repo / "README.md").write_text("---\nlanguage:\n- es\nconfigs:\n- config_name: default\n  data_files: data/*.jsonl\n---\n# Corpus\n")
    with pytest.raises(DataError, match=refused % "its README.md is a dataset card"):
        prepare(PrepareSpec(out_dir=tmp_path / "r", inputs=[str(repo)], vocab_size=300))
    (repo / "README.md").write_text("---\ntitle: notes of mine, front matter and all\n---\n# Corpus\n")  # a README that is text
    assert resolve_inputs([str(repo)]) == [repo / "README.md", repo / "data" / "train-00000-of-00001.jsonl"]
    # A corpus whose own names say a split (training notes beside an evaluation): read as given, and that is said.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("training_notes.txt", "evaluation.txt", "novel.txt"):
        (corpus / name).write_text("Un párrafo.\n", encoding="utf-8")
    with caplog.at_level("WARNING", logger="aura_hpc"):
        assert len(resolve_inputs([str(corpus)])) == 3
    assert f"{corpus} holds files named for the splits train, test: they are all read alike" in caplog.text, caplog.text


def test_text_added_to_a_local_dataset_folder_is_new_input(tmp_path: Path) -> None:
    """--dataset LOCAL_FOLDER was known by its name alone: ten times the text added to it, and prepare
    kept the old data as up to date."""
    from aura_hpc.data.prepare import input_key

    train = tmp_path / "my_dataset" / "data" / "train.jsonl"
    train.parent.mkdir(parents=True)
    train.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:8]), encoding="utf-8")
    spec = PrepareSpec(out_dir=tmp_path / "p", dataset=str(tmp_path / "my_dataset"), vocab_size=300)
    first = input_key(spec, [])
    assert input_key(spec, []) == first
    train.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 10), encoding="utf-8")
    assert input_key(spec, []) != first
    # A Hub dataset's --revision is other input; a local folder has no commit to pin (`datasets` ignored it in silence).
    from aura_hpc.data.prepare import check_spec

    hub = PrepareSpec(out_dir=tmp_path / "p", dataset="someone/corpus-es")
    assert input_key(dataclasses.replace(hub, revision="4f2a9c1"), []) != input_key(hub, [])
    fix = f"--revision 'v2' applies to a dataset on the Hugging Face Hub.*git -C {re.escape(str(spec.dataset))} checkout v2"
    with pytest.raises(DataError, match=fix):
        check_spec(dataclasses.replace(spec, revision="v2"))


def test_given_tokenizer_is_used(tmp_path: Path, prepared: Path) -> None:
    files = _write_inputs(tmp_path / "in")
    m = prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=[str(files["txt"])], tokenizer=str(prepared / "tokenizer")))
    assert m["tokenizer"]["sha256"] == read_manifest(prepared)["tokenizer"]["sha256"]


def test_failed_prepare_leaves_nothing_that_looks_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "p"
    import aura_hpc.data.prepare as prep

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(prep, "_move_tail_to_val", boom)
    monkeypatch.setattr(prep, "_fsync_tree", boom)
    spec = PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300)
    with pytest.raises(RuntimeError):
        prepare(spec)
    assert not out.exists()
    # What it finished is kept, in a hidden build folder without a manifest, for the next run to resume.
    builds = list(tmp_path.glob(".p.build-*"))
    assert len(builds) == 1 and not (builds[0] / "manifest.json").exists()
    monkeypatch.undo()
    assert prepare(spec)["up_to_date"] is False and read_manifest(out) is not None
    assert not list(tmp_path.glob(".p.*"))


def test_killed_prepare_is_not_taken_as_complete(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    from aura_hpc.data.corpus import generate

    big.write_text(generate(20000, seed=7), encoding="utf-8")
    out = tmp_path / "p"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aura_hpc", "prepare", str(big), "--out", str(out)],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Killed once the build is marked as ours (a kill in the microseconds between creating the folder
    # and marking it leaves an unmarked folder, which no later run may take for its own).
    deadline = time.time() + 60

    def marked() -> bool:
        try:
            return any(m.stat().st_size > 0 for m in tmp_path.glob(".p.build-*/.aura-prepare"))
        except FileNotFoundError:  # the build finished and was renamed between the glob and the stat
            return False

    while time.time() < deadline and not marked():
        time.sleep(0.01)
    assert marked(), "prepare never started writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_manifest(out) is None
    with pytest.raises(DataError, match="not a prepared directory"):
        PackedTokens(out, 16)
    # A later run is not fooled by the leftover temp dir, removes it (it is ours: its marker names
    # a dead process of this host), and completes.
    m = prepare(PrepareSpec(out_dir=out, inputs=[str(big)], vocab_size=512))
    assert m["up_to_date"] is False and read_manifest(out) is not None
    assert not list(tmp_path.glob(".p.*")), "the killed prepare's temporary folder is cleaned up"


def _snapshot(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_prepare_never_writes_over_what_it_did_not_write(tmp_path: Path, prepared: Path) -> None:
    """The reproduced data loss: `prepare docs/a.txt --out docs` wiped docs/. Each case below is
    refused in one line naming the fix, and every byte of the user's files is still there."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("\n\n".join(DOCS[:40]), encoding="utf-8")
    (docs / "tesis.md").write_text("# Mi tesis\n\nTres años de trabajo.\n", encoding="utf-8")
    (docs / "foto.jpg").write_bytes(bytes(range(256)) * 40)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notas.txt").write_text("no tocar\n", encoding="utf-8")
    theirs = tmp_path / "theirs"  # a prepared directory of another tokenizer
    import shutil

    shutil.copytree(prepared, theirs)
    cases = [
        ([str(docs / "a.txt"), "--out", str(docs)], "contains the input"),
        ([str(docs / "a.txt"), "--out", str(docs / "a.txt")], "is the input"),
        ([str(docs), "--out", str(docs / "prepared")], "is inside the input folder"),
        ([str(docs / "a.txt"), "--out", str(other)], "is not empty and is not a prepared directory (it holds notas.txt)"),
        ([str(docs / "a.txt"), "--out", str(theirs)], "already holds data prepared from other inputs"),
    ]
    before = {d: _snapshot(d) for d in (docs, other, theirs)}
    results = run_cli_together([["prepare", *args, "--vocab-size", "300"] for args, _ in cases], timeout=180)
    for (args, expected), r in zip(cases, results, strict=True):
        lines = [x for x in r.stderr.strip().splitlines() if "prepare skips" not in x]  # a warning, not the refusal
        assert r.returncode == 2 and len(lines) == 1 and expected in lines[0] and "(fix: " in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stderr
    for d, snap in before.items():
        assert _snapshot(d) == snap, f"{d} changed"
    assert not (docs / "prepared").exists() and not list(tmp_path.glob(".*.build-*"))
    # The fix named for a folder of text works: a sibling folder.
    ok = run_cli(["prepare", str(docs), "--out", str(tmp_path / "docs-prepared"), "--vocab-size", "300"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert _snapshot(docs) == before[docs]


def test_force_replaces_only_a_folder_whose_every_file_prepare_wrote(tmp_path: Path) -> None:
    """--force judged a folder by its top-level names and took any JSON for our manifest: a user's
    tokenizer export (its own manifest.json, tokenizer/my_precious_tokenizer.json) was replaced."""
    files = _write_inputs(tmp_path / "in")
    export, bare, ours = tmp_path / "export", tmp_path / "bare", tmp_path / "ours"
    for folder in (export, bare):
        (folder / "tokenizer").mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"name": "my tokenizer export", "version": 3}))
    (export / "tokenizer" / "my_precious_tokenizer.json").write_text("{}")
    (bare / "tokenizer" / "tokenizer.json").write_text("{}")  # a name prepare writes, under a manifest it did not
    prepare(PrepareSpec(out_dir=ours, inputs=[str(files["txt"])], vocab_size=300))
    (ours / "shards" / "notes.txt").write_text("mine")
    cases = [
        (export, "(it holds tokenizer/my_precious_tokenizer.json)"),
        (bare, "(it holds a manifest.json prepare did not write)"),
        (ours, "(it holds shards/notes.txt)"),
    ]
    for out, said in cases:
        before = _snapshot(out)
        with pytest.raises(DataError, match=f"is not empty and is not a prepared directory {re.escape(said)}.*\\(fix: "):
            prepare(PrepareSpec(out_dir=out, inputs=[str(files["jsonl"])], vocab_size=300, force=True))
        assert _snapshot(out) == before


def test_windows_line_ends_cut_paragraphs_and_pieces_as_unix_ones_do(tmp_path: Path) -> None:
    """A CRLF file was one paragraph and one piece: all of it in memory, --workers and --shard-mb ignored;
    then its lines kept their carriage returns inside each paragraph (other tokens than the same text with LF)."""
    from aura_hpc.data import shards
    from aura_hpc.data.corpus import generate
    from aura_hpc.data.sources import TEXT_SUFFIXES

    text = generate(300, seed=4).replace("\n\n", "\n \n", 5)
    lf, crlf = tmp_path / "lf.txt", tmp_path / "crlf.txt"
    lf.write_bytes(text.encode())
    crlf.write_bytes(text.replace("\n", "\r\n").encode())

    def paragraphs(f: Path) -> tuple[int, list[str]]:
        pieces = shards.plan([str(f)], TEXT_SUFFIXES, 8 * 1024, None, False)
        raw = [shards.read_range(str(f), p.start, p.end).decode() for p in pieces]
        return len(pieces), [para for t in raw for para in split_paragraphs(t)]  # lines within as LF ones: the same tokens

    (n_unix, unix), (n_windows, windows) = paragraphs(lf), paragraphs(crlf)
    assert n_windows >= 4 and abs(n_windows - n_unix) <= 1  # cut at its blank lines, into as many pieces
    assert windows == unix == split_paragraphs(text)


def test_a_text_of_one_document_per_line_is_cut_into_pieces_and_units_at_line_ends(tmp_path: Path) -> None:
    """No blank line anywhere (one document per line, a common corpus format): the whole file was one piece
    (read whole by one encoder, 64 KiB at a time by every rank while planning) and one unit, all of it train."""
    from aura_hpc.data import shards
    from aura_hpc.data.sources import LONGEST_PARAGRAPH, TEXT_SUFFIXES

    line = "una frase de ejemplo con varias palabras para el corpus de prueba, documento {}.\n"
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(line.format(i) for i in range(50_000)), encoding="utf-8")  # 4.3 MB
    pieces = shards.plan([str(lines)], TEXT_SUFFIXES, 1 << 20, None, False)
    assert 4 <= len(pieces) <= 5 and all(p.end - p.start <= (1 << 20) + (1 << 17) for p in pieces), pieces
    raw = [shards.read_range(str(lines), p.start, p.end).decode() for p in pieces]
    assert all(t.endswith("\n") for t in raw) and "".join(raw) == lines.read_text(encoding="utf-8")
    units = split_paragraphs(lines.read_text(encoding="utf-8"))  # a "paragraph" of 4.3 MB: a unit per line
    assert len(units) == 50_000 and units[0] == line.format(0).strip() + "\n\n"
    paragraphs = "uno\ndos\n\n" + "x" * (LONGEST_PARAGRAPH // 2) + "\n"  # text of paragraphs keeps them whole
    assert split_paragraphs(paragraphs) == ["uno\ndos\n\n", "x" * (LONGEST_PARAGRAPH // 2) + "\n\n"]


def test_a_text_without_line_ends_is_cut_into_pieces_before_a_space_or_a_character(tmp_path: Path) -> None:
    """A dump without newlines was one piece whatever --shard-mb said: read whole into one encoder's memory.
    Now it is cut before a space (as a long line is cut within a piece), and with no space either, between two
    characters (each piece is UTF-8 on its own). JSON lines are still cut at line ends only."""
    from aura_hpc.data import shards
    from aura_hpc.data.sources import TEXT_SUFFIXES

    words = tmp_path / "words.txt"
    words.write_text(" ".join(f"palabra{i}" for i in range(400_000)), encoding="utf-8")  # 4.7 MB on one line
    han = tmp_path / "han.txt"
    han.write_text("ñ語" * 700_000, encoding="utf-8")  # 3.5 MB, no space, no line end: 2- and 3-byte characters
    blob = tmp_path / "one.jsonl"
    blob.write_text('{"text": "' + "x " * 1_500_000 + '"}\n', encoding="utf-8")
    for path in (words, han):
        pieces = shards.plan([str(path)], TEXT_SUFFIXES, 1 << 20, None, False)
        assert len(pieces) >= 3 and all(p.end - p.start <= (2 << 20) + 3 for p in pieces), pieces
        raw = [shards.read_range(str(path), p.start, p.end) for p in pieces]
        assert b"".join(raw) == path.read_bytes() and all(r.decode("utf-8") for r in raw)
        head = shards.head_of(pieces[0], 100_000)  # the tokenizer's sample of a piece: its head, not all of it
        assert 90_000 < head.end - head.start <= 100_000 and shards.read_range(str(path), head.start, head.end).decode("utf-8")
    words_pieces = shards.plan([str(words)], TEXT_SUFFIXES, 1 << 20, None, False)
    assert all(shards.read_range(str(words), p.start, p.start + 1) == b" " for p in words_pieces[1:]), words_pieces
    assert len(shards.plan([str(blob)], TEXT_SUFFIXES, 1 << 20, None, False)) == 1  # one JSON row: never cut


def test_text_with_nul_bytes_is_refused_at_once_and_a_rows_stray_nul_is_removed(tmp_path: Path) -> None:
    blob = tmp_path / "disk.txt"
    blob.write_bytes(b"\0" * 3_000_000)  # ran for more than 10 minutes in BPE training before
    t0 = time.perf_counter()
    r = run_cli(["prepare", str(blob), "--out", str(tmp_path / "p")], timeout=60)
    assert r.returncode == 2 and "holds NUL bytes" in r.stderr and "(fix: " in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "p").exists()
    # One row of a dataset is not a file: a stray NUL among its rows (a JSON escape) stopped the whole prepare, and
    # a stream at that window on every retry. It is removed from its row: the tokens of the same rows without it.
    # Half an emoji (a lone surrogate escape, \\ud83d, from text cut in the middle of one) raised in the tokenizer: it
    # becomes U+FFFD, the tokens of the same row with U+FFFD in its place.
    tokens = []
    odd_rows = (("stray", "a\u0000b "), ("clean", "ab "), ("half", "a\ud83db "), ("replaced", "a\ufffdb "))
    for name, odd in odd_rows:
        rows = tmp_path / name / "rows.jsonl"
        rows.parent.mkdir()
        rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in [DOCS[0], odd + DOCS[1], *DOCS[2:40]]), encoding="utf-8")
        prepare(PrepareSpec(out_dir=tmp_path / name / "p", inputs=[str(rows)], vocab_size=300))
        tokens.append([b.read_bytes() for b in sorted((tmp_path / name / "p").rglob("*.bin"))])
    assert tokens[0] and tokens[0] == tokens[1] and tokens[2] == tokens[3] and tokens[2] != tokens[1]


def test_an_out_that_is_a_link_gets_the_data_where_it_points_and_stays_a_link(tmp_path: Path) -> None:
    """`data -> scratch/prepared` (a big disk): the link was moved aside as the old output and a real folder
    took its place on the small disk; the old target kept prepare's marker file."""
    files = _write_inputs(tmp_path / "in")
    target = tmp_path / "scratch" / "prepared"
    target.mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(target, target_is_directory=True)
    for force in ([], ["--force"]):  # into the empty target, then over what prepare wrote there
        r = run_cli(["prepare", str(files["txt"]), "--out", str(link), "--vocab-size", "300", *force], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert link.is_symlink() and (target / "manifest.json").is_file(), sorted(p.name for p in tmp_path.iterdir())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in", "scratch"]
        assert sorted(p.name for p in target.parent.iterdir()) == ["prepared"] and not (target / ".aura-prepare").exists()


def test_an_interrupted_replacement_is_put_back(tmp_path: Path) -> None:
    """Killed between moving the old data aside and moving the new data in: the old data comes back."""
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "p"
    prepare(PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300))
    snap = _snapshot(out)
    aside = tmp_path / f".p.old-{_dead_pid()}"
    out.rename(aside)
    import socket

    (aside / ".aura-prepare").write_text(json.dumps({"host": socket.gethostname(), "pid": int(aside.name.rsplit("-", 1)[1])}))
    foreign = tmp_path / ".p.tmp-1"  # no marker: not ours, never touched
    foreign.mkdir()
    m = prepare(PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300))
    assert m["up_to_date"] is True and _snapshot(out) == snap and foreign.is_dir()
    # An --out whose name reads as a pattern (data[12]) leaves data2's leftovers alone: they matched, and its old data,
    # its only copy after an interrupted replacement, was moved into data[12] (or removed when data[12] existed).
    from aura_hpc.data.out_dir import clean_leftovers

    other = tmp_path / f".data2.old-{_dead_pid()}"
    (tmp_path / "p").rename(other)
    (other / ".aura-prepare").write_text(json.dumps({"host": socket.gethostname(), "pid": int(other.name.rsplit("-", 1)[1])}))
    assert clean_leftovers(tmp_path / "data[12]") == []
    kept = {k: v for k, v in _snapshot(other).items() if k != ".aura-prepare"}
    assert kept == snap and not (tmp_path / "data[12]").exists()


def test_truncated_token_file_is_detected(tmp_path: Path) -> None:
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "p"
    prepare(PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300))
    with open(out / "shards" / "train-00000.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="re-run prepare with --force"):
        PackedTokens(out, 16)


def test_a_damaged_manifest_is_named_as_damaged_and_force_prepares_the_folder_again(tmp_path: Path) -> None:
    """A manifest.json cut short (a copy interrupted, a full disk) read as no manifest: the run advised preparing the
    prepared folder as text, and `prepare --force`, the fix, refused it as a manifest prepare did not write."""
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "p"
    spec = PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300)
    prepare(spec)
    (out / "manifest.json").write_bytes((out / "manifest.json").read_bytes()[:100])
    for attempt in (lambda: PackedTokens(out, 16), lambda: prepare(spec)):
        with pytest.raises(DataError, match=r"manifest\.json is damaged: it is not JSON .*\(fix: prepare the data there again"):
            attempt()
    spec.force = True
    assert prepare(spec)["format"] == 2 and PackedTokens(out, 16).num_sequences("train") > 0


def test_a_prepared_folder_copied_without_its_tokenizer_is_refused_before_training(tmp_path: Path, prepared: Path) -> None:
    """It trained the whole run, then stopped at the last sample without a summary (the tokenizer is read
    there first), and its checkpoints held no tokenizer."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    tok = copy / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-100])  # cut short
    with pytest.raises(DataError, match=r"tokenizer.json does not match the manifest \(fix: copy the whole prepared"):
        PackedTokens(copy, 16)
    shutil.rmtree(copy / "tokenizer")
    r = run_cli(["local", "--set", f"data.path={copy}", "--output-dir", str(tmp_path)], timeout=120)
    assert r.returncode == 2 and "tokenizer.json cannot be read" in r.stderr, r.stderr
    assert "the prepared directory is incomplete" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["/nonexistent/x.txt"], "does not exist"),
        ([], "nothing to prepare"),
        (["{tmp}/notes.docx"], "unsupported type '.docx'"),
        (["{tmp}/latin1.txt"], "is not UTF-8 text"),
        (["{tmp}/a.txt", "--vocab-size", "10"], "--vocab-size must be between"),
        (["{tmp}/a.txt", "{tmp}/other.jsonl"], "column 'text' not in '{tmp}/other.jsonl'; its columns are content (fix: --text-column"),
    ],
)
def test_prepare_bad_inputs(tmp_path: Path, args: list[str], expected: str) -> None:
    _write_inputs(tmp_path)
    (tmp_path / "notes.docx").write_bytes(b"PK")
    (tmp_path / "latin1.txt").write_bytes("año".encode("latin-1"))
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCS), encoding="utf-8")  # not the first piece
    from aura_hpc.data.prepare import PrepareSpec as Spec

    argv = [a.format(tmp=tmp_path) for a in args]
    vocab = int(argv[argv.index("--vocab-size") + 1]) if "--vocab-size" in argv else 300
    inputs = [a for a in argv if not a.startswith("--") and not a.isdigit()]
    with pytest.raises(DataError, match=expected.format(tmp=tmp_path).replace("(", r"\(").replace(".", r"\.")):
        prepare(Spec(out_dir=tmp_path / "out", inputs=inputs, vocab_size=vocab))


def test_prepare_cli_on_the_shared_corpus(tmp_path: Path) -> None:
    from tests.conftest import SHARED_CORPUS

    if not SHARED_CORPUS.exists():
        pytest.skip("../shared/data/quijote.txt is not present")
    r = run_cli(["prepare", str(SHARED_CORPUS), "--out", str(tmp_path / "q"), "--vocab-size", "4096"], timeout=120)
    assert r.returncode == 0, r.stderr
    m = read_manifest(tmp_path / "q")
    assert m is not None and m["train_tokens"] > 300_000
    assert "tokens/s encoding" in r.stdout


def test_the_tokenizer_folder_loads_with_transformers_4_and_5(prepared: Path) -> None:
    """transformers 5 writes `TokenizersBackend`, a class 4.x does not know; prepare writes the name both load."""
    import json

    from transformers import AutoTokenizer

    cfg = json.loads((prepared / "tokenizer" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(str(prepared / "tokenizer"))
    assert tok.eos_token == "<|endoftext|>" and tok("hola").input_ids
    # Accented Spanish decomposed (NFD: PDFs, macOS) is the same text: the trained tokenizer normalises it (NFC).
    import unicodedata

    said = "El niño comió piñones en la montaña."
    assert tok(unicodedata.normalize("NFD", said)).input_ids == tok(said).input_ids


def _multi_piece_corpus(root: Path) -> Path:
    from aura_hpc.data.corpus import generate

    root.mkdir(parents=True, exist_ok=True)
    (root / "uno.txt").write_text(generate(900, seed=1), encoding="utf-8")
    (root / "dos.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in generate(500, seed=2).split("\n\n")), encoding="utf-8")
    return root


def test_the_same_input_gives_the_same_shards_with_one_or_two_workers(tmp_path: Path) -> None:
    corpus = _multi_piece_corpus(tmp_path / "in")
    one = prepare(PrepareSpec(out_dir=tmp_path / "w1", inputs=[str(corpus)], vocab_size=400, shard_mb=0.02, workers=1))
    two = prepare(PrepareSpec(out_dir=tmp_path / "w2", inputs=[str(corpus)], vocab_size=400, shard_mb=0.02, workers=2))
    assert one["pieces"] >= 4 and len(one["shards"]) >= 8
    assert one["data_sha256"] == two["data_sha256"] and one["shards"] == two["shards"]
    for s in one["shards"]:
        assert (tmp_path / "w1" / s["file"]).read_bytes() == (tmp_path / "w2" / s["file"]).read_bytes()
    # Every piece gives validation text, and the tokens of the pieces add up to the whole.
    assert sum(s["tokens"] for s in one["shards"] if s["split"] == "val") == one["val_tokens"] > 0


def test_an_interrupted_build_redoes_only_the_unfinished_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aura_hpc.data import shards

    corpus = _multi_piece_corpus(tmp_path / "in")
    spec = PrepareSpec(out_dir=tmp_path / "p", inputs=[str(corpus)], vocab_size=400, shard_mb=0.02)
    real = shards.encode
    encoded: list[int] = []

    def failing_at_piece_3(job: shards.Job) -> dict:
        if job.piece.index == 3:
            raise OSError("node lost")
        encoded.append(job.piece.index)
        return real(job)

    monkeypatch.setattr(shards, "encode", failing_at_piece_3)
    with pytest.raises(OSError):
        prepare(spec)
    assert encoded == [0, 1, 2] and read_manifest(tmp_path / "p") is None

    def counting(job: shards.Job) -> dict:
        encoded.append(job.piece.index)
        return real(job)

    encoded.clear()
    monkeypatch.setattr(shards, "encode", counting)
    m = prepare(spec)
    assert encoded == list(range(3, m["pieces"])), "pieces 0-2 were finished and are not encoded again"
    fresh = prepare(PrepareSpec(out_dir=tmp_path / "fresh", inputs=[str(corpus)], vocab_size=400, shard_mb=0.02))
    assert m["data_sha256"] == fresh["data_sha256"]


@pytest.mark.parametrize("filler", [70_000, 0], ids=["every id", "ids with a gap"])
def test_a_vocabulary_above_65535_is_stored_as_uint32(tmp_path: Path, filler: int) -> None:
    """Its ids, not its count of tokens: a vocabulary of a few hundred tokens whose ids go past 65,535 (a gap) was
    stored as uint16, and numpy wrapped each id past it onto another token, unsaid."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for d in DOCS for w in d.replace(",", " ").replace(".", " ").split()})
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"relleno{i}": i + 2 for i in range(filler)}}
    vocab.update({w: 70_002 + i for i, w in enumerate(words)})  # every real word above 65,535
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    folder = tmp_path / "big-tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(str(folder))
    files = _write_inputs(tmp_path / "in")
    spec = PrepareSpec(out_dir=tmp_path / "p", inputs=[str(files["txt"])], tokenizer=str(folder))
    from aura_hpc.data.plan import describe

    # The dry run's disk figure is for the given tokenizer's width (it read --vocab-size's: half of it).
    assert "(uint32)" in dict(describe(spec))["disk"], describe(spec)
    m = prepare(spec)
    assert m["dtype"] == "uint32" and m["tokenizer"]["vocab_size"] > 65_536
    data = PackedTokens(tmp_path / "p", seq_len=8)
    ids = data.sequences("train", list(range(data.num_sequences("train"))))
    assert ids.max() >= 70_002 and set(ids.ravel().tolist()) <= set(vocab.values())


def test_dry_run_says_what_it_would_read_and_write(tmp_path: Path) -> None:
    corpus = _multi_piece_corpus(tmp_path / "in")
    out = tmp_path / "p"
    r = run_cli(["prepare", str(corpus), "--out", str(out), "--dry-run", "--workers", "2", "--shard-mb", "0.02"], timeout=60)
    assert r.returncode == 0, r.stderr
    for row in ("read", "tokens", "shards", "disk", "time"):
        assert f"{row}:" in r.stdout, r.stdout
    assert "2 file(s)" in r.stdout and "with 2 worker(s)" in r.stdout and "uint16" in r.stdout
    assert not out.exists() and not list(tmp_path.glob(".p.*"))
    # An --out the run refuses (the input folder itself) printed a plan and exited 0.
    into = run_cli(["prepare", str(corpus), "--out", str(corpus), "--dry-run"], timeout=60)
    assert into.returncode == 2 and f"--out {corpus} contains the input" in into.stderr, into.stdout + into.stderr


def test_a_folder_with_files_prepare_cannot_read_says_so_and_the_path_to_use_is_quoted(tmp_path: Path) -> None:
    """Files without a supported extension were skipped in silence, and `use it: --set data.path=...` broke
    when pasted for a path with spaces."""
    from aura_hpc.data.corpus import generate

    src = tmp_path / "my corpus"
    src.mkdir()
    (src / "a.txt").write_text(generate(300, seed=3), encoding="utf-8")
    (src / "NOTES").write_text("texto sin extensión\n", encoding="utf-8")
    (src / ".hidden").write_text("not ours to mention\n", encoding="utf-8")
    out = tmp_path / "my data"
    r = run_cli(["prepare", str(src), "--out", str(out), "--vocab-size", "300"], timeout=120)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "prepare skips 1 file(s) in" in said and "NOTES (rename them to .txt to include them)" in said and ".hidden" not in said, said
    assert f"--set data.path='{out}'" in said, said
    # A compressed file: renamed to .txt as advised, gzip's bytes were read as text.
    import gzip

    (src / "more.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hola"}\n'))
    r = run_cli(["prepare", str(src), "--out", str(tmp_path / "again"), "--vocab-size", "300"], timeout=120)
    assert r.returncode == 0 and "(decompress them (e.g. gunzip), or rename plain-text ones to .txt to include them)" in r.stderr, r.stderr


def test_rows_with_unicode_line_separators_a_byte_order_mark_and_a_column_that_is_not_text(tmp_path: Path) -> None:
    """JSON leaves U+2028, U+2029 and U+0085 unescaped inside strings (scraped text, cp1252 read as latin-1):
    str.splitlines() cut rows there and prepare stopped on valid JSON lines. A byte-order mark (PowerShell,
    Excel) was trained as text or refused as JSON. A text column holding lists was found out only after
    reading every row; and one line far longer than a paragraph was one encoding call (3.5 GB for 20 MB)."""
    from aura_hpc.data import shards
    from aura_hpc.data.sources import LONGEST_PARAGRAPH, TEXT_SUFFIXES

    def texts(f: Path, column: str = "text") -> list[str]:
        pieces = shards.plan([str(f)], TEXT_SUFFIXES, 1 << 20, None, False)
        jobs = [shards.Job(p, str(tmp_path), "", 0, "uint16", 0.0, column) for p in pieces]
        return [t for job in jobs for t, _ in shards.piece_texts(job)]

    rows = ["una\u2028línea", "otra\u2029más", "mojibake\x85aquí", "normal"]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": r}, ensure_ascii=False) + "\n" for r in rows).encode())
    assert texts(jsonl) == rows
    txt = tmp_path / "bom.txt"
    txt.write_bytes(b"\xef\xbb\xbfcontra a\n")
    assert texts(txt) == ["contra a\n\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "bien"}\n{"text": "roto\n', encoding="utf-8")
    with pytest.raises(DataError, match="the line at byte 17 is not JSON"):
        texts(bad)
    listed = tmp_path / "lists.jsonl"
    listed.write_text(json.dumps({"text": ["a", "b"], "body": "texto"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"column .text. of .* holds list, not text .*--text-column"):
        texts(listed)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [[1, 2]], "body": ["texto"]}), tmp_path / "lists.parquet")
    with pytest.raises(DataError, match="holds list, not text"):
        texts(tmp_path / "lists.parquet")
    line = ("palabra " * (LONGEST_PARAGRAPH // 8 * 3)).strip()  # one 3 MB line, no line break in it
    units = split_paragraphs(line + "\n")
    assert len(units) >= 3 and all(len(u) <= LONGEST_PARAGRAPH + 2 for u in units)
    assert "".join(u.removesuffix("\n\n") for u in units) == line and all(u.startswith(" ") for u in units[1:])
    huge = tmp_path / "huge.jsonl"  # the same as one JSON row's text: one document, its end after its last piece
    huge.write_text(json.dumps({"text": line}) + "\n", encoding="utf-8")
    pieces = shards.plan([str(huge)], TEXT_SUFFIXES, 1 << 20, None, False)
    got = [x for p in pieces for x in shards.piece_texts(shards.Job(p, str(tmp_path), "", 0, "uint16", 0.0, "text"))]
    assert len(got) >= 3 and "".join(t for t, _ in got) == line and [e for _, e in got] == [False] * (len(got) - 1) + [True]


def test_the_tokenizer_sample_reads_its_share_of_each_piece_not_the_whole_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--tokenizer-sample-mb took its share of every piece after reading the whole piece: a 256 MB sample of a
    500 GB corpus read (from object storage: downloaded) all 500 GB before encoding began."""
    from aura_hpc.data import prepare as prepare_module
    from aura_hpc.data import shards
    from aura_hpc.data.corpus import generate

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(generate(9000, seed=3), encoding="utf-8")
    reads: list[int] = []
    real_read, real_make = shards.read_range, prepare_module.make_tokenizer

    def read_range(*args: Any, **kwargs: Any) -> bytes:
        got = real_read(*args, **kwargs)
        reads.append(len(got))
        return got

    during: list[int] = []

    def make_tokenizer(*args: Any, **kwargs: Any) -> Any:
        before = sum(reads)
        made = real_make(*args, **kwargs)
        during.append(sum(reads) - before)
        return made

    monkeypatch.setattr(shards, "read_range", read_range)
    monkeypatch.setattr(prepare_module, "make_tokenizer", make_tokenizer)
    spec = PrepareSpec(out_dir=tmp_path / "p", inputs=[str(corpus)], vocab_size=300, shard_mb=0.5, tokenizer_sample_mb=0.1)
    m = prepare(spec)
    size = corpus.stat().st_size
    trained = [s for s in m["shards"] if s["split"] == "train"]
    assert size > 1.5 * 2**20 and len(trained) >= 4, (size, m["shards"])  # a piece's train shards are not joined, only small ones
    assert during and 0.1 * 2**20 <= during[0] < 0.25 * size, (during, size)  # the sample's share, and line ends found
    assert m["train_tokens"] + m["val_tokens"] > 0 and sum(reads) - during[0] >= size, "the encoding still reads it all"


def test_a_token_budget_over_several_pieces_encodes_no_piece_past_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-tokens over several pieces encoded the first wave's pieces whole (up to --workers data files of a
    Hub dataset), then the one that crossed the budget again, cut."""
    from aura_hpc.data import shards
    from aura_hpc.data.corpus import generate

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(generate(9000, seed=4), encoding="utf-8")
    encoded: list[int] = []
    real = shards.encode

    def encode(job: Any) -> dict[str, Any]:
        record = real(job)
        encoded.append(record["train"]["tokens"] + record["val"]["tokens"])
        return record

    monkeypatch.setattr(shards, "encode", encode)
    m = prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=[str(corpus)], vocab_size=300, shard_mb=0.5, max_tokens=5000))
    assert m["train_tokens"] + m["val_tokens"] == 5000
    assert encoded and sum(encoded) <= 2 * 5000, encoded  # before: [330924, 5000]


def test_the_tokenizer_sample_of_json_lines_with_escapes_and_other_fields_gets_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON rows hold other fields too, and json.dumps writes every accent as a 6-byte \\uXXXX: a share read as one
    window of bytes gave the tokenizer a fraction of the characters asked (68% of them in Spanish, 19% in Chinese)."""
    from aura_hpc.data import prepare as prepare_module
    from aura_hpc.data.corpus import generate

    paras = [p for p in generate(6000, seed=6).split("\n\n") if p.strip()]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"url": f"https://ejemplo.es/{i}", "lang": "es", "text": p}) + "\n" for i, p in enumerate(paras)))
    fed: list[int] = []
    real = prepare_module.train_tokenizer

    def train_tokenizer(texts: Any, *args: Any) -> Any:
        def counted() -> Any:
            for t in texts:
                fed.append(len(t))
                yield t

        return real(counted(), *args)

    monkeypatch.setattr(prepare_module, "train_tokenizer", train_tokenizer)
    prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=[str(rows)], vocab_size=300, shard_mb=1.0, tokenizer_sample_mb=0.2))
    assert rows.stat().st_size > 1.2 * 2**20 and sum(fed) >= 0.95 * 0.2 * 2**20, (sum(fed), rows.stat().st_size)


def test_an_input_the_disk_cannot_read_is_not_called_malformed() -> None:
    from aura_hpc.data.sources import _unreadable

    said = str(_unreadable("/datos/filas.json", "json", OSError(5, "Input/output error")))
    assert "could not be read: [Errno 5] Input/output error" in said and "make it UTF-8 JSON" not in said, said


def test_a_disk_that_refuses_a_write_mid_prepare_is_one_line(tmp_path: Path) -> None:
    """A full disk (here a file size limit: the same OSError path) while the shards were written was a traceback."""
    text = tmp_path / "in.txt"
    text.write_text("".join(f"{d} {i}\n\n" for i in range(40) for d in DOCS), encoding="utf-8")
    code = (
        "import resource, signal, sys\nfrom aura_hpc.cli import main\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nresource.setrlimit(resource.RLIMIT_FSIZE, (60000, 60000))\n"
        "sys.exit(main(['prepare', sys.argv[1], '--out', sys.argv[2], '--vocab-size', '300', '--workers', '1']))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(text), str(tmp_path / "p")], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "File too large while preparing (fix: check that path" in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "p").exists()


def test_a_token_id_past_the_vocabulary_is_named_before_it_reaches_a_device(tmp_path: Path) -> None:
    """A shard whose ids pass the vocabulary (damaged; or a bucket's shard and manifest that agree with each other alone)
    reached the embedding: on a GPU a device-side assert, the batch unnamed. The rank that reads it says so, and the
    launcher shows its line, not rank 0's "lost the connection" to it."""
    files = _write_inputs(tmp_path / "in")
    out = tmp_path / "p"
    prepare(PrepareSpec(out_dir=out, inputs=[str(files["txt"])], vocab_size=300))
    data = PackedTokens(out, seq_len=16)
    assert data.sequences("train", [0, 1]).max() < data.vocab_size
    shard = out / "shards" / "train-00000.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[20:400] = 60_000
    ids.tofile(shard)
    said = r"the train data holds token id 60000, outside the tokenizer's \d+ \(a damaged or foreign shard of train shard\(s\) 0\)"
    with pytest.raises(DataError, match=said):
        PackedTokens(out, seq_len=16).sequences("train", [0, 1])
    # The launcher's verdict when rank 1 read it and rank 0 lost rank 1 (rank 0's line came first, exit 1).
    from types import SimpleNamespace

    from aura_hpc.launch.agent import _failure

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    lost = "lost the connection to the rank(s) at 127.0.0.1 during step 109: their process or machine stopped"
    for rank, error in ((0, lost), (1, "the train data holds token id 60000, outside the tokenizer's 300 (...) (fix: prepare")):
        start = f"[rank{rank}] 2026-11-30 19:13:20 INFO start rank={rank} local_rank={rank} world_size=2 node_rank=0 host=h\n"
        (logs / f"rank_{rank}.log").write_text(start + f"[rank{rank}] 2026-11-30 19:13:22 ERROR {error}\n")
    cfg = SimpleNamespace(run_dir=tmp_path / "run", output_dir=str(tmp_path))
    plan = SimpleNamespace(cfg=cfg, node_rank=0, nproc=2, nnodes=1, max_restarts=0, master="127.0.0.1:1")
    failed = _failure(plan, {}, said_codes={1, 2})  # type: ignore[arg-type]
    assert failed.exit_code == 2 and str(failed).startswith("the train data holds token id 60000"), str(failed)


def _many_shards(prepared: Path, out: Path, n: int) -> list[np.ndarray]:
    """`prepared`'s training tokens cut into `n` shards of two 64-token sequences each (what prepare writes for a corpus of
    many files: a shard per file at least); returns each shard's tokens."""
    import hashlib
    import shutil

    shutil.copytree(prepared, out)
    manifest = json.loads((out / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"])
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    tokens = np.concatenate([np.fromfile(out / s["file"], dtype=dtype) for s in train])
    for s in train:
        (out / s["file"]).unlink()
    parts, entries = [], []
    for k in range(n):
        part = tokens[k * 129 : (k + 1) * 129]
        part.tofile(out / f"shards/train-{k:05d}.bin")
        parts.append(part)
        entries.append(
            {"split": "train", "file": f"shards/train-{k:05d}.bin", "tokens": 129, "sha256": hashlib.sha256(part.tobytes()).hexdigest()}
        )
    manifest["shards"] = entries + [s for s in manifest["shards"] if s["split"] == "val"]
    manifest["train_tokens"] = 129 * n
    (out / "manifest.json").write_text(json.dumps(manifest))
    return parts


def test_more_shards_than_open_files_are_read_and_a_shard_replaced_under_a_run_is_named(
    tmp_path: Path, prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard was mapped as the data was opened, each map holding a file descriptor: a directory of 1,100 shards
    stopped every rank at its start with 'Too many open files' under the common limit of 1,024."""
    many = tmp_path / "many"
    parts = _many_shards(prepared, many, 600)
    code = (
        "import hashlib, resource, sys\nfrom aura_hpc.data.packed import PackedTokens\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))\n"  # hard too: no more to raise it to (a container's)
        "r = PackedTokens(sys.argv[1], 64)\nassert r.max_mapped == 256 and len(r._maps) == 0, r.max_mapped\n"
        "rows = r.sequences('train', list(range(r.num_sequences('train'))))\n"
        "print(r.num_sequences('train'), hashlib.sha256(rows.tobytes()).hexdigest())\n"
    )
    read = subprocess.run([sys.executable, "-c", code, str(many)], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    expected = np.stack([p[j * 64 : j * 64 + 65].astype(np.int64) for p in parts for j in (0, 1)])
    import hashlib

    assert read.stdout.split() == ["1200", hashlib.sha256(expected.tobytes()).hexdigest()]

    # Under a soft limit below the hard one (the common 1,024 of 1,048,576), it is raised: every shard mapped at the start.
    import resource

    from aura_hpc.data import packed

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    if before[1] == resource.RLIM_INFINITY or before[1] >= 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, before[1]))
        try:
            assert packed.open_files_allowed() > 1024 and resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1024
            opened = PackedTokens(many, 64)
            assert len(opened._maps) == sum(map(len, opened.shards.values())) > 600
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, before)

    # Read (mapped when read), the others past it, then its file replaced: by the same tokens (a prepare --force of the
    # same inputs) it is read on; by others, the run is told rather than trained on tokens its manifest does not list.
    monkeypatch.setattr(packed, "open_files_allowed", lambda: 256)  # as under that limit
    reader = PackedTokens(many, 64)
    reader.sequences("train", list(range(1200)))  # shard 0 is no longer mapped
    shard = many / "shards/train-00000.bin"
    for tokens in (parts[0], parts[0][::-1].copy()):
        tokens.tofile(shard.with_suffix(".new"))
        shard.with_suffix(".new").replace(shard)
        if tokens is parts[0]:
            assert (reader.sequences("train", [0]) == expected[:1]).all()
            reader.sequences("train", list(range(2, 1200)))
        else:
            with pytest.raises(DataError, match=r"train-00000.bin was replaced by other tokens while this run read"):
                reader.sequences("train", [0])


def test_a_corpus_of_many_small_files_keeps_its_tokens_in_whole_sequences(tmp_path: Path) -> None:
    """One file per article: a piece, so a shard, each, and every shard cut into sequences on its own (the tokens short of
    one at its end left out): prepare counted them all, training read half at data.seq_len 256 and none at 1024."""
    articles = tmp_path / "articles"
    articles.mkdir()
    for i in range(40):
        (articles / f"{i:03d}.txt").write_text("\n\n".join(DOCS[i : i + 3]) + "\n", encoding="utf-8")
    m = prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=[str(articles)], vocab_size=300, val_fraction=0.1))
    assert m["pieces"] == 40
    data = PackedTokens(tmp_path / "p", 64)
    for split in ("train", "val"):
        # Alone, each article lost the tokens past its last whole sequence: a third of them here.
        assert data.num_sequences(split) == (m[f"{split}_tokens"] - 1) // 64 > 0, m["shards"]
    assert len(m["shards"]) == 2 and sorted(p.name for p in (tmp_path / "p" / "shards").iterdir()) == ["train-00040.bin", "val-00040.bin"]


def test_a_glob_run_again_does_not_take_the_output_it_wrote_for_input(tmp_path: Path) -> None:
    """`prepare 'corpus/**/*.json*' --out corpus/prepared`, then the same command: the glob matched the output's own manifest
    and tokenizer files, and the run was refused with --out corpus/prepared-prepared, which the glob matches too."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    spec = PrepareSpec(out_dir=corpus / "prepared", inputs=[f"{corpus}/**/*.json*"], vocab_size=300)
    first = prepare(spec)
    assert first["sources"] == [str(corpus / "a.jsonl")]
    assert prepare(spec)["up_to_date"] is True
