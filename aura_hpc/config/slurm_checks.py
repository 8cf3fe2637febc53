"""Checks of the slurm section: what `submit` may ask Slurm for, each refusal one line with its fix."""

from __future__ import annotations

import re

from aura_hpc.config.tree import SlurmConfig
from aura_hpc.errors import ConfigError, shown

# A GPU job without slurm.cpus_per_task: Slurm's default is one CPU per task, so each rank's data loading, NCCL's helper
# thread and its compile workers share one core (OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK is then 1).
ONE_CPU_PER_RANK = (
    "slurm.cpus_per_task is unset: Slurm gives each rank one CPU, shared by its data loading and NCCL's helper thread "
    "(fix: --set slurm.cpus_per_task=N, the node's CPUs divided by its GPUs, or #SBATCH --cpus-per-task=N in the cluster profile)"
)

_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_minutes(value: str) -> int:
    """Slurm's --time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) to whole minutes, rounded up."""
    m = _SLURM_TIME.match(value.strip())
    if not m:
        raise ConfigError(f"slurm.time {shown(value)} is not a Slurm time (fix: --time 04:00:00, or minutes like --time 240)")
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    assert a is not None
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + (b or 0) * 60 + c
    elif b is not None:  # M:S
        seconds = a * 60 + b
    else:  # minutes
        seconds = a * 60
    return -(-seconds // 60)


def validate_slurm(s: SlurmConfig) -> None:
    if s.nodes < 1:
        raise ConfigError(f"slurm.nodes must be at least 1, got {s.nodes} (fix: --set slurm.nodes=1, or submit's --nodes 1)")
    if s.min_nodes < 0 or s.min_nodes > s.nodes:
        raise ConfigError(
            f"slurm.min_nodes ({s.min_nodes}) must be between 1 and slurm.nodes ({s.nodes}), or 0 for exactly slurm.nodes "
            f"(fix: --nodes {max(1, min(s.min_nodes, s.nodes))}:{max(s.nodes, s.min_nodes)})"
        )
    if s.gpus_per_node < 0:
        raise ConfigError(
            f"slurm.gpus_per_node must be 0 (CPU job) or more, got {s.gpus_per_node} "
            "(fix: --set slurm.gpus_per_node=8, or submit's --gpus 8)"
        )
    if s.gpu_type and not re.fullmatch(r"[A-Za-z0-9_.-]+", s.gpu_type):
        raise ConfigError(
            f"slurm.gpu_type {shown(s.gpu_type)} is not a GPU type of Slurm's gres (fix: --gpus h100:8, or --set slurm.gpu_type=h100)"
        )
    if s.cpus_per_task < 0:
        raise ConfigError(
            f"slurm.cpus_per_task must be 0 (Slurm's default) or more, got {s.cpus_per_task} (fix: --set slurm.cpus_per_task=8)"
        )
    minutes = slurm_minutes(s.time)
    if minutes < 1:
        raise ConfigError(f"slurm.time {shown(s.time)} is zero (fix: --time 01:00:00)")
    if s.signal_lead_s < 0 or s.signal_lead_s >= minutes * 60:
        raise ConfigError(
            f"slurm.signal_lead_s ({s.signal_lead_s}) must be between 0 and the time limit ({minutes * 60}s) "
            f"(fix: --set slurm.signal_lead_s={min(120, minutes * 60 // 10)}, or a --time over {-(-max(0, s.signal_lead_s) // 60)} minutes)"
        )
    if s.max_requeues < 0:
        raise ConfigError(f"slurm.max_requeues must be 0 or more, got {s.max_requeues} (fix: --set slurm.max_requeues=10)")
    if s.array_parallelism < 0:
        raise ConfigError(f"slurm.array_parallelism must be 0 (all) or more, got {s.array_parallelism} (fix: --array-parallelism 4)")
    if s.mem and not re.match(r"^\d+[KMGT]?B?$", s.mem, re.IGNORECASE):
        raise ConfigError(f"slurm.mem {shown(s.mem)} is not a Slurm memory size (fix: --mem 64G, or --mem 0 for all of a node's memory)")
    if s.mem.isdigit() and 0 < int(s.mem) < 1024:  # Slurm reads a bare number as megabytes: --mem 64 is 64 MB
        raise ConfigError(f"slurm.mem {s.mem} is {s.mem} megabytes to Slurm (fix: --mem {s.mem}G, or --mem {s.mem}M if you meant it)")
