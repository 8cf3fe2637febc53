"""The `python -m aura_hpc` command line: one module per command (cmd_*.py), each adding its parser.

Only argparse at import time: torch, transformers and datasets are imported inside the
commands that need them, so `--help` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import sys

from aura_hpc.cli import cmd_check, cmd_config, cmd_data, cmd_jobs, cmd_local, cmd_ps, cmd_selftest, cmd_submit
from aura_hpc.errors import AuraError


class Parser(argparse.ArgumentParser):
    """argparse's, with a one-line error: the usage block it prints first (13 lines for `local`) buried
    the line that names the fix; `--help` still shows it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m aura_hpc",
        description="Train a GPT-2-style language model from a laptop to a Slurm cluster with the same trainer.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="this package's version and its stack's")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # The order of `--help`: train, follow jobs, check machines, data, configs.
    for command in (cmd_local, cmd_submit, cmd_ps, cmd_jobs, cmd_check, cmd_selftest, cmd_data, cmd_config):
        command.add(sub)
    return parser


class _Version(argparse.Action):
    """argparse's own version action wraps the line at the terminal's width: one line here, read only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(_versions())
        parser.exit()


def _versions() -> str:
    """What a bug report needs, read from the installed packages' metadata (importing them costs seconds)."""
    import platform
    from importlib import metadata

    from aura_hpc import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    stack = ", ".join(f"{name} {installed(name)}" for name in ("torch", "transformers", "deepspeed", "submitit"))
    return f"aura_hpc {__version__} (python {platform.python_version()}, {stack})"


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
    """argparse's own error, plus the closest flag of that command (or config key) for each unknown one."""
    command = getattr(args, "command", None)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    target = sub.choices.get(command, parser) if sub is not None and command else parser
    flags = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for i, u in enumerate(unknown):
        flag = u.split("=", 1)[0]
        known = ALIASES.get((command or "", flag)) or ALIASES.get(("", flag))
        if known:
            hints.append(f"{u}: {known}")
            continue
        if not u.startswith("--"):
            continue
        value = u.split("=", 1)[1] if "=" in u else (unknown[i + 1] if i + 1 < len(unknown) and not unknown[i + 1].startswith("-") else "")
        hint = _closest(flag, flags, value)
        if hint:
            hints.append(f"{flag}: {hint}")
    target.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _closest(flag: str, flags: list[str], value: str) -> str | None:
    """The command's flag or the config key (`--set section.key=...`) a mistyped flag most resembles."""
    import difflib

    from aura_hpc.config.loading import valid_keys

    keys = {k.split(".")[-1]: k for k in valid_keys() if "." in k}
    name = flag.removeprefix("--").replace("-", "_")
    scored = [(difflib.SequenceMatcher(None, flag, f).ratio(), f"did you mean {f}?") for f in flags]
    scored += [(difflib.SequenceMatcher(None, name, k).ratio(), f"did you mean --set {full}={value or '...'}?") for k, full in keys.items()]
    best = max(scored, default=(0.0, ""))
    return best[1] if best[0] >= 0.75 else None


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
