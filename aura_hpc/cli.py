"""The `python -m aura_hpc` command line.

Only argparse at import time: torch, transformers and datasets are imported inside the
commands that need them, so `--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from aura_hpc.errors import AuraError

Handler = Callable[[argparse.Namespace], int]


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a preset name (tiny, gpt2-small, gpt2-medium, gpt2-1b) or a YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.lr=3e-4",
    )
    p.add_argument("--output-dir", help="where run directories go (default: runs)")
    p.add_argument("--run-name", help="the run directory's name under --output-dir; re-using it resumes")


def cmd_local(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.launch_local import launch, plan_local, summary

    plan = plan_local(
        a.config,
        a.overrides,
        a.output_dir,
        a.run_name,
        nnodes=a.nnodes,
        node_rank=a.node_rank,
        nproc=a.nproc_per_node,
        master_addr=a.master_addr,
        master_port=a.master_port,
        max_restarts=a.max_restarts,
        rdzv_timeout=a.rdzv_timeout,
        backend=a.backend,
        ifname=a.ifname,
    )
    console.heading(
        f"aura_hpc local: run {plan.cfg.run_name!r}, node {plan.node_rank}/{plan.nnodes}, "
        f"{plan.nproc} processes, master {plan.master_addr}:{plan.master_port}"
    )
    status = launch(plan)
    if status != 0:
        return status
    s = summary(plan)
    if s is None:
        console.info("done. Rank 0 ran on another node; its run directory holds the checkpoints and metrics.")
        return status
    rows = [
        ("run directory", str(plan.cfg.run_dir)),
        ("step", f"{s['step']} of {s['max_steps']}" + ("" if s["finished"] else " (stopped early; re-run to continue)")),
        ("checkpoint", str(s["checkpoint"])),
        ("metrics", f"{s['metrics']}  (TensorBoard: tensorboard --logdir {plan.cfg.run_dir / 'tensorboard'})"),
        ("logs", str(plan.cfg.run_dir / "logs")),
        ("sample", str(s["sample"])),
    ]
    console.table("training finished", rows)
    return status


def cmd_prepare(a: argparse.Namespace) -> int:
    from pathlib import Path

    from aura_hpc import console
    from aura_hpc.data.prepare import PrepareSpec, prepare

    spec = PrepareSpec(
        out_dir=Path(a.out),
        inputs=a.inputs,
        dataset=a.dataset,
        subset=a.subset,
        split=a.split,
        text_column=a.text_column,
        max_tokens=a.max_tokens,
        tokenizer=a.tokenizer,
        vocab_size=a.vocab_size,
        val_fraction=a.val_fraction,
        force=a.force,
    )
    m = prepare(spec)
    if m.get("up_to_date"):
        console.info(f"{a.out} is already prepared from these inputs (nothing to do; --force to redo)")
    console.table(
        "prepared" if not m.get("up_to_date") else "up to date",
        [
            ("directory", str(Path(a.out).resolve())),
            ("sources", ", ".join(m["sources"][:3]) + (f" (+{len(m['sources']) - 3} more)" if len(m["sources"]) > 3 else "")),
            ("tokens", f"{m['train_tokens']:,} train / {m['val_tokens']:,} validation ({m['dtype']})"),
            ("tokenizer", f"{m['tokenizer']['source']}, vocab {m['tokenizer']['vocab_size']}"),
            ("speed", f"{m.get('encode_tokens_per_s') or 0:,} tokens/s encoding, {m.get('elapsed_s')}s in all"),
            ("use it", f"--set data.path={Path(a.out).resolve()}"),
        ],
    )
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.generate import generate

    for text in generate(a.run, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed, a.num):
        console.info(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aura_hpc",
        description="Train a GPT-2-style language model from a laptop to a Slurm cluster with the same trainer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "local",
        help="train on this machine or on LAN machines (no Slurm)",
        description="Train with torch's elastic launcher. With no arguments: the tiny preset on the "
        "built-in Spanish corpus, 2 CPU processes (or one per GPU).",
    )
    _add_run_options(p)
    p.add_argument("--nnodes", type=int, default=1, help="number of machines (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 on the master (default 0)")
    p.add_argument("--nproc-per-node", type=int, help="processes on this machine (default: one per GPU, or 2 on CPU)")
    p.add_argument("--master-addr", help="IP address of node 0 (needed with --nnodes > 1)")
    p.add_argument("--master-port", type=int, help="TCP port on node 0 (default 29500; a free one on a single machine)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers this many times after a failure")
    p.add_argument("--rdzv-timeout", type=int, default=120, help="seconds to wait for all nodes to join (default 120)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], help="process-group backend (default: auto)")
    p.add_argument("--ifname", help="network interface for gloo/NCCL (default: the one that routes to the master)")
    p.set_defaults(func=cmd_local)

    p = sub.add_parser(
        "prepare",
        help="tokenize and pack text into a prepared data directory",
        description="Local .txt/.jsonl/.parquet files, folders or globs, or a Hugging Face dataset "
        "(streamed) -> packed token files + tokenizer + manifest.",
    )
    p.add_argument("inputs", nargs="*", help="files, folders or globs")
    p.add_argument("--out", required=True, help="the prepared directory to create")
    p.add_argument("--dataset", help="a Hugging Face dataset name (or a local dataset folder)")
    p.add_argument("--subset", help="the dataset's configuration/subset name")
    p.add_argument("--split", default="train", help="dataset split (default: train)")
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens (default: all)")
    p.add_argument("--tokenizer", help="a tokenizer folder or name; default: train a byte-level BPE on the input")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size of a trained tokenizer (default 8192)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of text kept for validation (default 0.01)")
    p.add_argument("--force", action="store_true", help="prepare again even if the inputs did not change")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    p.add_argument("--run", required=True, help="a run directory (output_dir/run_name)")
    p.add_argument("--prompt", default="En un lugar de la Mancha")
    p.add_argument("--max-new-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num", type=int, default=1, help="how many samples")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args))
    except AuraError as exc:
        from aura_hpc import console

        console.error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        from aura_hpc import console

        console.error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
