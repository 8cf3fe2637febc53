"""Options shared by the commands that start a run (`local`, `submit`)."""

from __future__ import annotations

import argparse


def add_run_options(p: argparse.ArgumentParser) -> None:
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
