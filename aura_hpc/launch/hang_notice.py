"""A declared hang told to the operator's webhook (`health.webhook_url`), after the kill: a slow webhook never delays
the restart."""

from __future__ import annotations

import os
from typing import Any

from aura_hpc.train.process.dist_env import node_name


def notify(watch: Any, hang: Any) -> None:
    """The `training.hang` event to health.webhook_url, when one is set (after the kill: a slow
    webhook never delays the restart)."""
    from aura_hpc.ops import webhook

    h = watch.cfg.health
    url = webhook.resolve_url(h.webhook_url, h.webhook_url_env, h.webhook_url_file)
    if url:
        event = {
            "event": "training.hang",
            "host": node_name(),
            "line": hang.line,
            "culprits": hang.culprits,
            "step": hang.progress_step,
            "run_dir": str(watch.cfg.run_dir),
            "evidence": str(hang.folder) if hang.folder != watch.folder else None,  # none kept
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
        }
        webhook.deliver(url, h.webhook_type, event, h.webhook_timeout_s, h.webhook_retries)
