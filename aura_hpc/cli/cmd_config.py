"""`config`: the resolved config of a run (what `local`/`submit` would use), every key, the presets."""

from __future__ import annotations

import argparse


def cmd_config(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.config import load_config, shipped_configs

    if a.list:
        rows = []
        for name, path in shipped_configs().items():
            first = next((ln.lstrip("# ").strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("#")), "")
            rows.append([name, first.removeprefix(f"{name}:").strip()])
        console.grid("shipped configs (--config NAME)", ["name", "what"], rows)
        return 0
    if a.keys:
        console.grid("config keys (--set SECTION.KEY=VALUE)", ["key", "type", "default", "allowed"], key_rows())
        return 0
    cfg = load_config(a.config, a.overrides, a.output_dir, a.run_name)
    console.plain(cfg.to_yaml().rstrip())  # as stored in the run directory: secrets redacted
    return 0


def key_rows() -> list[list[str]]:
    import dataclasses

    from aura_hpc.config import RunConfig
    from aura_hpc.config.tree import CHOICES, SECTIONS, TOP_LEVEL

    defaults = RunConfig()
    rows = [[k, "str", str(getattr(defaults, k)), ""] for k in TOP_LEVEL]
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            value = getattr(getattr(defaults, name), f.name)
            rows.append([key, str(f.type), repr(value) if value == "" else str(value), ", ".join(CHOICES.get(key, ()))])
    return rows


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from aura_hpc.cli.common import add_run_options

    p = sub.add_parser(
        "config",
        help="show the resolved config, every config key, or the shipped presets",
        description="Print the config a run would use (defaults <- preset <- file <- --set), as stored in its run directory.",
    )
    add_run_options(p)
    p.add_argument("--keys", action="store_true", help="list every config key with its type, default and allowed values")
    p.add_argument("--list", action="store_true", help="list the shipped presets")
    p.set_defaults(func=cmd_config)
