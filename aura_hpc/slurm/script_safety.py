"""What may reach the generated sbatch script: no character that starts a line or ends a directive.

submitit shell-quotes every value it writes, and sbatch un-quotes `#SBATCH` values itself, so
spaces, quotes, `$()`, backticks, `;`, `&`, `|` and `#` arrive literally (tests/test_slurm.py
submits such names for real). Quoting cannot protect a line break, though: inside a `#SBATCH`
comment a newline starts a shell line of its own and ends sbatch's directive block, silently
dropping the later `--requeue`, `--signal` and `--time`. Such characters are refused, never escaped.
"""

from __future__ import annotations

from typing import Any

from aura_hpc.config.checks import describe_char, line_breaking
from aura_hpc.errors import ConfigError


def check_text(field: str, value: str, fix: str = "remove it") -> None:
    """No line-breaking or invisible character (newline, CR, NUL, U+2028, bidi controls...)."""
    c = line_breaking(value)
    if c is not None:
        raise ConfigError(f"{field} contains the character {describe_char(c)}, which would break the sbatch script (fix: {fix})")


def check_directive(field: str, value: Any) -> None:
    """A value written as `#SBATCH --option=value`."""
    if not isinstance(value, bool) and value is not None:
        check_text(field, str(value))
        _no_backslash(field, str(value))


def _no_backslash(field: str, value: str) -> None:
    # sbatch's #SBATCH parser reads a backslash as an escape even inside quotes: 'exp\\1' became the job name
    # exp1, which `cancel` then took for another job, and a log path lost its backslash.
    if "\\" in value:
        raise ConfigError(f"{field} {value!r} contains a backslash, which sbatch would drop from the #SBATCH line (fix: remove it)")


def check_path(field: str, value: str) -> None:
    """A path that reaches `#SBATCH --output`, an exported variable and the srun line."""
    check_text(field, value, "a path without it")
    _no_backslash(field, value)
    if "%" in value:
        raise ConfigError(
            f"{field} {value!r} contains '%', which Slurm expands in log file names (%j, %t...) so the logs would land "
            "elsewhere (fix: a path without '%')"
        )


def assert_directives_intact(script: str, expected: set[str]) -> None:
    """The script's directives are one unbroken block holding exactly the planned options, once each."""
    lines = script.split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    found = [lines[i][len("#SBATCH") :].strip().split("=", 1)[0].removeprefix("--") for i in at]
    contiguous = bool(at) and at == list(range(at[0], at[0] + len(at)))
    if not contiguous or len(found) != len(set(found)) or set(found) != expected or line_breaking(script.replace("\n", "")):
        raise ConfigError(
            f"the sbatch script's directives differ from the plan ({sorted(set(found) ^ expected)}) "
            "(fix: report this as a bug in aura_hpc; nothing was submitted)"
        )
