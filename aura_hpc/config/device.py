"""What the device and the torch of a run can do, refused before launch (by the launch plans, which know both)."""

from __future__ import annotations

import re

from aura_hpc.config.tree import RunConfig
from aura_hpc.errors import ConfigError


def release(torch_version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.13.0+cpu", "2.8.0a0+git1234" alike)."""
    major, minor = (int(x) for x in re.findall(r"\d+", torch_version)[:2])
    return major, minor


def fsdp_on_cpu(torch_version: str) -> None:
    """torch 2.6's FSDP2 fails at the first forward on CPU: it records events on the CPU's stream,
    which has none before 2.7 (torch.cpu.Stream.record_event)."""
    if release(torch_version) < (2, 7):
        raise ConfigError(
            f"dist.strategy=fsdp on CPU needs torch 2.7 or newer, this is torch {torch_version} (its FSDP2 records stream "
            "events a CPU stream does not have) (fix: --set dist.strategy=ddp or zero2, or a newer torch)"
        )


def validate_for_device(cfg: RunConfig, gpu: bool, torch_version: str | None = None) -> None:
    """What needs GPUs, refused for a CPU run (called by the launch plans, which know the device;
    `local` knows the torch its workers will run, a Slurm job's image may hold another)."""
    if cfg.dist.strategy == "fsdp" and not gpu and torch_version:
        fsdp_on_cpu(torch_version)
    if cfg.dist.fsdp_cpu_offload and not gpu:
        raise ConfigError(
            "dist.fsdp_cpu_offload keeps parameters in host memory between uses; a CPU run has them there already "
            "(and torch pins that memory through CUDA) (fix: --set dist.fsdp_cpu_offload=false)"
        )
    if cfg.train.precision == "fp16" and not gpu:
        raise ConfigError("train.precision fp16 needs a CUDA GPU (fix: --set train.precision=auto)")
