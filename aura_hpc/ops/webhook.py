"""Deliver an event (`gpu.fault` from the breaker, `training.hang` from the hang watchdog) to a webhook
(generic JSON, Discord or Slack), with retry and timeout.

The URL is a secret (it usually embeds a token): it is never logged or written anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import threading
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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib follows a 301/302/303 as a GET without the body, to any host: the alert was lost and a 200 from
    the new place (Discord answers a GET on a webhook) said it was delivered. A redirect is a failure here."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect())


def deliver(url: str, kind: str, event: dict[str, Any], timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 1.0) -> bool:
    """POST the event; True once a 2xx arrives. Retries on errors, 5xx, 408 and 429. Never raises, and never
    holds its caller longer than its attempts' timeouts and waits: an alert must not stop the checkpoint or
    the watchdog that sends it (nor show the URL in a traceback); urllib's timeout does not cover the name
    lookup, so the attempts run on a thread of their own."""
    if not usable(url):
        log.warning(
            "%s webhook not sent: the URL from health.webhook_url, _env or _file is not an http(s) URL (the value is a "
            "secret and not shown) (fix: give it as https://host/path, on one line)",
            event.get("event"),
        )
        return False
    delivered: list[bool] = []

    def send() -> None:
        try:
            delivered.append(_attempts(url, kind, event, timeout_s, retries, backoff_s))
        except Exception as exc:  # a bug here must not pass for an answer, nor end the caller
            log.warning("%s webhook not sent (%s)", event.get("event"), type(exc).__name__)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    within = (retries + 1) * timeout_s + backoff_s * retries * (retries + 1) / 2 + 1.0
    sender.join(within)
    if sender.is_alive():
        log.warning(
            "%s webhook not confirmed within %.0f s (a name lookup or connection that does not answer); not waited for",
            event.get("event"),
            within,
        )
        return False
    return bool(delivered and delivered[0])


def _attempts(url: str, kind: str, event: dict[str, Any], timeout_s: float, retries: int, backoff_s: float) -> bool:
    data = json.dumps(body(kind, event)).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", "User-Agent": "aura_hpc"}, method="POST")
        final = False
        try:
            with _OPENER.open(req, timeout=timeout_s) as resp:
                if 200 <= resp.status < 300:
                    log.warning("%s webhook delivered (HTTP %d, attempt %d)", event.get("event"), resp.status, attempt + 1)
                    return True
                why = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            why = f"HTTP {exc.code}"
            if 300 <= exc.code < 400:
                why += ": the URL redirects elsewhere (fix: give the final https:// URL the service shows)"
            final = exc.code < 500 and exc.code not in (408, 429)  # the same request gets the same answer
        except Exception as exc:  # the message may hold the URL: only the error's kind is said
            why = type(getattr(exc, "reason", exc)).__name__
        log.warning("%s webhook attempt %d of %d failed (%s)", event.get("event"), attempt + 1, retries + 1, why)
        if final:
            return False
        if attempt < retries:
            time.sleep(backoff_s * (attempt + 1))
    return False
