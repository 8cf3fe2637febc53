"""Experiment trackers beside metrics.jsonl (rank 0): trackio, Weights & Biases, MLflow, offline first.

Nothing here may cost a step: rows go into a bounded queue, and one thread hands them to the trackers.
A tracker that blocks (an unreachable server) fills the queue, and rows are then dropped with one
warning; one that fails is switched off with one warning. metrics.jsonl and TensorBoard keep every row.

One tracked run per run directory: its ids are kept in RUN_DIR/tracking/ids.json, so a resumed or
requeued run continues the same tracked run (W&B `resume="allow"` with the same id, MLflow the same
run id, trackio the same run name).

SQLite-backed stores (trackio's, MLflow's default) are unsafe on NFS/Lustre/GPFS (locking, WAL and
mmap: trackio #555 crashed distributed jobs with SIGBUS). When the run directory is on a network
filesystem they are kept on node-local disk and copied into RUN_DIR/tracking/ with SQLite's backup
API at every checkpoint, every `tracking.copy_every_s` and at the end; a resumed run on another node
starts from that copy. Once the last copy is in the run directory, the node-local stores are removed:
a node that runs many jobs must not keep each one's stores in its temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from aura_hpc.config import RunConfig
from aura_hpc.config.tracking import backends as chosen_backends
from aura_hpc.config.tracking import require_installed
from aura_hpc.ops.disk import is_network_fs

log = logging.getLogger("aura_hpc")
IDS = "ids.json"
RUN_KEY = "run_key"  # in IDS, and in a node-local store folder: whose stores these are


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics or resources row (lists: one value per rank)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in ("step", "time", "gpus"):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[prefix + k] = float(v)
        elif isinstance(v, list):
            for r, x in enumerate(v):
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    out[f"{prefix}{k}/rank{r}"] = float(x)
    for g in row.get("gpus", []) if isinstance(row.get("gpus"), list) else []:
        for k, v in g.items():
            if k != "index" and isinstance(v, (int, float)) and math.isfinite(v):
                out[f"{prefix}gpu{g.get('index', 0)}/{k}"] = float(v)
    return out


def node_local_store(run_dir: Path) -> Path:
    """Where a run directory's SQLite stores live on this node when they are kept off its network filesystem."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"aura-tracking-{os.getuid()}-{key}"


# A tracker whose calls fail (a server restarting, a 429) is paused, not switched off: its rows skipped for 1, 2, 4 ...
# up to 60 s after each failure in a row (each try may cost its client's timeout, 10 s for MLflow), then tried again.
# Five quick refusals in a row (a server restarting refuses at once, and rows come every second or two) switched
# MLflow off for a run of days. Off only once it has failed for OFF_AFTER_S without one success: a server gone for good.
PAUSE_MAX_S = 60.0
OFF_AFTER_S = 1800.0


class Trackers:
    def __init__(self, cfg: RunConfig, resume_step: int) -> None:
        self.cfg = cfg
        self.names = [b for b in chosen_backends(cfg) if b != "tensorboard"]
        require_installed(cfg)
        self.folder = cfg.run_dir / "tracking"
        self.local = self._local_folder()
        self.resume_step = resume_step
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=cfg.tracking.queue_rows)
        self._live: dict[str, Any] = {}
        self._off: dict[str, Any] = {}  # switched off mid-run: still told the run's end (MLflow's run left RUNNING otherwise)
        # A failing tracker: its failures in a row, since when, paused until when, the rows it missed.
        self._failing: dict[str, tuple[int, float, float, int]] = {}
        self._dropped = 0
        self._copied = 0.0
        self._copy_failed = False  # the last copy into the run directory missed a store
        self._not_copied_in: set[Path] = set()  # stores whose copy in the run directory could not be read: never written over
        self._finished = False  # the thread handed over "finish" and made its last copy
        self._broken = False  # the thread stopped on an error of its own: nothing more goes to it
        # A resumed run: the steps a tracker already holds past the checkpoint (the killed attempt logged
        # them; an exact resume logs the same values again), not sent twice.
        self._held: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.hints: list[str] = []

    def _local_folder(self) -> Path:
        t = self.cfg.tracking
        local = t.sqlite_local == "true" or (t.sqlite_local == "auto" and is_network_fs(self.cfg.run_dir))
        if not local:
            return self.folder
        return node_local_store(self.cfg.run_dir)

    # ---- the training side: never waits ---------------------------------------------------------
    def start(self) -> None:
        if not self.names:
            return
        config = yaml.safe_load(self.cfg.to_yaml())  # secrets redacted
        # The ids we choose are kept before anything else happens: an attempt killed before its trackers
        # started must not leave the next one to choose another (a second W&B run for one training run).
        self.folder.mkdir(parents=True, exist_ok=True)
        ids = _read_ids(self.folder / IDS)
        # This run directory's key; one made again gets another. An ids.json without one (an older release's run, or
        # one this attempt could not read) is this run's: its node-local folder is adopted, never replaced.
        self.adopt_local = RUN_KEY not in ids and (self.folder / IDS).exists()
        if RUN_KEY not in ids:
            kept = ""
            with contextlib.suppress(OSError):
                kept = (self.local / RUN_KEY).read_text(encoding="utf-8").strip() if self.adopt_local else ""
            ids[RUN_KEY] = kept if self.adopt_local and kept.isalnum() else secrets.token_hex(8)
        self.run_key = ids[RUN_KEY]
        from aura_hpc.train.loop import tracker_backends

        for name in self.names:
            chosen = tracker_backends.chosen_id(name, self.cfg)
            if chosen and name not in ids:
                ids[name] = chosen
        _write_ids(self.folder / IDS, ids)
        self._queue.put(("start", config))
        self._thread = threading.Thread(target=self._run, name="aura-trackers", daemon=True)
        self._thread.start()

    def log(self, values: dict[str, float], step: int) -> None:
        if self._thread is None or self._broken or not values:
            return
        try:
            self._queue.put_nowait(("log", (values, step)))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning(
                    "tracking: the trackers are %d rows behind (a slow or unreachable server?); rows are dropped from them "
                    "until they catch up (metrics.jsonl and TensorBoard keep every row)",
                    self.cfg.tracking.queue_rows,
                )

    def checkpointed(self) -> None:
        """A checkpoint is being written: node-local stores are copied into the run directory too."""
        if self._thread is not None and self.local != self.folder:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(("copy", None))

    def finish(self, failed: bool = False) -> None:
        """`failed`: the run ends on an error (the trackers mark it so: a failed run must not read as finished)."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            if not self._broken:
                self._queue.put(("finish", failed), timeout=5)
        self._thread.join(self.cfg.tracking.finish_wait_s)
        if self._thread.is_alive():
            log.warning(
                "tracking: the trackers did not finish within %g s (left behind; the run is saved; more time: tracking.finish_wait_s)",
                self.cfg.tracking.finish_wait_s,
            )
        elif self.local != self.folder and self._finished and not self._copy_failed:
            # Every store is in the run directory now, and a resumed run copies it back in.
            shutil.rmtree(self.local, ignore_errors=True)
        for hint in self.hints:
            log.info("tracking: %s", hint)

    # ---- the trackers' thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # the thread's own failure (a disk, a damaged store): a warning, never the run
            self._broken = True
            kept = f"; the stores stay in {self.local}" if self.local != self.folder else ""
            log.warning("tracking: the trackers stopped (%s); training goes on without them%s", _first_line(exc), kept)

    def _serve(self) -> None:
        while True:
            kind, payload = self._queue.get()
            if kind == "start":
                self._start_all(payload)
            elif kind == "log":
                values, step = payload
                for name in list(self._live):
                    if step > self._held.get(name, -1):
                        self._call(name, "log", values, step)
                if self.local != self.folder and time.monotonic() - self._copied > self.cfg.tracking.copy_every_s:
                    self._copy_out()
            elif kind == "copy":
                self._copy_out()
            elif kind == "finish":
                if self.local != self.folder:
                    self._copy_out()  # first: a tracker slow to finish must not cost the run directory its copy
                off = list(self._off.values())
                for name in list(self._live):
                    self._call(name, "finish", bool(payload))
                if self.local != self.folder:
                    self._copy_out()
                self._finished = True
                # Last: its server may answer again by now (said no more if not), but a wait on it must not cost
                # the stores their last copy within tracking.finish_wait_s.
                for backend in off:
                    with contextlib.suppress(Exception):
                        backend.finish(bool(payload))
                return

    def _call(self, name: str, method: str, *args: Any) -> bool:
        """True where the tracker took the call."""
        if name not in self._live:  # switched off meanwhile (a backfill's rows go on calling)
            return False
        now = time.monotonic()
        failed, since, paused_until, skipped = self._failing.get(name, (0, now, 0.0, 0))
        if method == "log" and now < paused_until:
            self._failing[name] = (failed, since, paused_until, skipped + 1)
            return False
        try:
            getattr(self._live[name], method)(*args)
        except Exception as exc:  # a tracker's failure costs a warning, never the run
            if method == "log" and time.monotonic() - since < OFF_AFTER_S:
                if not failed:
                    log.warning("tracking: %s failed to log step %s (%s); it is tried again in a while", name, args[-1], _first_line(exc))
                pause = min(PAUSE_MAX_S, 2.0**failed)
                self._failing[name] = (failed + 1, since, time.monotonic() + pause, skipped + 1)
                return False
            log.warning("tracking: %s failed (%s); it is switched off for this run", name, _first_line(exc))
            if (backend := self._live.pop(name, None)) is not None:
                self._off[name] = backend
            return False
        if failed:
            log.info(
                "tracking: %s logs again after %.0f s; %d rows in between did not reach it (metrics.jsonl has them)",
                name,
                now - since,
                skipped,
            )
            del self._failing[name]
        return True

    def _start_all(self, config: dict[str, Any]) -> None:
        from aura_hpc.train.loop import tracker_backends

        if self.local != self.folder:
            from aura_hpc.train.process.progress import shared_folder

            # Its name is predictable, in a temporary folder other users share: only ours, closed to them.
            if untrusted := shared_folder(self.local):
                raise OSError(
                    f"the node-local store folder is another user's or open to others: {untrusted} "
                    "(fix: remove it, or --set tracking.sqlite_local=false)"
                )
            self._own_local_folder()
            self._copy_in()
        else:
            self.local.mkdir(parents=True, exist_ok=True, mode=0o700)
        ids = _read_ids(self.folder / IDS)
        for name in self.names:
            try:
                backend = tracker_backends.make(name, self.cfg, self.local, self.folder, self.run_key)
                ids[name] = backend.start(config, ids.get(name), self.resume_step)
                self._live[name] = backend
                self.hints.append(backend.hint())
            except Exception as exc:
                log.warning("tracking: %s could not start (%s); training goes on without it", name, _first_line(exc))
        _write_ids(self.folder / IDS, ids)
        self._backfill()  # from step 0 too: an attempt killed before its first checkpoint logged rows the next one redoes
        self._copied = time.monotonic()

    def _backfill(self) -> None:
        """A resumed run: the rows up to its checkpoint that a tracker lacks (a killed attempt's tracker had
        not written them yet), from metrics.jsonl, which keeps every row up to the resumed step."""
        rows = []
        with contextlib.suppress(OSError):
            for line in (self.cfg.run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= self.resume_step:
                        rows.append(row)
        for name in list(self._live):
            try:
                last = self._live[name].last_step()
            except Exception:
                continue
            if last is not None and last > self.resume_step:
                self._held[name] = last
            if last is None and name == "wandb":
                continue
            missing = [r for r in rows if last is None or r["step"] > last]
            sent = 0
            for row in missing:  # in order, up to the first row it does not take: a gap it could never fill again
                if not self._call(name, "log", scalars(row), row["step"]):
                    break
                sent += 1
            if sent:
                log.info("tracking: %s had rows up to step %s; %d earlier rows added from metrics.jsonl", name, last, sent)
            if sent < len(missing):
                log.warning("tracking: %s took %d of the %d earlier rows; the rest stay in metrics.jsonl", name, sent, len(missing))

    def _own_local_folder(self) -> None:
        """The node-local folder is named after the run directory's path: one left by a run whose directory was deleted
        since (a killed attempt, a copy that failed) held another run's stores, which this run continued."""
        key = self.local / RUN_KEY
        with contextlib.suppress(OSError):
            if self.local.is_dir() and key.read_text(encoding="utf-8").strip() == self.run_key:
                return
        # Empty: made just now (shared_folder checks its owner by making it), not another run's.
        if self.local.is_dir() and ((self.adopt_local and not key.exists()) or not any(self.local.iterdir())):
            key.write_text(self.run_key + "\n", encoding="utf-8")
            return
        if self.local.is_dir():
            log.info("tracking: %s held another run's stores (a run directory of this name made again); replaced", self.local)
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True, mode=0o700)
        key.write_text(self.run_key + "\n", encoding="utf-8")

    def _copy_in(self) -> None:
        """A resumed run on this node: start from the copy in the run directory when it is newer. A copy that
        fails is never written back over: the tracker starts without it, and its history stays in the run directory."""
        for kept in self.folder.glob("**/*.db"):
            here = self.local / kept.relative_to(self.folder)
            try:
                if not here.exists() or here.stat().st_mtime < kept.stat().st_mtime:
                    here.parent.mkdir(parents=True, exist_ok=True)
                    copy_in(kept, here)
            except OSError as exc:
                self._not_copied_in.add(kept.relative_to(self.folder))
                log.warning(
                    "tracking: could not copy %s back from the run directory (%s); its tracker starts without it, and that copy is "
                    "kept as it is (this attempt's rows stay in %s)",
                    kept,
                    exc,
                    self.local,
                )

    def _copy_out(self) -> None:
        self._copy_failed = False
        for db in self.local.glob("**/*.db"):
            kept = self.folder / db.relative_to(self.local)
            if db.relative_to(self.local) in self._not_copied_in:
                self._copy_failed = True  # the node-local stores stay: they hold this attempt's rows
                continue
            try:
                kept.parent.mkdir(parents=True, exist_ok=True)
                copy_out(db, kept)
            except (OSError, sqlite3.Error) as exc:
                log.warning("tracking: could not copy %s into the run directory (%s); it stays in %s", db.name, exc, db.parent)
                self._copy_failed = True
        self._copied = time.monotonic()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# SQLite opens node-local files only: its locks on a shared file system fail where the mount has none (Lustre without
# flock: "disk I/O error"; NFS without lockd: "database is locked"), so the run directory's copy is read and written
# as plain bytes, renamed into place (a reader never sees half a copy).


def copy_out(db: Path, kept: Path) -> None:
    """A consistent copy of a node-local SQLite store (the trackers' connections may be writing it) into `kept`."""
    snapshot = db.with_name(f".{db.name}.out")
    snapshot.unlink(missing_ok=True)
    source = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True)  # a URI: '#', '?' and '%' in a path quoted
    try:
        target = sqlite3.connect(snapshot)
        try:
            source.backup(target)
            target.execute("PRAGMA journal_mode = DELETE")  # one file, nothing beside it to copy
        finally:
            target.close()
    finally:
        source.close()
    tmp = kept.with_name(f".{kept.name}.tmp")
    shutil.copyfile(snapshot, tmp)
    os.replace(tmp, kept)
    snapshot.unlink(missing_ok=True)


def copy_in(kept: Path, here: Path) -> None:
    """The run directory's copy (whole: only ever renamed into place) as the node-local store `here`."""
    tmp = here.with_name(f".{here.name}.in")
    shutil.copyfile(kept, tmp)
    # SQLite replays a write-ahead log it finds beside a database onto it: one a killed process left beside `here`
    # turned the fresh copy back into that process's store. Nothing has `here` open yet.
    for side in ("-wal", "-shm", "-journal"):
        here.with_name(here.name + side).unlink(missing_ok=True)
    os.replace(tmp, here)


def _read_ids(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and len(v) < 200} if isinstance(data, dict) else {}


def _write_ids(path: Path, ids: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(ids, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
