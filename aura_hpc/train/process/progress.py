"""Where this rank is, for the launcher's hang watchdog (launch/hang_watch.py) to read from outside.

One small file per rank in a node-local folder the launcher names (AURA_PROGRESS_DIR), mapped into
memory: an update is a few stores into that page, with no system call and no device sync, so the
loop reports every step, section and collective at no cost. A stopped or hung process simply stops
updating it; the watchdog, which keeps running, sees that. Inert without the variable.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import signal
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aura_hpc.train.process.time_ledger import TimeLedger

ENV = "AURA_PROGRESS_DIR"
# Asks a worker for every thread's Python stack, into its log (worker_log.py). Not USR1/USR2, which stop
# a run (Slurm's pre-timeout signals); SIGWINCH is ignored by default, so a worker that has not yet
# registered for it is not killed by the request, and workers own no terminal that would send it.
STACK_SIGNAL = signal.SIGWINCH
# What a rank can be doing. "start-up" lasts until the first step of an attempt is done.
SECTIONS = ("start-up", "step", "evaluation", "checkpoint", "meeting", "data", "finished")
# The ops a rank can be in or have entered last (comm/collectives.py's names).
OPS = ("", "all_reduce", "all_gather", "broadcast", "barrier", "send", "recv", "gather", "other")
# write number, pid, section, step done, collectives entered, last op, section began (unix s), last update
# (unix s), the write number again; then the CRC-32 of all that. The page is read by another process while
# it is written (struct.pack_into would zero the page first, then fill it field by field, and a read in
# between saw a new step with times of zero). One copy is not in order either: memcpy stores a 76-byte page
# as overlapping vectors, both ends first (a read in CI saw both write numbers new and the step between them
# old), and the reader's copy has no order of its own. The checksum tells a whole page in any order.
BODY = struct.Struct("<qqqqqqddq")
LAYOUT = struct.Struct(BODY.format + "I")


def page_bytes(pid: int, section: int, step: int, entered: int, op: int, since: float, beat: float, write: int = 1) -> bytes:
    body = BODY.pack(write, pid, section, step, entered, op, since, beat, write)
    return body + struct.pack("<I", zlib.crc32(body))


def file_for(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}"


def shared_folder(folder: Path) -> str | None:
    """Make (or take) the node's folder of pages for this attempt; why it cannot be trusted, or None. Its
    name is predictable (every task of the node must find it), so one another user made first, or a link,
    is refused: its pages could be links to our files, or read and forged by them."""
    import stat

    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder (a link or a file someone else put there)"
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        return f"{folder} was made by another user or is open to others (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})"
    return None


def remove_pages(folder: Path) -> None:
    """The ranks' pages in a progress folder (files named by file_for; nothing else in it is touched)."""
    for page in folder.glob("rank*"):
        if page.name.removeprefix("rank").isdigit():
            page.unlink(missing_ok=True)


class Progress:
    def __init__(self, path: Path | None) -> None:
        self._map: mmap.mmap | None = None
        self.ledger: TimeLedger | None = None  # rank 0's: where the time went (time_ledger.py)
        self.on_enter: list[Any] = []  # called with (section, step) as a section begins (the instruments' seam)
        self.section_index, self.step, self.entered, self.op, self.since = 0, 0, 0, 0, time.time()
        # next() on a count is one step under the GIL: writes from two threads (the loop, a collective on the
        # checkpoint thread) never share a number, which would let a read that mixes them pass.
        self._writes = itertools.count(1)
        if path is None:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, LAYOUT.size)
            self._map = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        self._write()

    def _write(self) -> None:
        if self._map is not None:
            # One copy into the page (mmap's slice assignment), the write number at both ends.
            number = next(self._writes)
            self._map[: LAYOUT.size] = page_bytes(
                os.getpid(), self.section_index, self.step, self.entered, self.op, self.since, time.time(), number
            )

    def enter(self, section: str) -> None:
        now = time.time()
        if self.ledger is not None:
            self.ledger.changed(SECTIONS[self.section_index], section, self.since, now, self.step)
        self.section_index, self.since = SECTIONS.index(section), now
        self._write()
        for hook in self.on_enter:  # after the page says where the rank is
            hook(section, self.step)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A section inside a step (evaluation, checkpoint, a DiLoCo meeting); back to `step` after it."""
        before = SECTIONS[self.section_index]
        self.enter(name)
        try:
            yield
        finally:
            self.enter(before if before != "start-up" else "step")

    def step_done(self, step: int) -> None:
        self.step = step
        if self.section_index == 0:
            self.enter("step")
        else:
            self._write()
            if self.ledger is not None:
                self.ledger.tick(SECTIONS[self.section_index], self.since, time.time(), step)

    def collective(self, op: str, tensors: Any, group: Any) -> None:
        """An observer of comm/collectives.py: every collective this rank enters, counted."""
        self.entered += 1
        self.op = OPS.index(op) if op in OPS else len(OPS) - 1
        self._write()


_current = Progress(None)


def start(rank: int, run_dir: Path | None = None) -> Progress:
    """This process's progress file (when the launcher asked for one), counting its collectives; on rank 0
    (given the run directory) also its time ledger."""
    global _current
    folder = os.environ.get(ENV)
    if folder and Path(folder).is_dir():
        from aura_hpc.comm import collectives

        _current = Progress(file_for(Path(folder), rank))
        collectives.observers.append(_current.collective)
    if rank == 0 and run_dir is not None:
        with contextlib.suppress(OSError):
            _current.ledger = TimeLedger(run_dir)
    return _current


def current() -> Progress:
    return _current


def read(path: Path) -> dict[str, Any] | None:
    """A rank's progress as the watchdog sees it; None when the file is not (yet) whole."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != LAYOUT.size:
        return None
    *fields, crc = LAYOUT.unpack(data)
    if crc != zlib.crc32(data[: BODY.size]):  # read while it was written, or before its first write
        return None
    first, pid, section, step, entered, op, since, beat, last = fields
    if first != last or first <= 0:
        return None
    if not 0 <= section < len(SECTIONS) or not 0 <= op < len(OPS):
        return None
    # Every write stamps both times: a whole page with a zero was not written by a rank, and read as one it
    # would be a rank that stopped in 1970 (declared hung at once).
    if beat <= 0 or since <= 0:
        return None
    return {"pid": pid, "section": SECTIONS[section], "step": step, "entered": entered, "op": OPS[op], "since": since, "beat": beat}
