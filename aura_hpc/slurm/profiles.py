"""Cluster profiles: plain sbatch-style files in sbatch_templates/ that users read and copy.

A profile holds `#SBATCH` defaults, `#AURA key=value` settings and shell lines (modules,
venv, NCCL exports) that run in the job before the trainer.
"""

from __future__ import annotations

import os
import re
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
RESERVED = {"ntasks", "ntasks-per-node", "output", "error", "array", "signal", "open-mode", "dependency"}
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


# sbatch options that take no value, or one only after "=": a word after them is the next option's, not theirs.
_NO_SEPARATE_VALUE = {
    "exclusive",
    "verbose",
    "quiet",
    "propagate",
    "requeue",
    "no-requeue",
    "hold",
    "overcommit",
    "oversubscribe",
    "contiguous",
    "spread-job",
    "use-min-nodes",
    "nice",
    "parsable",
    "test-only",
    "wait",
    "get-user-env",
    "ignore-pbs",
    "no-kill",
    "reboot",
}
# Per-task or per-job GPU counts: the task layout (one task per GPU of a node) is planned from --gpus-per-node.
_GPU_OTHER_WAYS = {"gpus", "gpus-per-task", "gpus-per-socket", "ntasks-per-gpu"}


def _sbatch_options(text: str, where: str) -> list[tuple[str, str | bool]]:
    """Every option of one #SBATCH line, as sbatch reads them (it reads them all, not just the first)."""
    try:
        parts = shlex.split(text, comments=True)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"{where}: '#SBATCH {text}' cannot be parsed ({exc}) (fix: close the quote, or quote the whole value)") from None
    out: list[tuple[str, str | bool]] = []
    i = 0
    while i < len(parts):
        word = parts[i]
        if not word.startswith("--") or word == "--":
            raise ConfigError(f"{where}: '{word}' in '#SBATCH {text}' is not a long option (fix: write it as #SBATCH --option=value)")
        opt = word[2:]
        if "=" in opt:
            key, value = opt.split("=", 1)
            out.append((key, value))
        elif opt not in _NO_SEPARATE_VALUE and i + 1 < len(parts) and not parts[i + 1].startswith("-"):
            out.append((opt, parts[i + 1]))
            i += 1
        else:
            out.append((opt, True))
        i += 1
    return out


def gpu_request(value: str) -> tuple[str, str] | None:
    """'h100:8' -> ('h100', '8'), '8' -> ('', '8'): a GPU count with its optional type, as --gpus-per-node takes it."""
    m = re.fullmatch(r"(?:([A-Za-z0-9_.-]+):)?(\d+)", value.strip())
    return None if m is None else (m.group(1) or "", m.group(2))


def _gres_gpus(value: str, where: str) -> tuple[tuple[str, str] | None, str]:
    """--gres=gpu[:type]:N[,other...] -> the GPU request, and the other resources to pass on as they are."""
    gpus, others = None, []
    for item in filter(None, value.split(",")):
        name, _, rest = item.partition(":")
        if name != "gpu":
            others.append(item)
            continue
        asked = gpu_request(rest) if rest else ("", "1")
        if asked is None and rest and ":" not in rest and not rest.isdigit():
            asked = (rest, "1")  # gpu:h100 is one GPU of that type
        if asked is None or gpus is not None:
            raise ConfigError(
                f"{where}: #SBATCH --gres={value} is not a GPU request aura_hpc can plan with (fix: write #SBATCH --gpus-per-node=[TYPE:]N)"
            )
        gpus = asked
    return gpus, ",".join(others)


def _take(prof: Profile, key: str, value: str | bool, where: str) -> None:
    if key in RESERVED:
        raise ConfigError(f"{where}: #SBATCH --{key} is set by aura_hpc itself (fix: remove that option from the profile)")
    if key in _GPU_OTHER_WAYS:
        raise ConfigError(
            f"{where}: #SBATCH --{key} is not how aura_hpc asks for GPUs: it starts one task per GPU of each node "
            "(fix: write #SBATCH --gpus-per-node=[TYPE:]N instead)"
        )
    gpus: tuple[str, str] | None = None
    if key == "gres" and isinstance(value, str):
        # Slurm refuses --gres=gpu beside --gpus-per-node, and a GPU count aura_hpc does not see trains on one
        # GPU per node: the GPUs are asked the one way the task layout is planned from.
        gpus, value = _gres_gpus(value, where)
        if not value:
            value = ""
    elif key == "gpus-per-node":
        gpus = gpu_request(value) if isinstance(value, str) else None
        if gpus is None:
            raise ConfigError(
                f"{where}: #SBATCH --gpus-per-node={value} is not a GPU count (fix: write --gpus-per-node=8 or --gpus-per-node=h100:8)"
            )
    if gpus is not None:
        if "gpus_per_node" in prof.values:
            raise ConfigError(f"{where}: the profile asks for GPUs twice (fix: keep one #SBATCH --gpus-per-node=[TYPE:]N line)")
        prof.values["gpu_type"], prof.values["gpus_per_node"] = gpus
    if key == "gpus-per-node" or (key == "gres" and not value):
        return
    if key in SBATCH_TO_KEY:
        prof.values[SBATCH_TO_KEY[key]] = value
    else:
        prof.extra_sbatch[key] = value


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
            for key, value in _sbatch_options(line[len("#SBATCH") :].strip(), where):
                _take(prof, key, value, where)
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
