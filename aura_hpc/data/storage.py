"""Object storage (`s3://bucket/prefix`, any S3-compatible service: AWS, Cloudflare R2, MinIO, Ceph)
behind fsspec + s3fs, with our own retries.

Credentials come only from where the AWS tools look for them (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws/credentials, an instance role) and
the endpoint from AWS_ENDPOINT_URL (or the profile's endpoint_url): never from a URL or a config
value, so they cannot reach config.yaml, a checkpoint or a log. Every message here names the URL and
the fix, never a key.

botocore's and s3fs's own retries are turned off: a read is retried here, `tries` times with
exponential backoff, each try bounded by `timeout_s`, and every retry is logged, so the total time a
read can take is known (and kept below the collective timeout by the trainer).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aura_hpc.errors import DataError

log = logging.getLogger("aura_hpc")
T = TypeVar("T")

SCHEME = "s3://"


def is_remote(path: str | object) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def check_url(url: str, what: str = "data.path") -> None:
    """Refuse what would put a secret in a config file or a log, and schemes we do not read."""
    from aura_hpc.config.checks import url_problem

    problem = url_problem(url, what)
    if problem:
        raise DataError(problem)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


@dataclass(frozen=True)
class Policy:
    """How hard a read tries: `tries` attempts, each bounded by `timeout_s`, with backoff between."""

    tries: int = 5
    timeout_s: float = 60.0
    backoff_s: float = 1.0  # the first wait; doubled each retry, with jitter, at most 30 s

    def worst_case_s(self) -> float:
        waits = sum(min(30.0, self.backoff_s * 2**i) * 1.25 for i in range(self.tries - 1))
        return self.tries * self.timeout_s * 2 + waits  # a try is a connect and a read


def window_patience_s(read_tries: int, read_timeout_s: float, shuffle_window: int) -> float:
    """How long a rank waits for the others to have a window's shards: their reads' own worst case
    (every try timing out, with backoff), with room; only a rank that died waits this long."""
    return 2 * Policy(tries=read_tries, timeout_s=read_timeout_s).worst_case_s() * max(1, shuffle_window or 1) + 60


_FS: dict[tuple[float], Any] = {}


def filesystem(policy: Policy = Policy()) -> Any:
    """The s3fs filesystem of this process (credentials and endpoint from the standard AWS places)."""
    key = (policy.timeout_s,)
    fs = _FS.get(key)
    if fs is not None:
        return fs
    try:
        import s3fs
    except ImportError:
        raise DataError("s3:// paths need s3fs (fix: pip install 'aura_hpc[s3]')") from None
    fs = s3fs.S3FileSystem(
        skip_instance_cache=True,
        config_kwargs={
            "retries": {"max_attempts": 1, "mode": "standard"},
            "connect_timeout": policy.timeout_s,
            "read_timeout": policy.timeout_s,
        },
    )
    fs.retries = 1  # s3fs's own retry loop: off, ours below is the only one
    _FS[key] = fs
    return fs


def strip(url: str) -> str:
    return url[len(SCHEME) :] if is_remote(url) else url


def _status(exc: BaseException) -> str:
    """A short reason, without anything a server echoed back (it can quote a key id)."""
    for e in (exc, exc.__cause__, exc.__context__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            err = resp.get("Error") or {}
            code = err.get("Code") or ""
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return " ".join(str(x) for x in (status, code) if x) or type(e).__name__
    if isinstance(exc, PermissionError):
        return "403 Forbidden"
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__


_REACHED = [False]  # a read of this process has reached the storage once


def _no_endpoint(exc: BaseException) -> bool:
    """The first contact failed to connect, and no endpoint was given: AWS itself was tried, which a
    MinIO, R2 or Ceph user did not mean (a forgotten AWS_ENDPOINT_URL cost 53 s of retries before)."""
    import os

    named = type(exc).__name__
    return not _REACHED[0] and named == "EndpointConnectionError" and not os.environ.get("AWS_ENDPOINT_URL", "").strip()


def _permanent(exc: BaseException) -> bool:
    """Errors a retry cannot fix: missing objects, missing or refused credentials, and a first contact
    with AWS when no endpoint was given."""
    if isinstance(exc, FileNotFoundError | PermissionError | DataError) or type(exc).__name__ == "NoCredentialsError":
        return True
    if _no_endpoint(exc):
        return True
    reason = _status(exc)
    return any(code in reason for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket", "403"))


# A full, read-only or forbidden local disk: no retry fixes it, and the bucket is not to blame.
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})  # EACCES: also what a refused bucket may say


def _local_failure(exc: BaseException, what: str, local: str | None) -> DataError | None:
    """The one-line error for a failure on this machine's side of a copy (s3fs names objects
    bucket/key, never an absolute path), or None for the storage's own."""
    if not isinstance(exc, OSError) or isinstance(exc, TimeoutError | ConnectionError):
        return None
    named = exc.filename if isinstance(exc.filename, str) and os.path.isabs(exc.filename) else None
    if named is None and exc.errno not in _LOCAL_ERRNOS:
        return None
    return DataError(
        f"copying {what} failed on this machine, not in the storage: {named or local or 'a local file'}: "
        f"{exc.strerror or type(exc).__name__} (fix: free space on that disk or make it writable; for the shard cache, "
        "--set data.cache_dir=A_DIR_ON_ANOTHER_DISK)"
    )


def _transport_error(exc: BaseException) -> bool:
    """Errors of the storage or the network (as opposed to a bug: TypeError, KeyError, ...)."""
    if isinstance(exc, OSError | TimeoutError | DataError):  # ConnectionError, FileNotFoundError, PermissionError
        return True
    module = type(exc).__module__.split(".")[0]
    return module in ("botocore", "aiobotocore", "aiohttp", "s3fs", "asyncio", "urllib3")


def explain(exc: BaseException, url: str) -> DataError:
    """The one-line error for a read that failed for good."""
    reason = _status(exc)
    if "NoSuchBucket" in reason or "bucket does not exist" in str(exc):
        bucket = strip(url).split("/", 1)[0]
        return DataError(f"bucket s3://{bucket} does not exist (fix: create it first, e.g. aws s3 mb s3://{bucket}, or check the name)")
    if isinstance(exc, FileNotFoundError) or "NoSuch" in reason or "404" in reason:
        return DataError(f"{url} does not exist ({reason}) (fix: check the bucket and prefix, or prepare the data there first)")
    if isinstance(exc, PermissionError) or any(c in reason for c in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")):
        return DataError(
            f"access to {url} was refused ({reason}) (fix: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
            "AWS_ENDPOINT_URL for R2/MinIO, and the bucket's permissions)"
        )
    if _no_endpoint(exc):
        return DataError(
            f"could not connect to AWS S3 for {url}, and AWS_ENDPOINT_URL is not set (fix: for MinIO, R2 or Ceph set "
            "AWS_ENDPOINT_URL, e.g. http://HOST:9000; for AWS itself, check this machine's network)"
        )
    if "NoCredentials" in reason or "NoCredentialsError" in type(exc).__name__:
        return DataError(f"no credentials to read {url} (fix: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
    return DataError(f"could not read {url} ({reason}) (fix: check AWS_ENDPOINT_URL and the network, then re-run to resume)")


def retrying(what: str, fn: Callable[[], T], policy: Policy, sleep: Callable[[float], None] = time.sleep, local: str | None = None) -> T:
    """fn(), retried on transient errors with exponential backoff; a DataError naming `what` when
    it fails for good (or at once for a missing object or refused credentials), or naming the local
    file (`local`, the copy's other end) when this machine's disk failed."""
    for attempt in range(1, policy.tries + 1):
        try:
            out = fn()
            _REACHED[0] = True
            return out
        except Exception as exc:  # botocore, aiohttp and OS errors all end here
            mine = _local_failure(exc, what, local)
            if mine is not None:
                raise mine from None
            if not _transport_error(exc):
                raise  # a bug of ours, not a storage problem: not retried, not disguised
            if _permanent(exc) or attempt == policy.tries:
                err = explain(exc, what)
                if attempt > 1 and not _permanent(exc):
                    err = DataError(str(err).replace(" (fix:", f" after {attempt} tries (fix:", 1))
                raise err from None
            wait = min(30.0, policy.backoff_s * 2 ** (attempt - 1)) * random.uniform(1.0, 1.25)
            log.warning("reading %s failed (%s), try %d of %d; retrying in %.1f s", what, _status(exc), attempt, policy.tries, wait)
            sleep(wait)
    raise AssertionError("unreachable")


def read_bytes(url: str, policy: Policy = Policy(), start: int | None = None, end: int | None = None) -> bytes:
    fs = filesystem(policy)
    return retrying(url, lambda: fs.cat_file(strip(url), start=start, end=end), policy)


# What a listing said of each object, for a minute: prepare (and each rank of a stream) asked for every input object
# again, one request each after the listing that found them all (100,000 objects: a request each before any token).
LISTED_S = 60.0
_LISTED: dict[tuple[str, str], tuple[float, tuple[int, str]]] = {}


def _memo_key(url: str) -> tuple[str, str]:
    return os.environ.get("AWS_ENDPOINT_URL", ""), url  # one endpoint's objects are not another's


def _listed(url: str) -> tuple[int, str] | None:
    seen = _LISTED.get(_memo_key(url))
    if seen is not None and time.monotonic() - seen[0] >= LISTED_S:
        _LISTED.pop(_memo_key(url), None)
        return None
    return seen[1] if seen is not None else None


def size(url: str, policy: Policy = Policy()) -> int:
    if (seen := _listed(url)) is not None:
        return seen[0]
    fs = filesystem(policy)
    return int(retrying(url, lambda: fs.info(strip(url))["size"], policy))


def listing(prefix: str, policy: Policy = Policy()) -> dict[str, int]:
    """Every object under `prefix` with its size, by full s3:// URL."""
    return {url: size for url, (size, _) in objects(prefix, policy).items()}


def objects(pattern: str, policy: Policy = Policy()) -> dict[str, tuple[int, str]]:
    """Objects under a prefix, or matching a glob, or the object itself: URL -> (size, ETag)."""
    fs = filesystem(policy)
    path = strip(pattern)
    if (seen := _listed(pattern)) is not None:  # one object a listing just named
        return {pattern: seen}
    if any(c in path for c in "*?["):
        found = retrying(pattern, lambda: fs.glob(path, detail=True), policy)
    else:
        found = retrying(pattern, lambda: fs.find(path, detail=True), policy)
        if not found:
            try:
                info = retrying(pattern, lambda: fs.info(path), policy)
                found = {path: info} if info.get("type") == "file" else {}
            except DataError:
                found = {}
    listed = {
        SCHEME + k: (int(v.get("size", 0)), str(v.get("ETag", v.get("LastModified", ""))))
        for k, v in found.items()
        if v.get("type") != "directory"
    }
    now = time.monotonic()
    _LISTED.update({_memo_key(url): (now, seen) for url, seen in listed.items()})
    return listed


def delete(url: str, policy: Policy = Policy()) -> None:
    _LISTED.pop(_memo_key(url), None)  # what a listing said of it no longer holds
    fs = filesystem(policy)
    retrying(url, lambda: fs.rm_file(strip(url)), policy)


def download(url: str, dest: Any, policy: Policy = Policy()) -> None:
    fs = filesystem(policy)
    retrying(url, lambda: fs.get_file(strip(url), str(dest)), policy, local=str(dest))


def upload(local: Any, url: str, policy: Policy = Policy()) -> None:
    _LISTED.pop(_memo_key(url), None)  # what a listing said of it no longer holds
    fs = filesystem(policy)
    retrying(url, lambda: fs.put_file(str(local), strip(url)), policy, local=str(local))


def write_bytes(url: str, data: bytes, policy: Policy = Policy()) -> None:
    _LISTED.pop(_memo_key(url), None)  # what a listing said of it no longer holds
    fs = filesystem(policy)
    retrying(url, lambda: fs.pipe_file(strip(url), data), policy)


class DamagedManifest(DataError):
    """A manifest.json that is not JSON (a copy or an upload cut short, a full disk): `prepare --force` replaces it
    where every file beside it has a name prepare writes and prepare's tokenizer is among them."""


def damaged_manifest(where: str) -> DamagedManifest:
    return DamagedManifest(
        f"{where} is damaged: it is not JSON (a copy cut short, or a full disk) (fix: prepare the data there again with --force, "
        "or copy the prepared folder again whole)"
    )


def read_manifest(url: str, policy: Policy, check: bool = True) -> dict[str, Any] | None:
    """The manifest under `url` (None: there is none); `check`: refused unless every field is as
    prepare writes it (what a run reads), not when prepare only looks whose the prefix is."""
    try:
        raw = read_bytes(join(url, "manifest.json"), policy)
    except DataError as exc:
        if "does not exist" in str(exc) and not str(exc).startswith("bucket s3://"):  # a missing bucket is said as such
            return None
        raise
    try:
        value = json.loads(raw)
    except ValueError:
        raise damaged_manifest(join(url, "manifest.json")) from None
    if not isinstance(value, dict):
        return None
    if check:
        from aura_hpc.data.manifest import check_manifest

        check_manifest(value, join(url, "manifest.json"))
    return value
