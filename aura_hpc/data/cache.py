"""A node's cache of shards read from object storage: each shard downloaded once per node, checked
against the manifest's hash, and bounded in size.

Files are named by their manifest sha256 (a name never comes from the server), written under a
temporary name and renamed once their size and hash match, so a half-downloaded or corrupt shard
is never read. The ranks of a node share the cache: a per-shard lock file makes one of them
download while the others wait for it. When the cache would pass its bound, the least recently
used shards that the caller does not need now are removed; only files of this cache's own naming
are ever removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from aura_hpc.data import storage
from aura_hpc.errors import DataError

_OURS = re.compile(r"^[0-9a-f]{64}\.bin$")
_PART = re.compile(r"^\.[0-9a-f]{64}\.\d+\.part$")  # a download in progress, or one a killed process left
STALE_PART_S = 900.0  # a download writes as it goes: a part file untouched this long is a dead one's


def default_dir() -> Path:
    """Node-local by default (/tmp), per user: a home directory is often NFS, shared by every node. /tmp is
    everyone's: the folder is made for this user alone (an older one of ours is closed to others), and one another
    user could have made is refused. Shards it holds are trusted by their size: planted ones would be trained on."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    path = Path(tempfile.gettempdir()) / f"aura_hpc-cache-{user}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as exc:
        raise DataError(f"the shard cache {path} cannot be made ({exc.strerror}) (fix: --set data.cache_dir=A_FOLDER_OF_YOURS)") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        why = "not a folder" if not stat.S_ISDIR(st.st_mode) else "not yours"
        raise DataError(
            f"the shard cache {path} is {why} (anyone can make it first in {path.parent}) "
            "(fix: --set data.cache_dir=A_FOLDER_OF_YOURS, or remove it)"
        )
    if st.st_mode & 0o077:  # ours, made before with the umask's mode (0775 under umask 002): for us alone from now on
        path.chmod(0o700)
    return path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of a node (ranks, their background encoders)."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class CacheFull(DataError):
    """What a fetch needs does not fit beside what is pinned: said when the data is needed; a prefetch made before
    the windows it would replace were let go tries again once they are."""


class ShardCache:
    def __init__(self, root: str | Path, max_bytes: int, policy: storage.Policy) -> None:
        self.root = Path(root).expanduser() if root else default_dir()
        self.objects = self.root / "objects"
        self.max_bytes, self.policy = max_bytes, policy
        try:
            self.objects.mkdir(parents=True, exist_ok=True)
            (self.root / "locks").mkdir(exist_ok=True)
        except OSError as exc:
            raise DataError(
                f"data.cache_dir {self.root} cannot be created ({exc.strerror}) (fix: --set data.cache_dir=A_WRITABLE_DIR)"
            ) from None

    def path_for(self, sha256: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
            raise DataError(f"a manifest entry has no valid sha256 ({str(sha256)[:70]!r}) (fix: prepare the data again with --force)")
        return self.objects / f"{sha256}.bin"

    def has(self, sha256: str, size: int) -> bool:
        p = self.path_for(sha256)
        return p.is_file() and p.stat().st_size == size

    def _locked(self, sha256: str) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.root / "locks" / f"{sha256[:16]}.lock")

    def fetch(self, url: str, sha256: str, size: int, keep: Iterable[str] = ()) -> Path:
        """The local copy of `url`, downloaded (once per node) if missing. `keep`: hashes not to evict."""
        path = self.path_for(sha256)
        if self.has(sha256, size):
            os.utime(path)  # most recently used
            return path
        with self._locked(sha256):
            if self.has(sha256, size):  # another rank of this node fetched it meanwhile
                return path
            self.make_room(size, {sha256, *keep})
            for attempt in (1, 2):
                tmp = path.with_name(f".{sha256}.{os.getpid()}.part")
                try:
                    storage.download(url, tmp, self.policy)
                    got, digest = _size_and_hash(tmp)
                    if got == size and digest == sha256:
                        tmp.replace(path)
                        return path
                finally:
                    tmp.unlink(missing_ok=True)
                if attempt == 2:
                    raise DataError(
                        f"{url} does not match the manifest ({got} bytes, sha256 {digest[:12]}...; expected {size} bytes, "
                        f"{sha256[:12]}...) (fix: the data changed after it was prepared: prepare it again with --force)"
                    )
        return path

    def used(self) -> list[tuple[float, int, Path]]:
        out = []
        for p in self.objects.iterdir():
            if _OURS.match(p.name):
                with contextlib.suppress(OSError):
                    st = p.stat()
                    out.append((st.st_mtime, st.st_size, p))
        return sorted(out)

    def make_room(self, incoming: int, keep: set[str]) -> None:
        stale = time.time() - STALE_PART_S
        for p in self.objects.iterdir():  # never counted, never removed: they filled the disk run after run
            with contextlib.suppress(OSError):
                if _PART.match(p.name) and p.stat().st_mtime < stale:
                    p.unlink()
        entries = self.used()
        total = sum(s for _, s, _ in entries) + incoming
        for _, s, p in entries:  # oldest first
            if total <= self.max_bytes:
                break
            if p.name[:64] in keep:
                continue
            p.unlink(missing_ok=True)  # a rank that has it mapped keeps reading it (unlinked, not gone)
            total -= s
        if total > self.max_bytes:
            raise CacheFull(
                f"the shards needed now do not fit in data.cache_gb={self.max_bytes / 2**30:g} at {self.root} "
                f"({total / 2**30:.2f} GB) (fix: a larger data.cache_gb, or a smaller data.shuffle_window)"
            )


def _size_and_hash(path: Path) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def for_data(data_cfg: object) -> ShardCache | None:
    """The cache a data config reads object storage through (None for local data)."""
    d = data_cfg
    if not storage.is_remote(getattr(d, "path", "")):
        return None
    policy = storage.Policy(tries=int(d.read_tries), timeout_s=float(d.read_timeout_s))  # type: ignore[attr-defined]
    return ShardCache(d.cache_dir, int(d.cache_gb * 2**30), policy)  # type: ignore[attr-defined]
