"""What the commands that start a run (`local`, `submit`) share: options, and how a plan is shown."""

from __future__ import annotations

import argparse
from typing import Any


def add_run_options(p: argparse.ArgumentParser, screen: bool = True) -> None:
    p.add_argument("--config", help="a shipped preset (`python -m aura_hpc config --list`: tiny, gpt2-small, ...) or a YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.lr=3e-4",
    )
    if screen:
        _add_screen(p)
    p.add_argument("--output-dir", help="where run directories go (default: runs)")
    p.add_argument("--run-name", help="the run directory's name under --output-dir; re-using it resumes")


def _add_screen(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--screen",
        dest="overrides",
        action="append_const",
        const="health.screen=before",
        help="pre-flight screening: time every GPU's matmuls and the all-reduces before training; a node below its "
        "figures is named (and, under Slurm, left out of a requeue where the allocation can spare it)",
    )


def show_plan(cfg: Any, world: int, memory: Any, limit_gib: float | None) -> None:
    """The batch arithmetic and the memory plan of a run, as both dry runs print them."""
    from aura_hpc import console

    t = cfg.train
    per_step = t.batch_size * world * t.grad_accum
    console.info(
        f"batch: {t.batch_size} per device x {world} process{'es' if world != 1 else ''} x {t.grad_accum} accumulation = effective batch "
        f"{per_step} sequences = {per_step * cfg.data.seq_len:,} tokens per step"
    )
    if memory is None:
        return
    where = f" of {limit_gib:g} GiB" if limit_gib else ""
    title = f"memory plan per device{where}: dist.strategy={memory.strategy} on {memory.world} ranks (estimate)"
    console.grid(title, ["", "estimate"], [list(r) for r in memory.rows()])


# Launch variables of torchrun-style guides (and of compose.yaml) -> the flag each one fills.
ENV_FLAGS = (
    ("NNODES", "nnodes"),
    ("NODE_RANK", "node_rank"),
    ("MASTER_ADDR", "master_addr"),
    ("MASTER_PORT", "master_port"),
    ("GPUS_PER_NODE", "nproc_per_node"),
)


def flags_from_env(a: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Fill the launch flags not given on the command line: from the environment when
    AURA_LOCAL_FROM_ENV=1 (the Docker image sets it), else from `defaults`. A flag always wins."""
    import os

    from aura_hpc.errors import LaunchError

    use_env = os.environ.get("AURA_LOCAL_FROM_ENV") == "1"
    for var, dest in ENV_FLAGS:
        if not hasattr(a, dest) or getattr(a, dest) is not None:
            continue
        value: Any = os.environ.get(var, "").strip() if use_env else ""
        if value and dest != "master_addr":
            if not value.isdigit():
                raise LaunchError(f"{var}={value!r} is not a whole number (fix: e.g. {var}=1, or pass --{dest.replace('_', '-')})")
            value = int(value)
        setattr(a, dest, value if value not in ("", None) else defaults.get(dest))
