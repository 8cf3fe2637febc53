"""`selftest`: the GPU contract and the throughput against the reference loop, on this node."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_selftest(a: argparse.Namespace) -> int:
    from pathlib import Path

    from aura_hpc import console
    from aura_hpc.errors import ConfigError
    from aura_hpc.ops.selftest import STRATEGIES, run

    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategies: unknown {', '.join(unknown)} (fix: a comma list of {', '.join(STRATEGIES)})")
    if not strategies and a.no_bench and not a.screen:
        raise ConfigError("selftest has nothing to run: --strategies is empty and --no-bench is set (fix: drop one of them)")
    out = Path(a.out).resolve()
    if a.screen:
        return _screen(out, a)
    report = run(out, a.cpu, a.gpus, strategies, not a.no_bench, console.info)
    rows = [(c.name, ("ok: " if c.ok else "FAILED: ") + c.detail) for c in report.checks]
    t = report.throughput
    if t:
        line = f"{t['trainer_tokens_per_s']:,} tokens/s vs reference {t['reference_tokens_per_s']:,} (ratio {t['ratio']})"
        if "mfu_trainer" in t:
            line += f", MFU {100 * t['mfu_trainer']:.1f}% vs {100 * t['mfu_reference']:.1f}% of {t['peak_tflops']:g} TFLOP/s"
        rows.append((f"throughput, {t['shape']}", line))
    console.table(f"selftest on {report.device}, torch {report.torch}", rows)
    console.info(f"report: {out / 'selftest.json'}")
    if not report.checks and not report.throughput:
        console.error("selftest ran no check: every strategy asked for works between ranks and this node has one (fix: --gpus 2 or more)")
    return 0 if report.ok else 1


def _screen(out: Any, a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.errors import EXIT_SCREEN
    from aura_hpc.ops.selftest import screen_node
    from aura_hpc.slurm.profiles import load

    status, found = screen_node(out, a.cpu, a.gpus, a.cluster, load(a.cluster).screen, console.info)
    rows = [
        (
            f"rank {d['rank']} on {d['host']}",
            f"matmul {d['gemm_tflops']:.3g} TFLOP/s" + (f", all-reduce in the node {d['node_gbps']:.3g} GB/s" if "node_gbps" in d else ""),
        )
        for d in found["devices"]
    ]
    rows += [("FINDING", f["line"]) for f in found["findings"]]
    e = found["expected"]
    figures = [f"{e[k]:g} {unit}" for k, unit in (("gemm_tflops", "TFLOP/s"), ("allreduce_gbps", "GB/s in a node")) if e[k]]
    against = f"at least {e['min_fraction']:g} x {' and '.join(figures)}, and " if figures else ""
    console.table(f"pre-flight screen: {against}at least {e['relative']} x the others' median", rows)
    console.info(f"report: {out}")
    return 0 if status == 0 else EXIT_SCREEN if status == EXIT_SCREEN else status


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "selftest",
        help="prove the GPU contract on this node (no sync, no recompile, NaN skip, resume) and measure tokens/s",
        description="For each strategy a short real run with CUDA's sync debug mode in quiet steps (each sync counted by "
        "site: DeepSpeed's own allowed, none of ours), error_on_recompile, "
        "a NaN on one rank, a stop and a resume; then the trainer against an independent compiled reference loop "
        "(tokens/s, MFU). How to trust a new cluster image.",
    )
    p.add_argument("--out", default="selftest", help="where the data, runs and selftest.json go (default: ./selftest)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use for the strategy runs (default: all visible)")
    p.add_argument(
        "--strategies",
        default="ddp,fsdp,zero1,zero2,zero3,ddp+powersgd,diloco",
        help="which ones (default: all seven; ddp+powersgd and diloco need 2 GPUs or more)",
    )
    p.add_argument("--no-bench", action="store_true", help="skip the throughput run")
    p.add_argument(
        "--screen",
        action="store_true",
        help="only the pre-flight screen: every GPU's matmul TFLOP/s and the all-reduce bus bandwidth among them, "
        "against the --cluster profile's figures and against each other",
    )
    p.add_argument("--cluster", default="generic", help="the profile whose expected figures --screen judges by (default: generic)")
    p.add_argument("--cpu", action="store_true", help="run the sequence on CPU with a tiny model (a smoke test; figures meaningless)")
    p.set_defaults(func=cmd_selftest)
