"""`prepare`'s fast path vs `datasets.map` tokenizing the same corpus with the same tokenizer.

Each side runs in a fresh process (a multi-process .map leaves the tokenizer's thread pool
slower in the same process), imports its libraries first, and is timed from reading the text
to having the token ids written to a file. Corpus: ../shared/data/quijote.txt repeated 5x when present, else the
built-in corpus.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUIJOTE = REPO.parent / "shared" / "data" / "quijote.txt"

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


def main() -> None:
    from aura_hpc.data.corpus import generate
    from aura_hpc.data.prepare import PrepareSpec, prepare

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        corpus = tmp / "corpus.txt"
        text = QUIJOTE.read_text(encoding="utf-8") if QUIJOTE.exists() else generate()
        corpus.write_text(text * 5, encoding="utf-8")
        prepared = tmp / "tok"
        prepare(PrepareSpec(out_dir=prepared, inputs=[str(QUIJOTE if QUIJOTE.exists() else corpus)], vocab_size=8192))
        tok = prepared / "tokenizer"
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
        print(
            f"corpus {corpus.stat().st_size / 1e6:.1f} MB; prepare / datasets.map = "
            f"{results['prepare'] / results['datasets.map']:.2f}x (target >= 1.3x)"
        )


if __name__ == "__main__":
    main()
