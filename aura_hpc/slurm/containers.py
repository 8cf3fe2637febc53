"""Slurm jobs in containers: Pyxis/Enroot flags on the srun line, or an `apptainer exec` wrapper
around the job's Python. Chosen by `slurm.container` (a profile sets it with `#AURA container=...`).

Either way the job runs the same `python -m submitit.core._submit FOLDER` inside the image, which
must hold aura_hpc (the repository's Dockerfile builds one). The run directory, the submitit
folder and the prepared data are written into the script as host paths, so they must be mounted
at the same path inside: that is checked here, before anything is submitted.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from aura_hpc.config import SlurmConfig
from aura_hpc.errors import ConfigError

# Characters a container value may hold: it lands on the srun line or in the job's command.
_SAFE = re.compile(r"^[A-Za-z0-9._/:#@,+=~-]+$")
_URI = ("docker://", "docker-daemon://", "oras://", "library://", "shub://", "http://", "https://")


@dataclass
class Mount:
    source: str
    target: str
    flags: str = ""


@dataclass
class ContainerPlan:
    runtime: str  # pyxis | apptainer
    image: str
    mounts: list[Mount] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)  # pyxis: added to the srun line
    wrapper: list[str] = field(default_factory=list)  # apptainer: the words before `python`
    python: str = "python3"

    def python_command(self) -> str:
        """What runs Python in the job (submitit's `python`): inside the image."""
        return shlex.join([*self.wrapper, self.python])


def parse_mounts(text: str) -> list[Mount]:
    mounts = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) == 1:
            parts = [parts[0], parts[0]]
        if len(parts) > 3 or not all(parts[:2]) or not parts[0].startswith("/") or not parts[1].startswith("/"):
            raise ConfigError(
                f"slurm.container_mounts item {item!r} is not /host/path[:/container/path[:ro]] "
                "(fix: e.g. --container-mounts /shared:/shared,/data:/data:ro)"
            )
        mounts.append(Mount(parts[0], parts[1], parts[2] if len(parts) == 3 else ""))
    return mounts


def _covered(path: str, mounts: list[Mount]) -> Mount | None:
    p = os.path.normpath(path)
    for m in mounts:
        src = os.path.normpath(m.source)
        if p == src or p.startswith(src.rstrip("/") + "/"):
            return m
    return None


def _require_mounted(what: str, path: str, mounts: list[Mount], writable: bool) -> None:
    m = _covered(path, mounts)
    if m is None:
        raise ConfigError(
            f"{what} {path} is not in slurm.container_mounts, so the job inside the container would not find it "
            f"(fix: add {path}:{path} to --container-mounts, or mount a folder above it at the same path)"
        )
    if os.path.normpath(m.source) != os.path.normpath(m.target):
        raise ConfigError(
            f"{what} {path} is mounted at another path inside the container ({m.source} -> {m.target}); the job script names "
            f"host paths (fix: mount it at the same path, {m.source}:{m.source})"
        )
    if writable and "ro" in m.flags.split("+"):
        raise ConfigError(f"{what} {path} is mounted read-only ({m.source}:{m.target}:{m.flags}) (fix: drop ':ro' from that mount)")


def plan_container(s: SlurmConfig, output_dir: str, data_path: str, gpus: bool) -> ContainerPlan | None:
    """The container part of a job, checked; None when the job runs on the nodes' own Python."""
    if s.container == "none":
        if s.container_image:
            raise ConfigError("slurm.container_image is set but slurm.container is none (fix: --container pyxis or apptainer)")
        return None
    if not s.container_image:
        raise ConfigError(
            f"slurm.container is {s.container} but no image is given (fix: --container-image "
            + ("nvcr.io#nvidia/pytorch:24.05-py3 or /shared/images/aura.sqsh)" if s.container == "pyxis" else "/shared/images/aura.sif)")
        )
    for key in ("container_image", "container_mounts", "container_workdir", "container_python"):
        value = getattr(s, key)
        if value and not _SAFE.match(value):
            raise ConfigError(f"slurm.{key} {value!r} holds spaces or shell characters (fix: a plain path or image name)")
    mounts = parse_mounts(s.container_mounts)
    needed = [("output_dir", output_dir, True)] + ([("data.path", data_path, False)] if data_path and "://" not in data_path else [])
    missing = [(what, path) for what, path, _ in needed if _covered(path, mounts) is None]
    # A path inside another missing one is found once that one is mounted: only the outer one is named.
    missing = [(w, p) for w, p in missing if not any(q != p and _covered(p, [Mount(q, q, "")]) for _, q in missing)]
    if len(missing) > 1:  # every missing mount in one line: one fix, not one re-run per mount
        names = " and ".join(f"{what} {path}" for what, path in missing)
        add = ",".join(f"{path}:{path}" for _, path in missing)
        raise ConfigError(
            f"{names} are not in slurm.container_mounts, so the job inside the container would not find them "
            f"(fix: add {add} to --container-mounts, or mount a folder above them at the same path)"
        )
    for what, path, writable in needed:
        _require_mounted(what, path, mounts, writable)
    image = s.container_image
    if image.startswith("~"):  # the script quotes it: no shell would expand `~` there
        image = str(Path(image).expanduser())
    if s.container == "apptainer":
        if not image.startswith(_URI) and not Path(image).expanduser().is_file():
            raise ConfigError(
                f"apptainer image {image} does not exist (fix: build it with `apptainer build aura.sif docker-daemon://aura-hpc:latest` "
                "on a shared path, or give a docker:// or oras:// URI)"
            )
        wrapper = ["apptainer", "exec", *(["--nv"] if gpus else [])]
        if mounts:
            wrapper += ["--bind", ",".join(":".join(x for x in (m.source, m.target, m.flags) if x) for m in mounts)]
        if s.container_workdir:
            wrapper += ["--pwd", s.container_workdir]
        return ContainerPlan("apptainer", image, mounts, wrapper=[*wrapper, image], python=s.container_python)
    if image.startswith(("/", "./", "~")) and not Path(image).expanduser().is_file():
        raise ConfigError(
            f"pyxis image file {image} does not exist (fix: `enroot import -o {image} docker://REGISTRY#IMAGE`, or give a registry "
            "image such as nvcr.io#nvidia/pytorch:24.05-py3)"
        )
    args = [f"--container-image={image}"]
    if mounts:
        args.append("--container-mounts=" + ",".join(":".join(x for x in (m.source, m.target, m.flags) if x) for m in mounts))
    args.append(f"--container-workdir={s.container_workdir or output_dir}")
    return ContainerPlan("pyxis", image, mounts, srun_args=args, python=s.container_python)
