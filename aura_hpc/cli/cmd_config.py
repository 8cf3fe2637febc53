"""`config`: the resolved config of a run (what `local`/`submit` would use), every key, the presets."""

from __future__ import annotations

import argparse


def cmd_config(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.config import load_config, shipped_configs

    if a.list:
        rows = []
        for name, path in shipped_configs().items():
            rows.append([name, preset_summary(path.read_text(encoding="utf-8"), name)])
        console.grid("shipped configs (--config NAME)", ["name", "what"], rows)
        return 0
    if a.keys:
        from aura_hpc.config.reference import keys

        rows = [[k.key, k.type, k.default, k.allowed, k.meaning] for k in keys()]
        console.grid("config keys (--set SECTION.KEY=VALUE)", ["key", "type", "default", "allowed", "meaning"], rows)
        return 0
    if a.markdown:
        from aura_hpc.config.reference import markdown

        console.plain(markdown().rstrip())
        return 0
    cfg = load_config(_config_named(a), a.overrides, a.output_dir, a.run_name)
    console.plain(cfg.to_yaml().rstrip())  # as stored in the run directory: secrets redacted
    return 0


def _config_named(a: argparse.Namespace) -> str | None:
    """`config gpt2-small` as `config --config gpt2-small`, and `config RUN_DIR` as the config that run stored."""
    from pathlib import Path

    from aura_hpc.errors import ConfigError

    if a.what is None:
        return a.config
    if a.config is not None and a.config != a.what:
        raise ConfigError(f"two configs given, {a.what} and --config {a.config} (fix: name one: python -m aura_hpc config {a.what})")
    folder = Path(a.what).expanduser()
    if not folder.is_dir():
        return a.what  # a preset or a YAML file: load_config says which it is not
    from aura_hpc.launch.run_status import local_config

    # A local run's (on a LAN node other than 0, config.nodeN.yaml), or a Slurm run's config.yaml beside its job.json.
    stored = local_config(folder) or folder / "config.yaml"
    if not stored.is_file():
        raise ConfigError(
            f"{folder} holds no config.yaml (fix: a run directory local or submit made, a preset (config --list) or a YAML file)"
        )
    return str(stored)


def preset_summary(text: str, name: str) -> str:
    """The preset's leading comment, whole (its first sentence or two lines, not cut mid-sentence)."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("# ").strip())
    joined = " ".join(comment).removeprefix(f"{name}:").strip()
    first = joined.split(". ")[0].rstrip(".")
    return first + "."


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from aura_hpc.cli.common import add_run_options

    p = sub.add_parser(
        "config",
        help="show the resolved config, every config key, or the shipped presets",
        description="Print the config a run would use (defaults <- preset <- file <- --set), as stored in its run directory.",
    )
    add_run_options(p)
    p.add_argument("what", nargs="?", help="a preset, a YAML file or a run directory (its stored config), as --config takes")
    p.add_argument("--keys", action="store_true", help="list every config key with its type, default and allowed values")
    p.add_argument("--list", action="store_true", help="list the shipped presets")
    p.add_argument("--markdown", action="store_true", help="print the config reference as Markdown (docs/config.md)")
    p.set_defaults(func=cmd_config)
