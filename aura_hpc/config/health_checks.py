"""The health section's cross-field checks: resource monitor, circuit breaker, hang watchdog, screening, webhook."""

from __future__ import annotations

import re

from aura_hpc.config.tree import REDACTED, THROTTLE_REASONS, WEBHOOK_SECRET_ENV, HealthConfig
from aura_hpc.errors import ConfigError, shown


def validate_health(h: HealthConfig) -> None:
    if h.monitor_interval_s < 0:
        raise ConfigError(
            f"health.monitor_interval_s must be 0 (off) or more, got {h.monitor_interval_s} (fix: --set health.monitor_interval_s=10)"
        )
    if h.breaker_interval_s <= 0:
        raise ConfigError(f"health.breaker_interval_s must be above 0, got {h.breaker_interval_s} (fix: --set health.breaker_interval_s=5)")
    if not 0 <= h.temp_margin_c <= 20 or h.throttle_samples < 1:
        # A margin of 30 C (for 3.0) opened the breaker on every healthy GPU: exit 76, "drain the node".
        raise ConfigError(
            f"health.temp_margin_c must be between 0 and 20 C and health.throttle_samples at least 1, got {h.temp_margin_c:g} and "
            f"{h.throttle_samples} (fix: --set health.temp_margin_c=3 --set health.throttle_samples=3)"
        )
    if min(h.hang_step_floor_s, h.hang_section_floor_s, h.hang_startup_s) <= 0 or h.hang_restarts < 0:
        raise ConfigError(
            "health.hang_step_floor_s, hang_section_floor_s and hang_startup_s must be > 0 and hang_restarts >= 0 "
            "(fix: --set health.hang_watch=false to turn the watchdog off instead)"
        )
    if min(h.screen_gemm_tflops, h.screen_allreduce_gbps, h.screen_inter_gbps) < 0 or not 0 < h.screen_min_fraction <= 1:
        raise ConfigError(
            "health.screen_gemm_tflops, screen_allreduce_gbps and screen_inter_gbps must be 0 (not judged) or more, and "
            "health.screen_min_fraction between 0 and 1 (fix: --set health.screen_min_fraction=0.8)"
        )
    if not 0 < h.screen_peer_fraction <= 1:
        raise ConfigError(
            f"health.screen_peer_fraction must be between 0 and 1, not {h.screen_peer_fraction:g} "
            "(fix: --set health.screen_peer_fraction=0.75; lower where the nodes share their CPUs with other jobs)"
        )
    unknown = [r for r in h.throttle_reasons.split(",") if r.strip() and r.strip() not in THROTTLE_REASONS]
    if unknown:
        raise ConfigError(f"health.throttle_reasons: unknown {', '.join(unknown)} (fix: a comma list of {', '.join(THROTTLE_REASONS)})")
    if h.webhook_url and not (h.webhook_url.startswith(("http://", "https://", "env:"))):
        # The value itself is not echoed: it is a secret.
        raise ConfigError(
            "health.webhook_url must start with http://, https:// or env:VAR (fix: --set health.webhook_url_env=AURA_GPU_WEBHOOK)"
        )
    if not 0 < h.webhook_timeout_s <= 120 or not 0 <= h.webhook_retries <= 10:
        raise ConfigError(
            f"health.webhook_timeout_s must be in (0, 120] and health.webhook_retries in 0..10, not {h.webhook_timeout_s:g} and "
            f"{h.webhook_retries} (fix: --set health.webhook_timeout_s=5 --set health.webhook_retries=2)"
        )
    given = bool(h.webhook_url and REDACTED not in h.webhook_url) + bool(h.webhook_url_env) + bool(h.webhook_url_file)
    if given > 1 and not (h.webhook_url_env == WEBHOOK_SECRET_ENV and REDACTED in h.webhook_url):
        raise ConfigError(
            "health.webhook_url, webhook_url_env and webhook_url_file are three ways to give one URL; more than one is set "
            "(fix: keep only health.webhook_url_env or health.webhook_url_file)"
        )
    if h.webhook_url_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", h.webhook_url_env):
        raise ConfigError(
            f"health.webhook_url_env {shown(h.webhook_url_env)} is not an environment variable name (fix: e.g. AURA_GPU_WEBHOOK)"
        )
