"""The docs build CI checks: README.md and docs/*.md stay short where they must, every relative link
resolves, the config reference is the one the code generates, every `python -m aura_hpc` command
in a code block is one the real command line accepts, and the blocks marked plain `bash` (runnable
on any machine) run: with --dry-run where the command has it. Blocks marked `bash lan`, `bash
cluster`, `bash gpu` or `bash yours` need two machines, a Slurm cluster, a GPU, or your own files."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)(?:[ \t]+(\w+))?\s*$")


def _blocks(page: Path) -> list[tuple[str, str, list[str]]]:
    """(language, marker, lines) of each fenced block."""
    out, current = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and current is None:
            current = (m.group(2), m.group(3) or "", [])
        elif m and current is not None and not m.group(2):
            out.append(current)
            current = None
        elif current is not None:
            current[2].append(line.strip())
    return out


def _commands(lines: list[str]) -> list[str]:
    """Shell commands of a block: continuations joined, comments dropped."""
    cmds, buf = [], ""
    for line in lines:
        buf += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        cmd = buf.split(" #")[0].strip() if not buf.startswith("#") else ""
        buf = ""
        if cmd:
            cmds.append(cmd)
    return cmds


def _aura_args(cmd: str) -> list[str] | None:
    """The arguments after `python -m aura_hpc` (after env assignments, `docker compose run ... trainer`)."""
    words = shlex.split(cmd.replace("$USER", "you").replace("$(id -u)", "1000"))
    if "aura_hpc" in words and words[words.index("aura_hpc") - 1] == "-m":
        return words[words.index("aura_hpc") + 1 :]
    if words[:2] == ["docker", "compose"] and "trainer" in words:
        return words[words.index("trainer") + 1 :]
    return None


def test_the_readme_is_short_and_every_page_is_linked_from_somewhere() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= 200, readme.count("\n")
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", readme)) | set(
        re.findall(r"\]\(([\w.-]+\.md)", (REPO / "docs" / "README.md").read_text())
    )
    assert {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name}: {target}"


def test_the_config_reference_is_the_generated_one() -> None:
    from aura_hpc.config.reference import markdown

    assert (REPO / "docs" / "config.md").read_text(encoding="utf-8") == markdown(), (
        "run: python -m aura_hpc config --markdown > docs/config.md"
    )


def test_every_documented_command_parses() -> None:
    from aura_hpc.cli import build_parser

    parser = build_parser()
    seen = 0
    for page in PAGES:
        for lang, marker, lines in _blocks(page):
            if lang != "bash":
                continue
            for cmd in _commands(lines):
                args = _aura_args(cmd)
                if args is None:
                    continue
                seen += 1
                try:
                    _, unknown = parser.parse_known_args(args)
                except SystemExit:
                    pytest.fail(f"{page.name} ({marker or 'bash'}): `{cmd}` does not parse")
                assert not unknown, f"{page.name}: `{cmd}`: unknown {unknown}"
    assert seen >= 25, seen


def test_the_plain_bash_blocks_run_here(tmp_path: Path) -> None:
    """What a reader can run on any machine runs (with --dry-run where the command has it)."""
    ran = []
    for page in PAGES:
        for lang, marker, lines in _blocks(page):
            if lang != "bash" or marker:
                continue
            for cmd in _commands(lines):
                args = _aura_args(cmd)
                assert args is not None, f"{page.name}: a plain bash block holds `{cmd}`; mark it (lan, cluster, gpu, yours)"
                if args[0] in ("local", "submit") and "--dry-run" not in args:
                    args.append("--dry-run")
                r = subprocess.run(
                    [sys.executable, "-m", "aura_hpc", *args],
                    cwd=tmp_path,
                    env=cli_env(USER="you"),
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                # The shipped configs' data is the docs' `prepare` output, not made here: a dry run exits 2 where the run
                # would refuse, and the one refusal allowed is that data missing.
                missing = re.search(r"would refuse this: data\.path \S+ does not exist", r.stderr)
                assert r.returncode == 0 or (r.returncode == 2 and missing), (
                    f"{page.name}: `{cmd}` exited {r.returncode}: {r.stderr[-800:]}"
                )
                ran.append(args[0])
    assert {"local", "submit", "check"} <= set(ran), ran


def test_every_cluster_profile_and_config_we_ship_is_named_in_the_docs() -> None:
    """docs/slurm.md listed 3 of the 4 profiles, docs/local.md left out gpt2-3b."""
    slurm = (REPO / "docs" / "slurm.md").read_text(encoding="utf-8")
    local = (REPO / "docs" / "local.md").read_text(encoding="utf-8")
    profiles = [p.name for p in (REPO / "sbatch_templates").glob("*.sh")]
    configs = [p.stem for p in (REPO / "configs").glob("*.yaml")]
    assert profiles and configs
    assert [p for p in profiles if f"`{p}`" not in slurm] == []
    assert [c for c in configs if f"`{c}`" not in local] == []


def test_the_install_path_upgrades_pip_first_and_installs_extras_in_one_command() -> None:
    """A fresh venv's pip sat 21 min in the resolver on the extras; extras installed in two commands left
    an incompatible botocore; an unreachable PyTorch index was retried for minutes."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("## Install") :].split("```bash yours\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    pip = [i for i, c in enumerate(commands) if "pip install" in c]
    assert "--upgrade pip" in commands[pip[0]], commands
    assert all("--retries" in c and "--timeout" in c for c in commands if "--index-url" in c), commands
    assert any('-e ".[s3,tracking]"' in c for c in commands), commands
