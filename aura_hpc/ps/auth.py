"""The run's secret and what proves it: joins, replies, pair links and every message carry an HMAC.

Anyone who can reach the server's port can read and write its TCPStore (torch has no access
control there), so nothing in the store is trusted for what it says, only for what it proves: a
request counts when its HMAC under the run's secret checks out, and a worker believes a reply
only when the server's HMAC over the worker's own nonce does. After the pair group is up, both
ends prove the secret over it (challenge and response) and derive a session key; from then on
every message (header and tensor) carries an HMAC with a sequence number, so a peer that slipped
into the pair's rendezvous, or replays a message, is dropped.

The secret is never a config key (config.yaml is copied into every checkpoint): `ps` takes it
from AURA_PS_SECRET, from --secret-file, or from RUN_DIR/ps.secret (mode 600), which it writes the
first time with a fresh random secret, so a resumed server keeps the workers' command valid.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from aura_hpc.errors import ConfigError

SECRET_ENV = "AURA_PS_SECRET"
SECRET_FILE = "ps.secret"  # in the run directory, mode 600
MIN_LEN = 16
TAG_BYTES = 32


def _clean(text: str, origin: str, worker: bool = False) -> str:
    value = text.strip()
    if len(value) < MIN_LEN or any(c.isspace() or not c.isprintable() for c in value):
        if worker:  # a worker cannot make one: it must hold the server's
            fix = f"copy it exactly from the `{SECRET_ENV}=...` that `ps` printed, or pass --secret-file with the server's ps.secret"
        else:
            fix = "unset it to let `ps` make one, or use e.g. the output of: python -c 'import secrets; print(secrets.token_urlsafe(24))'"
        raise ConfigError(
            f"the secret from {origin} is too short or holds spaces/control characters (at least {MIN_LEN} printable characters) "
            f"(fix: {fix})"
        )
    return value


def given_secret(secret_file: str | None, worker: bool = False) -> str | None:
    """A secret handed to this process (--secret-file wins over AURA_PS_SECRET), or None."""
    if secret_file:
        try:
            return _clean(Path(secret_file).expanduser().read_text(encoding="utf-8"), f"--secret-file {secret_file}", worker)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --secret-file {secret_file} ({exc.__class__.__name__}) (fix: a readable text file)") from None
    env = os.environ.get(SECRET_ENV)
    return _clean(env, SECRET_ENV, worker) if env else None


def server_secret(run_dir: Path, secret_file: str | None) -> tuple[str, str]:
    """(secret, where it came from) for `ps`: given, or kept in RUN_DIR/ps.secret (created once)."""
    given = given_secret(secret_file)
    if given:
        return given, f"--secret-file {secret_file}" if secret_file else SECRET_ENV
    path = run_dir / SECRET_FILE
    if path.exists():
        return _clean(path.read_text(encoding="utf-8"), str(path)), str(path)
    value = secrets.token_urlsafe(24)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    return value, f"{path} (new)"


def worker_secret(secret_file: str | None) -> str:
    value = given_secret(secret_file, worker=True)
    if not value:
        raise ConfigError(
            f"this worker has no secret for the run (fix: start it with {SECRET_ENV}=... exactly as `ps` prints, "
            "or pass --secret-file FILE holding the secret)"
        )
    return value


def key_of(secret: str) -> bytes:
    """The HMAC key: the secret is never used (or sent) as is."""
    return hashlib.sha256(b"aura_hpc ps v2|" + secret.encode()).digest()


def tag(key: bytes, *parts: bytes | str) -> str:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        mac.update(len(b).to_bytes(8, "little"))  # length-prefixed: no two part lists hash alike
        mac.update(b)
    return mac.hexdigest()


def valid(key: bytes, given: object, *parts: bytes | str) -> bool:
    # compare_digest raises TypeError on a str with non-ASCII characters: a peer's "é" ended the server.
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(given, tag(key, *parts))


def pair_prefix(key: bytes, nonce: str) -> str:
    """The store prefix of a worker's pair group, derived by both ends: nobody sends it, but the pair's
    keys (its gloo addresses) carry it, and anyone listing the store sees them while the pair is made,
    so the pair proves the secret over itself before it carries anything (handshake); the server
    deletes them once the pair is up."""
    return "pair/" + tag(key, "pair", nonce)[:32]
