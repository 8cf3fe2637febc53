"""Cluster profiles: plain sbatch-style files in sbatch_templates/ that users read and copy.

A profile holds `#SBATCH` defaults, `#AURA key=value` settings and shell lines (modules,
venv, NCCL exports) that run in the job before the trainer.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from aura_hpc.config.checks import describe_char, line_breaking
from aura_hpc.errors import ConfigError

# #SBATCH option -> slurm.* config key (the ones that have a meaning of their own here).
SBATCH_TO_KEY = {
    "nodes": "nodes",
    "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task",
    "mem": "mem",
    "time": "time",
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "constraint": "constraint",
    "exclude": "exclude",
    "exclusive": "exclusive",
    "job-name": "job_name",
}
# Options aura_hpc decides itself; a profile setting them would break the task layout.
RESERVED = {"ntasks", "ntasks-per-node", "output", "error", "array", "signal", "open-mode", "dependency", "wckey"}
# #AURA keys that set slurm.* values (containers), and the ones that are the profile's own.
CONTAINER_KEYS = {"container", "container_image", "container_mounts", "container_workdir", "container_python"}
# The figures pre-flight screening expects of this hardware (health.screen_*: ops/screen.py).
SCREEN_KEYS = {"screen_gemm_tflops", "screen_allreduce_gbps", "screen_inter_gbps"}
AURA_KEYS = {"output_dir", "max_gpus_per_node", "gpu_mem_gib"} | CONTAINER_KEYS | SCREEN_KEYS


@dataclass
class Profile:
    name: str
    path: Path
    values: dict[str, str | bool] = field(default_factory=dict)  # slurm.* keys
    extra_sbatch: dict[str, str | bool] = field(default_factory=dict)  # other #SBATCH options, passed through
    aura: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)

    @property
    def max_gpus_per_node(self) -> int | None:
        v = self.aura.get("max_gpus_per_node")
        return int(v) if v else None

    @property
    def gpu_mem_gib(self) -> float | None:
        v = self.aura.get("gpu_mem_gib")
        return float(v) if v else None

    @property
    def screen(self) -> dict[str, float]:
        """health.screen_* values this profile expects (only those it states)."""
        return {k: float(v) for k, v in self.aura.items() if k in SCREEN_KEYS}

    @property
    def output_dir(self) -> str | None:
        v = self.aura.get("output_dir")
        return os.path.expanduser(os.path.expandvars(v)) if v else None


def templates_dir() -> Path:
    repo = Path(__file__).resolve().parents[2] / "sbatch_templates"
    if repo.is_dir():
        return repo
    return Path(str(resources.files("aura_hpc.sbatch_templates")))


def shipped_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted(templates_dir().glob("*.sh"))}


def resolve(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.suffix == ".sh" or p.exists():
        if not p.is_file():
            raise ConfigError(f"cluster profile {p} not found (fix: --cluster one of {', '.join(shipped_profiles())}, or a profile file)")
        return p
    shipped = shipped_profiles()
    if name_or_path in shipped:
        return shipped[name_or_path]
    raise ConfigError(
        f"cluster profile '{name_or_path}' is unknown (fix: --cluster one of {', '.join(shipped)}, or a path to a .sh profile)"
    )


def _sbatch_option(text: str, where: str) -> tuple[str, str | bool]:
    try:
        parts = shlex.split(text, comments=True)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"{where}: '#SBATCH {text}' cannot be parsed ({exc}) (fix: close the quote, or quote the whole value)") from None
    if not parts or not parts[0].startswith("--"):
        raise ConfigError(f"{where}: '#SBATCH {text}' is not a long option (fix: write it as #SBATCH --option=value)")
    opt = parts[0][2:]
    if "=" in opt:
        key, value = opt.split("=", 1)
        return key, value
    if len(parts) > 1:
        return opt, parts[1]
    return opt, True


def load(name_or_path: str) -> Profile:
    path = resolve(name_or_path)
    prof = Profile(name=path.stem, path=path)
    # Lines end at "\n" only (bash's rule); str.splitlines would also split at U+2028 or \x85 and
    # show a different script than the one that runs.
    for n, raw in enumerate(path.read_bytes().decode("utf-8").split("\n"), 1):
        raw = raw.removesuffix("\r")
        line = raw.strip()
        where = f"{path}:{n}"
        bad = line_breaking(raw, "\t")
        if bad is not None:
            raise ConfigError(f"{where} contains the character {describe_char(bad)} (fix: remove it from the profile)")
        if line.startswith("#SBATCH"):
            key, value = _sbatch_option(line[len("#SBATCH") :].strip(), where)
            if key in RESERVED:
                raise ConfigError(f"{where}: #SBATCH --{key} is set by aura_hpc itself (fix: remove that line from the profile)")
            if key in SBATCH_TO_KEY:
                prof.values[SBATCH_TO_KEY[key]] = value
            else:
                prof.extra_sbatch[key] = value
        elif line.startswith("#AURA"):
            key, sep, value = line[len("#AURA") :].strip().partition("=")
            key = key.strip()
            if not sep or key not in AURA_KEYS:
                raise ConfigError(f"{where}: '{line}' is not one of #AURA {', #AURA '.join(f'{k}=...' for k in sorted(AURA_KEYS))}")
            if key in CONTAINER_KEYS:
                prof.values[key] = os.path.expandvars(value.strip())
            else:
                prof.aura[key] = value.strip()
        elif line.startswith("#") or not line:
            continue
        else:
            prof.setup.append(raw.rstrip())
    if prof.max_gpus_per_node is not None and prof.max_gpus_per_node < 0:
        raise ConfigError(f"{path}: #AURA max_gpus_per_node must be 0 or more")
    for key in SCREEN_KEYS & prof.aura.keys():
        try:
            if float(prof.aura[key]) < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{path}: #AURA {key} must be a figure of 0 or more, got {prof.aura[key]!r} (fix: e.g. {key}=790)") from None
    return prof
