"""Deliver an event (`gpu.fault` from the breaker, `training.hang` from the hang watchdog) to a webhook
(generic JSON, Discord or Slack), with retry and timeout.

The URL is a secret (it usually embeds a token): it is never logged or written anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("aura_hpc")


def resolve_url(webhook_url: str, url_env: str, url_file: str) -> str:
    """The URL from health.webhook_url_file, _env, an `env:VAR` webhook_url, or a literal one ("" if none)."""
    from aura_hpc.config.tree import REDACTED

    if url_file:
        try:
            return Path(url_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            log.warning("webhook: health.webhook_url_file cannot be read (%s)", exc.strerror)
            return ""
    if url_env:
        return os.environ.get(url_env, "").strip()
    if webhook_url.startswith("env:"):
        return os.environ.get(webhook_url[4:], "").strip()
    return "" if REDACTED in webhook_url else webhook_url


def body(kind: str, event: dict[str, Any]) -> dict[str, Any]:
    if kind == "generic":
        return event
    if "line" in event:  # an event that is one line already (a hang)
        text = f"aura_hpc {event['event']} (run {event.get('run_dir')}): {event['line']}"
        return {"content": text} if kind == "discord" else {"text": text}
    text = (
        f"aura_hpc {event['event']} on {event['host']} GPU {event['gpu_index']}: {event['reason']}"
        f" (job {event.get('job_id') or '-'}, run {event.get('run_dir')}, step {event.get('step')})"
    )
    return {"content": text} if kind == "discord" else {"text": text}


def usable(url: str) -> bool:
    """An http(s) URL with a host and nothing that would break a request line: what urllib takes."""
    from urllib.parse import urlsplit

    if any(c.isspace() or not c.isprintable() for c in url):
        return False
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:
        return False


def deliver(url: str, kind: str, event: dict[str, Any], timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 1.0) -> bool:
    """POST the event; True once a 2xx arrives. Retries on errors and non-2xx answers. Never raises: an
    alert must not stop the checkpoint or the watchdog that sends it (nor show the URL in a traceback)."""
    if not usable(url):
        log.warning(
            "%s webhook not sent: the URL from health.webhook_url, _env or _file is not an http(s) URL (the value is a "
            "secret and not shown) (fix: give it as https://host/path, on one line)",
            event.get("event"),
        )
        return False
    data = json.dumps(body(kind, event)).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", "User-Agent": "aura_hpc"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                if 200 <= resp.status < 300:
                    log.warning("%s webhook delivered (HTTP %d, attempt %d)", event.get("event"), resp.status, attempt + 1)
                    return True
                why = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            why = f"HTTP {exc.code}"
        except Exception as exc:  # the message may hold the URL: only the error's kind is said
            why = type(getattr(exc, "reason", exc)).__name__
        log.warning("%s webhook attempt %d of %d failed (%s)", event.get("event"), attempt + 1, retries + 1, why)
        if attempt < retries:
            time.sleep(backoff_s * (attempt + 1))
    return False
