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


def cmd_submit(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.submit_plan import describe, plan_submit

    flags = {
        "nodes": a.nodes,
        "gpus_per_node": a.gpus,
        "cpus_per_task": a.cpus_per_task,
        "mem": a.mem,
        "time": a.time,
        "partition": a.partition,
        "account": a.account,
        "qos": a.qos,
        "constraint": a.constraint,
        "exclusive": a.exclusive,
        "job_name": a.job_name,
        "cluster": a.cluster,
        "nccl_debug": a.nccl_debug,
        "array_parallelism": a.array_parallelism,
    }
    plan = plan_submit(a.config, a.overrides, a.output_dir, a.run_name, flags, a.sweep, a.after, check=a.check)
    for w in plan.warnings:
        console.warn(w)
    if a.dry_run:
        console.heading("aura_hpc submit --dry-run: nothing is written or submitted")
        console.grid("settings (cli > config > profile > default)", ["setting", "value", "from"], [list(r) for r in describe(plan)])
        for p in plan.points:
            console.info(f"run directory: {p.cfg.run_dir}" + (f"  ({p.label})" if p.label else ""))
        console.info(f"tasks: {plan.slurm.nodes} node(s) x {plan.tasks_per_node} task(s) = world size {plan.world_size}")
        if plan.prepare_builtin:
            console.info(f"data: the built-in Spanish corpus would be prepared in {plan.prepare_builtin}")
        console.info("environment: sbatch exports your current environment (Slurm's default), plus the script's exports:")
        for k, v in plan.env.items():
            console.plain(f"  {k}={v}")
        console.info(f"sbatch script ({plan.folder / '<jobid>_submission.sh'}):")
        console.plain(plan.script)
        return 0
    from aura_hpc import submit as submitting

    ids = submitting.submit(plan)
    if plan.check:
        console.info(f"submitted check job {ids[0]} on {plan.slurm.nodes} node(s); logs in {plan.folder}")
        status = submitting.wait(ids, submitting.rank_log(plan.folder, ids[0]), printer=console.plain)
        return status
    for p, job_id in zip(plan.points, ids, strict=True):
        console.info(f"submitted job {job_id}: {p.cfg.run_dir}" + (f"  ({p.label})" if p.label else ""))
    console.info(f"follow it: python -m aura_hpc status {ids[0]}   |   python -m aura_hpc logs {ids[0]} --follow")
    if not (a.wait or a.follow):
        return 0
    log = submitting.rank_log(plan.folder, ids[0]) if a.follow else None
    status = submitting.wait(ids, log, printer=console.plain)
    console.info(f"job{'s' if len(ids) > 1 else ''} {', '.join(ids)} ended: {'COMPLETED' if status == 0 else f'exit status {status}'}")
    return status


def _job_rows(rows: list[dict[str, object]]) -> list[list[str]]:
    def fmt(v: object, spec: str = "") -> str:
        if v is None or v == "":
            return "-"
        return format(v, spec) if spec and isinstance(v, (int, float)) else str(v)

    return [
        [
            fmt(r["job_id"]),
            fmt(r["name"]),
            fmt(r["state"]),
            fmt(r["nodes"]),
            fmt(r["elapsed"]),
            fmt(r["time_left"]),
            fmt(r["reason"]),
            fmt(r["step"]),
            fmt(r["loss"], ".4f"),
            fmt(r["tokens_per_s"], ",.0f"),
            fmt(r["run_dir"]),
        ]
        for r in rows
    ]


def cmd_status(a: argparse.Namespace) -> int:
    import json

    from aura_hpc import console
    from aura_hpc.job_commands import status

    rows, notes = status(a.target, a.all)
    if a.json:
        print(json.dumps({"jobs": rows, "notes": notes}, indent=2))
        return 0
    columns = ["job", "name", "state", "nodes", "elapsed", "left", "reason", "step", "loss", "tokens/s", "run dir"]
    if rows:
        console.grid("aura_hpc jobs", columns, _job_rows(rows))
    for n in notes:
        console.info(n)
    return 0


def cmd_logs(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.job_commands import follow, log_file

    job_id, path = log_file(a.target, a.rank, a.stderr)
    if a.follow:
        follow(job_id, path, console.plain)
        return 0
    if not path.exists():
        console.info(f"{path} does not exist yet (the job may still be pending; --follow waits for it)")
        return 0
    console.plain(path.read_text(encoding="utf-8", errors="replace").rstrip("\n"))
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.job_commands import cancel

    job_id = cancel(a.target)
    console.info(f"cancelled job {job_id} (ranks get SIGTERM: they write a checkpoint at the next step if there is time)")
    return 0


def cmd_history(a: argparse.Namespace) -> int:
    import json

    from aura_hpc import console
    from aura_hpc.job_commands import history

    rows = history(a.since)
    if a.json:
        print(json.dumps({"jobs": rows}, indent=2))
        return 0
    cols = ["job", "name", "state", "exit", "nodes", "elapsed", "submitted", "run dir"]
    keys = ["job_id", "name", "state", "exit_code", "nodes", "elapsed", "submit", "run_dir"]
    console.grid(f"jobs since {a.since}", cols, [[str(r.get(k) or "-") for k in keys] for r in rows])
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    import json

    from aura_hpc import console
    from aura_hpc.check import ClusterArgs, Report, run
    from aura_hpc.errors import LaunchError

    cluster = None
    if a.nnodes > 1 or a.master_addr:
        if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
            raise LaunchError(
                f"--node-rank {a.node_rank} is not in 0..{a.nnodes - 1} (fix: --node-rank 0 on the master, 1..N-1 on the others)"
            )
        if a.nnodes > 1 and not a.master_addr:
            raise LaunchError("--nnodes > 1 needs --master-addr (fix: --master-addr <IP of node 0> on every node)")
        sizes = tuple(float(x) for x in a.sizes_mb.split(",") if x.strip())
        cluster = ClusterArgs(
            a.nnodes, a.node_rank, a.master_addr or "127.0.0.1", a.master_port, a.backend, a.shared_dir, a.timeout, sizes, a.ifname
        )

    def show(report: Report, timed_out_at: str | None = None) -> None:
        if timed_out_at:
            report.add(
                "timeout",
                False,
                f"the check did not finish within {a.timeout:g}s (stuck at: {timed_out_at})",
                "see the failed line above; a firewall that drops gloo/NCCL's data ports hangs here: open them between the nodes",
            )
        if a.json:
            print(json.dumps(report.to_json(), indent=2), flush=True)
            return
        rows = [[("ok" if f.ok and not f.warning else "WARN" if f.warning else "FAIL"), f.name, f.detail] for f in report.findings]
        console.grid(f"aura_hpc check: node {report.node_rank}/{report.nnodes}, {report.elapsed_s:.1f}s", ["", "check", "result"], rows)
        for f in report.findings:
            if not f.ok and not f.warning:
                console.error(f.line())
            elif f.warning and f.fix:
                console.warn(f.line())

    report = run(a.output_dir, cluster, lambda r, stage: show(r, stage))
    show(report)
    return 0 if report.ok else 1


def cmd_monitor(a: argparse.Namespace) -> int:
    import json
    import sys
    import time

    from aura_hpc import console
    from aura_hpc.errors import ConfigError
    from aura_hpc.gpu_health import open_reader
    from aura_hpc.resources import Sampler

    if a.interval <= 0:
        raise ConfigError(f"--interval must be positive, got {a.interval} (fix: --interval 5)")
    sampler = Sampler(open_reader(a.replay or ""), a.disk or ".")
    out = None
    if a.json:
        out = sys.stdout if a.json == "-" else open(a.json, "a", encoding="utf-8")
    live = None if out is not None or not sys.stdout.isatty() else console.live_table()
    n = 0
    try:
        while a.count == 0 or n < a.count:
            time.sleep(a.interval)
            row = sampler.sample()
            n += 1
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            elif live is not None:
                live.update(console.resources_table(row))
            else:
                console.plain(json.dumps(row))
    finally:
        if live is not None:
            live.stop()
        if out is not None and out is not sys.stdout:
            out.close()
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
        "submit",
        help="submit the trainer to Slurm (submitit)",
        description="Generate and submit the Slurm job with submitit: one task per GPU (one per node with --gpus 0). "
        "Slurm values: CLI > the config's slurm section > the cluster profile > defaults (shown by --dry-run).",
    )
    _add_run_options(p)
    p.add_argument("--cluster", help="a profile from sbatch_templates/ (generic, h100-ib, h200-ib) or a profile file")
    p.add_argument("--nodes", type=int, help="number of nodes")
    p.add_argument("--gpus", type=int, help="GPUs per node; one task per GPU (0: a CPU job with gloo)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per task (rank)")
    p.add_argument("--mem", help="memory per node, e.g. 64G (0 = all)")
    p.add_argument("--time", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--qos", help="quality of service")
    p.add_argument("--constraint", help="node features, e.g. h100")
    p.add_argument("--exclusive", action="store_true", default=None, help="whole nodes only")
    p.add_argument("--job-name", help="Slurm job name (default: aura-<run name>)")
    p.add_argument("--nccl-debug", action="store_true", default=None, help="NCCL_DEBUG=INFO (INIT,NET), one file per host in the run dir")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2", help="a job array over these values (repeatable: a grid)")
    p.add_argument("--array-parallelism", type=int, help="sweep elements running at once (default: all)")
    p.add_argument("--after", metavar="JOBID", help="start only after this job completed successfully (afterok)")
    p.add_argument("--dry-run", action="store_true", help="print the settings and the exact sbatch script; submit nothing")
    p.add_argument("--check", action="store_true", help="run `check` on every node of such an allocation instead of training")
    p.add_argument("--wait", action="store_true", help="block until the job ends; the exit status is the job's")
    p.add_argument("--follow", action="store_true", help="like --wait, streaming rank 0's log")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="your aura_hpc jobs (squeue; sacct for finished ones)")
    p.add_argument("target", nargs="?", help="a job id or a run directory (default: all your aura_hpc jobs)")
    p.add_argument("--all", action="store_true", help="also your jobs not started by aura_hpc")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="a job's per-rank log")
    p.add_argument("target", help="a job id or a run directory")
    p.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    p.add_argument("--stderr", action="store_true", help="the rank's stderr instead of stdout")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("cancel", help="cancel a job (scancel)")
    p.add_argument("target", help="a job id or a run directory")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("history", help="your past jobs (sacct)")
    p.add_argument("--since", default="now-7days", help="sacct start time, e.g. 2026-11-01 or now-2days (default now-7days)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_history)

    p = sub.add_parser(
        "check",
        help="check this machine, or the network/storage between machines (all_reduce, bandwidth, NFS)",
        description="Alone: Python, torch, CUDA/NCCL, GPUs, backends, disk. With --nnodes N on every machine: "
        "reachability, rendezvous, a verified all_reduce, bus bandwidth, clock skew, addresses and --shared-dir.",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of machines taking part (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 on the master")
    p.add_argument("--master-addr", help="IP address of node 0")
    p.add_argument("--master-port", type=int, default=29500, help="TCP port on node 0 (default 29500)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="process-group backend to test")
    p.add_argument("--shared-dir", help="a directory that should be the same (NFS) on every node: write-then-read test")
    p.add_argument("--ifname", help="network interface for gloo/NCCL (default: the one that routes to the master)")
    p.add_argument("--sizes-mb", default="1,8,32", help="all_reduce sizes for the bandwidth test (default 1,8,32)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds before the check gives up (default 10)")
    p.add_argument("--output-dir", help="where runs will go (free disk is checked there)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("monitor", help="CPU, RAM, disk, network and per-GPU readings at an interval")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--json", metavar="FILE", help="append JSON lines to FILE ('-' for stdout) instead of the live table")
    p.add_argument("--count", type=int, default=0, help="stop after this many samples (default: until Ctrl+C)")
    p.add_argument("--disk", help="the path whose filesystem is reported (default: .)")
    p.add_argument("--replay", help=argparse.SUPPRESS)  # recorded GPU readings instead of NVML (tests)
    p.set_defaults(func=cmd_monitor)

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
