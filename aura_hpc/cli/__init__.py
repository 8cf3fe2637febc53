"""The `python -m aura_hpc` command line: one module per command (cmd_*.py), each adding its parser.

Only argparse at import time: torch, transformers and datasets are imported inside the
commands that need them, so `--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import sys

from aura_hpc.cli import cmd_check, cmd_config, cmd_data, cmd_jobs, cmd_local, cmd_ps, cmd_selftest, cmd_submit
from aura_hpc.errors import AuraError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aura_hpc",
        description="Train a GPT-2-style language model from a laptop to a Slurm cluster with the same trainer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The order of `--help`: train, follow jobs, check machines, data, configs.
    for command in (cmd_local, cmd_submit, cmd_ps, cmd_jobs, cmd_check, cmd_selftest, cmd_data, cmd_config):
        command.add(sub)
    return parser


# Flags users bring from torchrun, accelerate and our own other commands, and what they are here.
ALIASES = {
    ("local", "--profile"): "cluster profiles are for `submit`; on this machine pick a config with --config",
    ("local", "--cluster"): "cluster profiles are for `submit`; on this machine pick a config with --config",
    ("", "--num-processes"): "did you mean --nproc-per-node?",
    ("", "--num_processes"): "did you mean --nproc-per-node?",
    ("", "--nproc_per_node"): "did you mean --nproc-per-node?",
    ("", "--num-machines"): "did you mean --nnodes?",
    ("", "--machine-rank"): "did you mean --node-rank?",
    ("", "--node_rank"): "did you mean --node-rank?",
    ("", "--main-process-ip"): "did you mean --master-addr?",
    ("", "--master_addr"): "did you mean --master-addr?",
    ("", "--main-process-port"): "did you mean --master-port?",
    ("", "--master_port"): "did you mean --master-port?",
}


def _refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """argparse's own error, plus the closest flag of that command for each unknown one."""
    import difflib

    command = getattr(args, "command", None)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    target = sub.choices.get(command, parser) if sub is not None and command else parser
    flags = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for u in unknown:
        flag = u.split("=", 1)[0]
        known = ALIASES.get((command or "", flag)) or ALIASES.get(("", flag))
        if known:
            hints.append(f"{u}: {known}")
            continue
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6) if u.startswith("--") else []
        if close:
            hints.append(f"{u}: did you mean {close[0]}?")
    target.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args, unknown)
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
