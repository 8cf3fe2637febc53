"""`local`: train on this machine or on LAN machines, through torch's elastic launcher."""

from __future__ import annotations

import argparse

from aura_hpc.cli.common import add_run_options, flags_from_env, show_plan
from aura_hpc.errors import EXIT_USER_ERROR


def cmd_local(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.launch.local import launch, plan_local, summary

    flags_from_env(a, {"nnodes": 1, "node_rank": 0})
    from aura_hpc.train.process.startup_gc import imports_unscanned

    # The plan imports torch only where this machine has GPUs to count; the agent's modules come once the data
    # and the run directory have passed their checks (launch): a refusal is answered without them.
    with imports_unscanned():
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
            force=a.force,
            dry_run=a.dry_run,
        )

    def warn() -> None:
        for w in plan.warnings:
            console.warn(w)

    if a.dry_run:
        warn()
    console.heading(
        f"aura_hpc local: run {plan.cfg.run_name!r}, node {plan.node_rank}/{plan.nnodes}, "
        f"{plan.nproc} process{'es' if plan.nproc != 1 else ''}, master {plan.master}"
    )
    if a.dry_run:
        show_plan(plan.cfg, plan.nproc * plan.nnodes, plan.memory, plan.gpu_mem_gib or None)
        for line in plan.data_lines:
            console.info(line)
        console.info(f"run directory: {plan.cfg.run_dir} (nothing was written or started)")
        if plan.refusal:  # the plan is shown, and the status is the run's: a script gating on the dry run stops here
            console.warn(f"local would refuse this: {plan.refusal}")
            return EXIT_USER_ERROR
        return 0
    status = launch(plan, ready=warn)  # warnings once the data and run directory passed their checks
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


def _nproc(value: str) -> int | None:
    """A count, or torchrun's words for the default (one per GPU)."""
    if value.strip().lower() in ("auto", "gpu"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is no count (fix: a number, or omit it for one per GPU, 2 on CPU)") from None


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "local",
        help="train on this machine or on LAN machines (no Slurm)",
        description="Train with torch's elastic launcher. With no arguments: the tiny preset on the "
        "built-in Spanish corpus, 2 CPU processes (or one per GPU).",
    )
    add_run_options(p)
    p.add_argument("--nnodes", "--nodes", dest="nnodes", type=int, help="number of machines (default 1)")
    p.add_argument("--node-rank", type=int, help="this machine's index, 0 on the master (default 0)")
    p.add_argument(
        "--nproc-per-node",
        "--gpus",
        dest="nproc_per_node",
        type=_nproc,
        help="processes on this machine (default, or torchrun's auto/gpu: one per GPU, or 2 on CPU)",
    )
    p.add_argument("--master-addr", help="IP address of node 0 (needed with --nnodes > 1)")
    p.add_argument("--master-port", type=int, help="TCP port on node 0 (default 29500; a free one on a single machine)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers this many times after a failure (default 0)")
    p.add_argument("--rdzv-timeout", type=int, default=120, help="seconds to wait for all nodes to join (default 120)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], help="process-group backend (default: auto)")
    p.add_argument("--ifname", help="network interface for gloo/NCCL (default: the one that routes to the master)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (batch, memory per GPU) and start nothing")
    p.add_argument("--force", action="store_true", help="start even when the memory plan says it will not fit")
    p.set_defaults(func=cmd_local)
