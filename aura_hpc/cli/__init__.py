"""The `python -m aura_hpc` command line: one module per command (cmd_*.py), each adding its parser.

Only argparse at import time: torch, transformers and datasets are imported inside the
commands that need them, so `--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import sys

from aura_hpc.cli import cmd_check, cmd_data, cmd_jobs, cmd_local, cmd_submit
from aura_hpc.errors import AuraError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aura_hpc",
        description="Train a GPT-2-style language model from a laptop to a Slurm cluster with the same trainer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The order of `--help`: train, follow jobs, check machines, data.
    for command in (cmd_local, cmd_submit, cmd_jobs, cmd_check, cmd_data):
        command.add(sub)
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
