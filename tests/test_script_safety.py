"""Nothing a user types becomes a line of the sbatch script: hostile strings in every field.

Each string is either refused with a one-line error, or it reaches the script as an inert,
quoted value with the directive block intact — checked on the plan (`submit --dry-run`) and by
a real `sbatch --test-only` on the test cluster.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from aura_hpc.config import SECTIONS
from aura_hpc.errors import AuraError, ConfigError
from aura_hpc.slurm.plan import SubmitPlan, plan_submit

PWNED = Path("/tmp/aura-pwned")
HOSTILE = {
    "newline": "\n",
    "carriage return": "\r",
    "NUL": "\0",
    "unicode line separator": "\u2028",
    "next line": "\x85",
    "bidi override": "\u202e",
    "command substitution": "$(touch /tmp/aura-pwned)",
    "backticks": "`touch /tmp/aura-pwned`",
    "single quote": "'",
    "double quote": '"',
    "semicolon": ";",
    "ampersand": "&",
    "pipe": "|",
    "hash": "#",
    "backslash": "\\",
}
BREAKING = {"newline", "carriage return", "NUL", "unicode line separator", "next line", "bidi override"}
# The options a training job's script must always carry; a line break in a value would drop them.
REQUIRED = {"requeue", "signal", "time", "output", "error", "open-mode", "job-name", "nodes", "ntasks-per-node"}
FLAG_FIELDS = ["partition", "account", "qos", "constraint", "job_name", "mem", "time"]
STRING_KEYS = [
    f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.type in ("str", str) and name != "slurm"
]


def _payload(kind: str) -> str:
    return f"x{HOSTILE[kind]}touch /tmp/aura-pwned #"


def _directives(script: str) -> list[str]:
    return [line.split("=", 1)[0].removeprefix("#SBATCH --").strip() for line in script.split("\n") if line.startswith("#SBATCH")]


def _assert_inert(plan: SubmitPlan, payload: str) -> None:
    script = plan.script
    found = _directives(script)
    assert set(found) >= REQUIRED and len(found) == len(set(found)), found
    block = [i for i, line in enumerate(script.split("\n")) if line.startswith("#SBATCH")]
    assert block == list(range(block[0], block[0] + len(block))), "the directive block was split"
    assert not any(line.lstrip().startswith("touch") for line in script.splitlines()), script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # The value is quoted where it appears, never a word of its own.
    for line in script.splitlines():
        if "touch /tmp/aura-pwned" in line and not line.startswith("#"):
            assert "'" in line, line


def _outcome(call) -> SubmitPlan | None:  # type: ignore[no-untyped-def]
    try:
        return call()
    except AuraError as exc:
        assert "\n" not in str(exc) and "(fix:" in str(exc), str(exc)
        return None


def _yaml_file(tmp_path: Path, key: str, value: str) -> str:
    section, _, name = key.partition(".")
    path = tmp_path / "hostile.yaml"
    path.write_text(json.dumps({section: {name: value}}), encoding="utf-8")  # JSON is YAML: escapes kept exactly
    return str(path)


def _plans_for_every_field(tmp_path: Path) -> list[tuple[str, str, SubmitPlan | None]]:
    out = str(tmp_path / "runs")
    results = []
    for kind in HOSTILE:
        payload = _payload(kind)
        for flag in FLAG_FIELDS:
            results.append((f"--{flag}", kind, _outcome(lambda f=flag, p=payload: plan_submit(None, [], out, None, {f: p}))))
        for key in [f"slurm.{f}" for f in FLAG_FIELDS] + STRING_KEYS:
            cfg = _yaml_file(tmp_path, key, payload)
            results.append((key, kind, _outcome(lambda c=cfg: plan_submit(c, [], out, None, {}))))
        hostile_dir = str(tmp_path / f"o{HOSTILE[kind]}touch /tmp/aura-pwned #")
        results.append(("--output-dir", kind, _outcome(lambda d=hostile_dir: plan_submit(None, [], d, None, {}))))
        results.append(("--run-name", kind, _outcome(lambda p=payload: plan_submit(None, [], out, p, {}))))
        if kind == "newline":
            continue  # a newline in a profile file starts a line of the profile: its shell lines run by design
        profile = tmp_path / f"hostile-{len(results)}.sh"
        profile.write_text(f"#SBATCH --mail-user={payload}\n", encoding="utf-8")
        results.append(("profile #SBATCH", kind, _outcome(lambda p=profile: plan_submit(None, [], out, None, {"cluster": str(p)}))))
        profile = tmp_path / f"hostile-{len(results)}.sh"
        profile.write_text(f"#AURA output_dir={hostile_dir}\n", encoding="utf-8")
        results.append(
            ("profile #AURA output_dir", kind, _outcome(lambda p=profile: plan_submit(None, [], None, None, {"cluster": str(p)})))
        )
    return results


def test_hostile_strings_in_every_field_are_refused_or_inert(tmp_path: Path) -> None:
    results = _plans_for_every_field(tmp_path)
    assert len(results) > 300
    for where, kind, plan in results:
        if kind in BREAKING and not (where == "train.sample_prompt" and kind == "newline"):
            assert plan is None, f"{where} accepted a {kind}"
        if plan is not None:
            _assert_inert(plan, _payload(kind))
    accepted = {(w, k) for w, k, p in results if p is not None}
    # The harmless ones stay usable: quotes, '$()' and '&' in a job name reach Slurm literally.
    assert ("--job_name", "command substitution") in accepted and ("--constraint", "ampersand") in accepted
    assert not PWNED.exists()


def test_one_line_refusals_name_the_character(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"slurm\.constraint contains the character '\\n' \(U\+000A line feed\)"):
        plan_submit(_yaml_file(tmp_path, "slurm.constraint", "c\ntouch X #"), [], str(tmp_path), None, {})
    with pytest.raises(ConfigError, match=r"U\+2028 line separator"):
        plan_submit(None, [], str(tmp_path / "o\u2028x"), None, {})
    with pytest.raises(ConfigError, match=r"contains '%', which Slurm expands"):
        plan_submit(None, [], str(tmp_path / "100%"), None, {})
    # sbatch drops a backslash from an #SBATCH value even inside quotes (job name 'exp\\1 lr' ran as 'exp1 lr':
    # `cancel` then took the job for another one); refused, never sent changed.
    with pytest.raises(ConfigError, match=r"slurm\.job_name 'exp\\\\1' contains a backslash, which sbatch would drop .*\(fix: remove it\)"):
        plan_submit(_yaml_file(tmp_path, "slurm.job_name", "exp\\1"), [], str(tmp_path), None, {})
    with pytest.raises(ConfigError, match=r"contains a backslash"):
        plan_submit(None, [], str(tmp_path / "a\\b"), None, {})


def test_a_prompt_may_hold_newlines(tmp_path: Path) -> None:
    plan = plan_submit(_yaml_file(tmp_path, "train.sample_prompt", "Capítulo I\n\tEn un lugar"), [], str(tmp_path), None, {})
    assert plan.points[0].cfg.train.sample_prompt == "Capítulo I\n\tEn un lugar"


def test_real_sbatch_accepts_the_inert_scripts_with_their_directives(slurm_cluster: Path, tmp_path: Path) -> None:
    from aura_hpc.slurm import query

    scripts = {p.script for _, _, p in _plans_for_every_field(tmp_path) if p is not None}
    assert len(scripts) > 20
    for script in scripts:
        try:
            query.test_only(script)  # Slurm parses every directive; nothing is queued
        except AuraError as exc:
            # Slurm refusing a value (an unknown partition, a bad mail address) is fine: one line.
            assert "\n" not in str(exc), str(exc)
    assert not PWNED.exists()
