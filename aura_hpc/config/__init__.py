"""The one typed config tree: dataclasses loaded from YAML files in configs/, overridden from the CLI.

Deliberately free of torch/transformers imports (and of the rest of the package): the CLI loads
and validates configs before deciding whether any heavy machinery is needed at all.
"""

from aura_hpc.config.checks import check_at_world_size, embedding_rows, fit_to_horizon, max_steps_for, recorded_horizon, validate
from aura_hpc.config.loading import coerce, from_dict, load_config, load_run_file, parse_overrides, resolve_config_path, shipped_configs
from aura_hpc.config.slurm_checks import slurm_minutes, validate_slurm
from aura_hpc.config.tree import (
    CHOICES,
    SECTIONS,
    THROTTLE_REASONS,
    DataConfig,
    DistConfig,
    HealthConfig,
    ModelConfig,
    RunConfig,
    SlurmConfig,
    TrainConfig,
)

__all__ = [
    "CHOICES",
    "SECTIONS",
    "THROTTLE_REASONS",
    "DataConfig",
    "DistConfig",
    "HealthConfig",
    "ModelConfig",
    "RunConfig",
    "SlurmConfig",
    "TrainConfig",
    "check_at_world_size",
    "coerce",
    "embedding_rows",
    "fit_to_horizon",
    "from_dict",
    "load_config",
    "load_run_file",
    "max_steps_for",
    "parse_overrides",
    "recorded_horizon",
    "resolve_config_path",
    "shipped_configs",
    "slurm_minutes",
    "validate",
    "validate_slurm",
]
