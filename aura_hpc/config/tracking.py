"""tracking.*: which experiment trackers, checked before anything starts."""

from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlsplit

from aura_hpc.config.tree import TRACKERS, RunConfig
from aura_hpc.errors import ConfigError

# The module each tracker needs; the extra that installs it.
MODULES = {"trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}


def backends(cfg: RunConfig) -> list[str]:
    return [b.strip() for b in cfg.tracking.backends.split(",") if b.strip()]


def validate_tracking(cfg: RunConfig) -> None:
    t = cfg.tracking
    names = backends(cfg)
    unknown = [b for b in names if b not in TRACKERS]
    if unknown:
        raise ConfigError(f"tracking.backends: unknown {', '.join(unknown)} (fix: a comma list of {', '.join(TRACKERS)})")
    if len(set(names)) != len(names):
        raise ConfigError(f"tracking.backends names a tracker twice: {t.backends} (fix: each once)")
    if not t.project.strip() or any(c in t.project for c in "/\\\0") or len(t.project) > 128:
        raise ConfigError(
            "tracking.project must be a plain name without slashes, 1 to 128 characters (fix: --set tracking.project=aura_hpc)"
        )
    _check_project_for(names, t.project)
    if t.mlflow_uri:
        parts = urlsplit(t.mlflow_uri)
        if parts.scheme not in ("http", "https", "sqlite", "file"):
            raise ConfigError(
                "tracking.mlflow_uri must be an http(s):// server or a sqlite:/// store "
                "(fix: leave it empty for RUN_DIR/tracking/mlflow.db)"
            )
        if parts.scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):  # MLflow's own words
            # Accepted here, MLflow refused it in the run (its file store is in maintenance mode): no tracker, one warning.
            raise ConfigError(
                "tracking.mlflow_uri is a file: store, which MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true "
                "(fix: leave it empty for RUN_DIR/tracking/mlflow.db, or export MLFLOW_ALLOW_FILE_STORE=true)"
            )
        if parts.username or parts.password or (parts.scheme in ("http", "https") and (parts.query or parts.fragment)):
            raise ConfigError(
                "tracking.mlflow_uri holds a user name, password or query (a token?), which would be stored in config.yaml "
                "(fix: the plain URL, and MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME / _PASSWORD in the environment)"
            )
    if t.copy_every_s <= 0:
        raise ConfigError(f"tracking.copy_every_s must be above 0, got {t.copy_every_s} (fix: --set tracking.copy_every_s=60)")
    if t.queue_rows < 1:
        raise ConfigError(f"tracking.queue_rows must be 1 or more, got {t.queue_rows} (fix: --set tracking.queue_rows=1000)")
    if not 0 <= t.finish_wait_s < float("inf"):
        raise ConfigError(f"tracking.finish_wait_s must be 0 or more seconds, got {t.finish_wait_s} (fix: --set tracking.finish_wait_s=30)")


def missing_packages(cfg: RunConfig) -> list[str]:
    """Trackers asked for whose package is not installed here (checked where the trainer runs, before it starts)."""
    return [b for b in backends(cfg) if b in MODULES and importlib.util.find_spec(MODULES[b]) is None]


def require_installed(cfg: RunConfig) -> None:
    missing = missing_packages(cfg)
    if missing:
        raise ConfigError(
            f"tracking.backends asks for {', '.join(missing)}, not installed here (fix: pip install 'aura_hpc[tracking]', "
            f"or drop {', '.join(missing)} from tracking.backends)"
        )


def _check_project_for(names: list[str], project: str) -> None:
    """The project names each tracker refuses in its own start, where the refusal switched the tracker off for the
    whole run with one warning (W&B 0.31's and trackio 0.43's rules)."""
    refused = "".join(sorted({c for c in "#?%:" if c in project}))
    if "wandb" in names and refused:
        raise ConfigError(
            f"tracking.project {project!r} holds {refused!r}, which W&B refuses in a project name "
            f"(fix: --set tracking.project={''.join(c for c in project if c not in '#?%:') or 'aura_hpc'})"
        )
    # trackio's file name for the project: letters, digits, - and _ (its reserved names are judged on it).
    on_disk = "".join(c for c in project if c.isalnum() or c in "-_").rstrip()
    suffix = next((s for s in TRACKIO_RESERVED_SUFFIXES if len(on_disk) > len(s) and on_disk.endswith(s)), None)
    if "trackio" in names and (on_disk.startswith("registry-") or suffix):
        why = f"ends with {suffix!r}" if suffix else "begins with 'registry-'"
        raise ConfigError(
            f"tracking.project {project!r} {why}, which trackio keeps for its own files (fix: another --set tracking.project)"
        )


# trackio's per-project side files (SQLiteStorage.validate_project_name): a project ending so is refused by its start.
TRACKIO_RESERVED_SUFFIXES = (
    "_system",
    "_configs",
    "_traces",
    "_artifacts",
    "_artifact_versions",
    "_artifact_aliases",
    "_run_artifact_links",
    "_external_run_artifact_links",
)
