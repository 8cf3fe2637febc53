"""Data at scale, measured: `prepare`'s fast path vs `datasets.map`; `prepare --workers` 1 vs 2
(tokens/s, and the same tokens); training from an S3-compatible server (moto's server mode, over
HTTP) with a cold and a warm node cache (time to the first step); and the per-step stall of a
stream tokenized on the fly vs the same text prepared beforehand.

    python bench/bench_prepare.py [--parts map,workers,s3,stream]

Each side runs in a fresh process. Corpus: ../shared/data/quijote.txt (repeated where said) when
present, else the built-in corpus.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUIJOTE = REPO.parent / "shared" / "data" / "quijote.txt"
SMALL = ["--set", "model.n_layer=2", "--set", "model.n_embd=128", "--set", "model.n_head=2", "--set", "data.seq_len=128"]
SMALL += ["--set", "train.batch_size=8", "--set", "train.eval_every=0", "--set", "train.warmup_steps=2"]


FAST = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import transformers, tokenizers  # imported before the clock starts, as on the datasets.map side
    from aura_hpc.data.prepare import PrepareSpec, prepare
    src, tok, out = sys.argv[1:4]
    t0 = time.perf_counter()
    m = prepare(PrepareSpec(out_dir=Path(out), inputs=[src], tokenizer=tok, force=True))
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens": m["train_tokens"] + m["val_tokens"], "seconds": dt}))
""")

MAP = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import datasets
    from transformers import AutoTokenizer
    datasets.disable_progress_bars()
    src, tok_dir, out = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("text", data_files=[src], split="train", sample_by="paragraph",
                               cache_dir=out + "/cache")
    ids = ds.map(lambda b: {"ids": tok(b["text"])["input_ids"]}, batched=True, num_proc=2, remove_columns=["text"])
    arr = np.concatenate([np.asarray(x, dtype=np.uint16) for x in ids["ids"]])
    arr.tofile(out + "/tokens.bin")
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens": int(arr.size), "seconds": dt}))
""")


WORKERS = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import tokenizers
    from aura_hpc.data.prepare import PrepareSpec, prepare
    src, tok, out, workers = sys.argv[1:5]
    t0 = time.perf_counter()
    m = prepare(PrepareSpec(out_dir=Path(out), inputs=[src], tokenizer=tok, force=True, workers=int(workers), shard_mb=1.0))
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens": m["train_tokens"] + m["val_tokens"], "seconds": dt, "sha": m["data_sha256"], "pieces": m["pieces"]}))
""")


def _text() -> str:
    from aura_hpc.data.corpus import generate

    return QUIJOTE.read_text(encoding="utf-8") if QUIJOTE.exists() else generate()


def part_map(tmp: Path, tok: Path) -> None:
    corpus = tmp / "corpus5.txt"
    corpus.write_text(_text() * 5, encoding="utf-8")
    results = {}
    for name, code in (("prepare", FAST), ("datasets.map", MAP)):
        runs = []
        for i in range(3):
            out = tmp / f"{name}-{i}"
            out.mkdir()
            r = subprocess.run(
                [sys.executable, "-c", code, str(corpus), str(tok), str(out / "p" if name == "prepare" else out)],
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        best = min(runs, key=lambda x: x["seconds"])
        results[name] = best["tokens"] / best["seconds"]
        print(
            f"{name}: {best['tokens']:,} tokens in {best['seconds']:.2f}s = {results[name]:,.0f} tok/s "
            f"(best of 3: {[round(x['seconds'], 2) for x in runs]})"
        )
    print(f"corpus {corpus.stat().st_size / 1e6:.1f} MB; prepare / datasets.map = {results['prepare'] / results['datasets.map']:.2f}x")


def part_workers(tmp: Path, tok: Path) -> None:
    corpus = tmp / "corpus10.txt"
    corpus.write_text(_text() * 10, encoding="utf-8")
    best: dict[int, dict] = {}
    for workers in (1, 2):
        runs = []
        for i in range(2):
            out = tmp / f"w{workers}-{i}"
            r = subprocess.run(
                [sys.executable, "-c", WORKERS, str(corpus), str(tok), str(out), str(workers)], check=True, capture_output=True, text=True
            )
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        best[workers] = min(runs, key=lambda x: x["seconds"])
        b = best[workers]
        print(
            f"prepare --workers {workers}: {b['tokens']:,} tokens, {b['pieces']} pieces, {b['seconds']:.2f}s = "
            f"{b['tokens'] / b['seconds']:,.0f} tok/s"
        )
    same = best[1]["sha"] == best[2]["sha"]
    print(
        f"corpus {corpus.stat().st_size / 1e6:.1f} MB; 2 workers / 1 = {best[1]['seconds'] / best[2]['seconds']:.2f}x; same tokens: {same}"
    )


def _first_step(run_dir: Path) -> float:
    log = (run_dir / "logs" / "rank_0.log").read_text()
    return float(re.search(r"first step of this attempt done: step \d+ at unix time ([\d.]+)", log).group(1))


def _train(args: list[str], env: dict | None = None) -> tuple[float, float]:
    """(seconds to the first step, seconds in all) of a `local` run."""
    import os

    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "aura_hpc", "local", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if r.returncode:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-2000:])
    out = Path(args[args.index("--output-dir") + 1]) / args[args.index("--run-name") + 1]
    return _first_step(out) - t0, time.time() - t0


def part_s3(tmp: Path, prepared: Path) -> None:
    sys.path.insert(0, str(REPO))
    from tests.conftest import free_port
    from tests.s3_server import start

    server = start(free_port())
    try:
        fs = server.fs()
        fs.put(str(prepared), "prep/q", recursive=True)
        size = sum(f.stat().st_size for f in (prepared / "shards").iterdir())
        common = ["--nproc-per-node", "2", "--output-dir", str(tmp / "runs"), *SMALL, "--set", "train.max_steps=5"]
        local = _train([*common, "--run-name", "local", "--set", f"data.path={prepared}"])
        s3 = [*common, "--set", "data.path=s3://prep/q", "--set", f"data.cache_dir={tmp / 'cache'}"]
        cold = _train([*s3, "--run-name", "cold"], server.env())
        warm = _train([*s3, "--run-name", "warm"], server.env())
        print(f"S3 (moto server on localhost, {size / 1e6:.1f} MB of shards): time to the first step, from the command's start:")
        for name, (first, total) in (("local directory", local), ("s3, cold cache", cold), ("s3, warm cache", warm)):
            print(f"  {name}: {first:.1f}s (whole 5-step run {total:.1f}s)")
    finally:
        server.stop()


def _step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if r.get("step_time_s") is not None and r["step"] > 1]


def part_stream(tmp: Path, prepared: Path, tok: Path) -> None:
    from aura_hpc.data.prepare import PrepareSpec, prepare

    raw = tmp / "raw"
    raw.mkdir()
    (raw / "corpus.txt").write_text(_text() * 2, encoding="utf-8")
    pre = tmp / "raw-prepared"
    prepare(PrepareSpec(out_dir=pre, inputs=[str(raw)], tokenizer=str(tok), shard_mb=0.5))
    common = ["--nproc-per-node", "2", "--output-dir", str(tmp / "runs"), *SMALL, "--set", "train.max_steps=120"]
    common += ["--set", "train.log_every=1", "--set", "data.shuffle_window=2"]
    _train([*common, "--run-name", "prepared", "--set", f"data.path={pre}"])
    stream = ["--set", "data.stream=true", "--set", f"data.path={raw}", "--set", f"data.tokenizer={tok}", "--set", "data.shard_mb=0.5"]
    first, _ = _train([*common, "--run-name", "streamed", *stream, "--set", f"data.cache_dir={tmp / 'stream-cache'}"])
    print("per-step time, 2 ranks, the same text prepared beforehand vs streamed (tokenized while training):")
    for name in ("prepared", "streamed"):
        times = _step_times(tmp / "runs" / name)
        med = statistics.median(times)
        slow = [t for t in times if t > 2 * med]
        print(
            f"  {name}: median {med * 1000:.1f} ms, max {max(times) * 1000:.1f} ms, steps over 2x the median: {len(slow)} of {len(times)}"
        )
    print(f"  streamed: first step {first:.1f}s after the command started (it encodes the first window and the validation text first)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="map,workers,s3,stream")
    parts = ap.parse_args().parts.split(",")
    from aura_hpc.data.prepare import PrepareSpec, prepare

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "src.txt"
        src.write_text(_text(), encoding="utf-8")
        prepared = tmp / "tok"
        prepare(PrepareSpec(out_dir=prepared, inputs=[str(src)], vocab_size=8192, shard_mb=0.25))
        tok = prepared / "tokenizer"
        if "map" in parts:
            part_map(tmp, tok)
        if "workers" in parts:
            part_workers(tmp, tok)
        if "s3" in parts:
            part_s3(tmp, prepared)
        if "stream" in parts:
            part_stream(tmp, prepared, tok)


if __name__ == "__main__":
    main()
