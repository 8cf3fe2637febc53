"""`prepare` (text to a prepared data directory) and `generate` (text from a trained run)."""

from __future__ import annotations

import argparse
import shlex

from aura_hpc.errors import first_line


def _os_error_line(exc: OSError, out: str) -> str:
    import errno

    where = exc.filename or out
    if exc.errno is None or isinstance(exc, (TimeoutError, ConnectionError)):  # a network's, not a path's
        return f"reading the inputs failed: {first_line(exc)} (fix: check the network or the storage, then run again; pieces done stay)"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on the disk of {where} while preparing (fix: free space there or choose another --out; "
            "a re-run keeps the finished pieces)"
        )
    return f"{where}: {exc.strerror or exc} while preparing (fix: check that path and its permissions, then run again; pieces done stay)"


def cmd_prepare(a: argparse.Namespace) -> int:
    from pathlib import Path

    from aura_hpc import console
    from aura_hpc.data.prepare import PrepareSpec, check_out, check_spec, prepare
    from aura_hpc.errors import DataError

    # Accepted and dropped before: the files beside a dataset, and the Slurm flags of a local prepare.
    if a.inputs and a.dataset:
        raise DataError(f"give input files or --dataset {a.dataset}, not both: the files were dropped (fix: one prepare for each)")
    given = [flag for flag, value in (("--nodes", a.nodes), ("--partition", a.partition), ("--account", a.account),
                                      ("--time", a.time), ("--wait", a.wait or None)) if value is not None]  # fmt: skip
    if given and not a.submit:
        raise DataError(f"{', '.join(given)} only apply with --submit (fix: add --submit to prepare as Slurm jobs, or drop them)")
    a.nodes, a.time = 2 if a.nodes is None else a.nodes, 120 if a.time is None else a.time
    remote_out = a.out.startswith("s3://")
    spec = PrepareSpec(
        out_dir=a.out if remote_out else Path(a.out),
        inputs=a.inputs,
        dataset=a.dataset,
        subset=a.subset,
        split=a.split,
        revision=a.revision,
        text_column=a.text_column,
        max_tokens=a.max_tokens,
        tokenizer=a.tokenizer,
        vocab_size=a.vocab_size,
        val_fraction=a.val_fraction,
        force=a.force,
        workers=a.workers,
        shard_mb=a.shard_mb,
        tokenizer_sample_mb=a.tokenizer_sample_mb,
    )

    if not (a.workers >= 1 and 0 < a.shard_mb < 1e6 and 0 < a.tokenizer_sample_mb < 1e6):  # NaN too
        raise DataError("--workers must be 1 or more, --shard-mb and --tokenizer-sample-mb above 0 (fix: --workers 2 --shard-mb 64)")
    if a.submit and (a.nodes < 1 or a.time < 1):
        raise DataError(f"--nodes and --time must be 1 or more, got {a.nodes} and {a.time} (fix: --nodes 2 --time 120)")
    if a.dry_run:
        check_spec(spec)  # what the run itself would refuse
        check_out(spec)
        from aura_hpc.data.plan import describe

        console.table(
            "prepare would",
            describe(spec) + ([("slurm", f"a tokenizer job, an array of {a.nodes} encode tasks, a finish job")] if a.submit else []),
        )
        return 0
    if a.submit:
        from aura_hpc.slurm import prepare_jobs as prepare_slurm

        jobs = prepare_slurm.submit(spec, a.nodes, a.partition, a.time, a.account)
        console.table(
            "submitted",
            [
                ("tokenizer", f"job {jobs.tokenizer}"),
                ("encode", f"array job {jobs.encode} ({a.nodes} tasks x {a.workers} worker(s))"),
                ("finish", f"job {jobs.finish}: writes {spec.out_dir}/manifest.json"),
                ("logs", str(jobs.logs)),
                ("follow", f"python -m aura_hpc status {jobs.finish}"),
            ],
        )
        if a.wait:
            console.info(prepare_slurm.wait(jobs))
        return 0
    try:
        m = prepare(spec)
    except OSError as exc:  # a full disk, an input or folder it may not read or write: a line, not a traceback
        raise DataError(_os_error_line(exc, str(a.out))) from None
    if m.get("up_to_date"):
        console.info(f"{a.out} is already prepared from these inputs (nothing to do; --force to redo)")
    console.table(
        "prepared" if not m.get("up_to_date") else "up to date",
        [
            ("directory", a.out if remote_out else str(Path(a.out).resolve())),
            ("sources", ", ".join(m["sources"][:3]) + (f" (+{len(m['sources']) - 3} more)" if len(m["sources"]) > 3 else "")),
            (
                "tokens",
                f"{m['train_tokens']:,} train / {m['val_tokens']:,} validation ({m['dtype']}), in {len(m.get('shards') or [])} shards",
            ),
            ("tokenizer", f"{m['tokenizer']['source']}, vocab {m['tokenizer']['vocab_size']}"),
            ("speed", f"{m.get('encode_tokens_per_s') or 0:,} tokens/s encoding, {m.get('elapsed_s')}s in all"),
            ("use it", f"--set data.path={shlex.quote(str(a.out if remote_out else Path(a.out).resolve()))}"),
            *guidance(m, a.vocab_size if not a.tokenizer else 0),
        ],
    )
    return 0


def _count(n: float) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n / 1e3:,.0f}K"


def guidance(m: dict, asked_vocab: int) -> list[tuple[str, str]]:
    """What this much data is good for: a vocabulary that fits it, a model size by the usual
    ~20 tokens per parameter (Hoffmann et al. 2022), and what an epoch is in steps of the tiny preset."""
    tokens = int(m["train_tokens"])
    vocab = int(m["tokenizer"]["vocab_size"])
    rows = []
    if asked_vocab and vocab < 0.9 * asked_vocab:
        rows.append(
            ("vocabulary", f"{vocab:,} tokens, fewer than --vocab-size {asked_vocab:,}: this text has no more frequent pieces to merge")
        )
    params = tokens / 20
    fits = "tiny (0.6M)" if params < 5e6 else "gpt2-small (124M)" if params < 3e8 else "gpt2-medium (350M) or larger"
    steps = tokens // (16 * 128) or 1
    rows.append(
        (
            "fits",
            f"{tokens:,} training tokens: a model of ~{_count(params)} parameters at 20 tokens each ({fits}); one epoch is "
            f"~{steps:,} steps of the tiny preset (2 x 8 x 128 tokens); a vocabulary of {min(32768, max(1024, tokens // 200)):,} suits it",
        )
    )
    return rows


def _run_to_sample(target: str | None, flag: str | None) -> str:
    """The run directory `generate` samples from: given as `status` and `logs` take it (a run directory or the job id
    `submit` printed), or with --run. `generate runs/tiny` was refused ("required: --run") where `status runs/tiny` works."""
    from pathlib import Path

    from aura_hpc.errors import ConfigError

    if target and flag and Path(target).expanduser().resolve() != Path(flag).expanduser().resolve():
        raise ConfigError(f"two runs given, one as --run ({target}, {flag}) (fix: name one: python -m aura_hpc generate RUN_DIR)")
    run = target or flag
    if not run:
        raise ConfigError("no run given (fix: python -m aura_hpc generate RUN_DIR, e.g. runs/tiny, or the job id submit printed)")
    if Path(run).expanduser().is_dir() or not run.replace("_", "").isdigit():
        return str(Path(run).expanduser())  # --run=~/runs/x: bash leaves `~` after `=` to us
    from aura_hpc.slurm.index import run_dir_of

    found = run_dir_of(run)
    if found is None:
        raise ConfigError(
            f"job {run} is not among the jobs submitted from here, and no folder {run} exists "
            "(fix: pass its run directory, output_dir/run_name, as `status` shows it)"
        )
    return str(found)


def cmd_generate(a: argparse.Namespace) -> int:
    from aura_hpc import console

    run = _run_to_sample(a.target, a.run)
    from aura_hpc.train.generate import generate

    texts = generate(run, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed, a.num)
    for i, text in enumerate(texts):
        if len(texts) > 1:  # samples are multi-line text: a header line keeps them apart
            console.plain(f"--- sample {i + 1} of {len(texts)} ---")
        console.plain(text)
    return 0


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "prepare",
        help="tokenize and pack text into a prepared data directory",
        description=".txt/.jsonl/.parquet files, folders, globs or s3:// prefixes, or a Hugging Face dataset "
        "(streamed) -> token shards + tokenizer + manifest, in a folder or under s3://bucket/prefix. Credentials for "
        "s3:// come from the standard AWS variables or profile (AWS_ENDPOINT_URL for R2/MinIO).",
    )
    p.add_argument("inputs", nargs="*", help="files, folders, globs or s3://bucket/prefix")
    p.add_argument("--out", required=True, help="the prepared directory to create (a folder, or s3://bucket/prefix)")
    p.add_argument("--dataset", help="a Hugging Face dataset name (or a local dataset folder, or one save_to_disk wrote)")
    p.add_argument("--subset", help="the dataset's configuration/subset name")
    p.add_argument("--split", default="train", help="dataset split (default: train)")
    p.add_argument("--revision", help="the Hub dataset's commit, tag or branch (default: its newest commit, which may change)")
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens (default: all)")
    p.add_argument("--tokenizer", help="a tokenizer folder or name; default: train a byte-level BPE on the input")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size of a trained tokenizer (default 8192)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of text kept for validation (default 0.01)")
    p.add_argument("--force", action="store_true", help="prepare again, also over prepared data of other inputs (never over other files)")
    p.add_argument("--workers", type=int, default=1, help="processes encoding at once; the output does not depend on it (default 1)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="text per piece, one train and one validation shard each (default 64)")
    p.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=256.0,
        help="text the tokenizer is trained on, taken evenly from the pieces (default 256)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what it would read and write (files, tokens, shards, disk, time)")
    p.add_argument("--submit", action="store_true", help="run it as Slurm jobs: a tokenizer job, an array of encode tasks, a finish job")
    p.add_argument("--nodes", type=int, default=None, help="with --submit: encode tasks in the array (default 2)")
    p.add_argument("--partition", help="with --submit: the Slurm partition")
    p.add_argument("--account", help="with --submit: the Slurm account")
    p.add_argument("--time", type=int, default=None, help="with --submit: minutes each job may run (default 120)")
    p.add_argument("--wait", action="store_true", help="with --submit: wait for the finish job and report it")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser(
        "generate",
        help="sample text from a run's latest checkpoint",
        description="Sample text from the newest valid checkpoint of a run (on CPU; the samples go to stdout).",
    )
    p.add_argument("target", nargs="?", help="a run directory (output_dir/run_name), or the job id `submit` printed")
    p.add_argument("--run", help="the same, as a flag")
    p.add_argument("--prompt", default="En un lugar de la Mancha", help="the text to continue (default: En un lugar de la Mancha)")
    p.add_argument("--max-new-tokens", type=int, default=60, help="tokens to generate after the prompt (default 60)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, lower is safer; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; 0 = all (default 40)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same samples (default 0)")
    p.add_argument("--num", type=int, default=1, help="how many samples, each preceded by a separator line (default 1)")
    p.set_defaults(func=cmd_generate)
