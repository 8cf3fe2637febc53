"""The hang watchdog of a `local` run: it watches this node's ranks from the launcher, outside the loop.

Each rank keeps a progress page up to date (train/process/progress.py: section, steps done,
collectives entered). When no rank of this node has moved for longer than its section allows,
the run is hung. Before anything is killed, every rank is asked for its Python stack (its own thread writes
it into its log; py-spy with native frames where installed); a rank that does not answer is stopped
or stuck outside Python. Everything goes to RUN_DIR/hangs/<time>/, one line names the culprit, and
the workers are killed so the launcher can restart the run from its newest checkpoint.

Timeouts are calibrated from the run itself: five times the longest time a section took on any rank,
never under its floor, kept in RUN_DIR/hang_calibration.json so that a resumed run starts calibrated.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.config import RunConfig
from aura_hpc.launch import agent_folder, flight_records
from aura_hpc.launch.hang_board import HangBoard, Verdict
from aura_hpc.launch.hang_calibration import CALIBRATION, FACTOR, CalibrationFile, read_calibration
from aura_hpc.launch.hang_evidence import (
    PY_SPY_S,
    ask_flight_recorders,
    hang_line,
    keep_flight_records,
    log_size,
    name_culprits,
    prepare_flight_recorder,
    process_state,
    py_spies,
    remove_pipes,
    stopped,
    wait_for_stacks,
)
from aura_hpc.launch.hang_notice import notify
from aura_hpc.launch.in_time import in_time
from aura_hpc.launch.stop_signals import StopSignals
from aura_hpc.processes import alive as process_alive
from aura_hpc.train.process import progress
from aura_hpc.train.process.dist_env import node_name

ANSWER_WAIT_S = 5.0
FLIGHT_RECORD_WAIT_S = 15.0
PEER_WAIT_S = 20.0  # a node whose ranks all wait, for the node that names the culprit
STOPPING_STALL_S = 15.0  # after a stop signal, a training rank this long without moving is hung (it would not stop)
PEER_POLL_IDLE_S = 10.0  # the board is read while this node's ranks have not moved for this long
# The node that names a culprit waits this long at most for the other nodes' verdicts (each takes its ranks'
# stacks and records on reading the culprit's: a poll + ANSWER_WAIT_S + FLIGHT_RECORD_WAIT_S at worst; py-spy's
# native frames come after the verdict) before it kills.
EVIDENCE_WAIT_S = 30.0
# What a declared hang takes before its kill at most: the stacks and torch's flight records (the stacks' wait is
# inside the records' 15 s), the other nodes' verdicts, py-spy's native frames.
EVIDENCE_S = FLIGHT_RECORD_WAIT_S + EVIDENCE_WAIT_S + PY_SPY_S
INVESTIGATE_S = ANSWER_WAIT_S + FLIGHT_RECORD_WAIT_S + 40.0  # the stacks, the flight records, writing them to RUN_DIR


@dataclass
class Hang:
    """What the watchdog found: the line for the user, and where the evidence is."""

    line: str
    folder: Path
    culprits: list[int]
    progress_step: int
    last_progress: float = 0.0  # the newest beat of any rank of this node before the hang (unix s)
    killed_at: float = 0.0

    @classmethod
    def of(cls, line: str, folder: Path, culprits: list[int], ranks: dict[int, dict[str, Any]]) -> Hang:
        """Where and when the node's ranks stopped: the slowest rank's step, the newest beat."""
        return cls(line, folder, culprits, min(p["step"] for p in ranks.values()), max(p["beat"] for p in ranks.values()))


@dataclass
class _Seen:
    beat: float = 0.0
    step: int = 0
    section: str = ""
    skew: float = 0.0  # wall clock minus monotonic clock when read: it grows by a laptop's sleep, or an NTP step


@dataclass
class HangWatch:
    cfg: RunConfig
    folder: Path  # the node-local folder of the ranks' progress pages
    poll_s: float = 1.0
    calibration: dict[str, float] = field(default_factory=dict)
    hangs: list[Hang] = field(default_factory=list)  # every hang declared, oldest first
    board: HangBoard | None = None  # a LAN run's other nodes (launch/hang_board.py)
    peer_hangs: list[Verdict] = field(default_factory=list)  # the other nodes' verdicts in this attempt
    started: float = 0.0
    last_beat: float = 0.0  # the newest beat read from this node's ranks
    stops: StopSignals | None = None  # the launcher's stop signals (Ctrl+C during a hang must not wait it out)
    _stop: threading.Event = field(default_factory=threading.Event)
    _busy: threading.Event = field(default_factory=threading.Event)  # set while a hang is handled (evidence, verdicts, kill)
    _pids: frozenset[int] = frozenset()  # the ranks' processes this attempt
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _calibration_file: CalibrationFile = field(init=False)

    def __post_init__(self) -> None:
        self._calibration_file = CalibrationFile(self.cfg.run_dir / CALIBRATION)

    @classmethod
    def for_run(cls, cfg: RunConfig, board: HangBoard | None = None) -> HangWatch:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        _sweep(base)
        ns = agent_folder.pid_namespace()
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{'n' + ns + '-' if ns else ''}", dir=base))
        watch = cls(cfg, folder, board=board)
        watch.calibration = read_calibration(cfg.run_dir / CALIBRATION)
        return watch

    # ---- timeouts ----------------------------------------------------------------------------
    def timeout(self, section: str) -> float:
        h, d = self.cfg.health, self.cfg.data
        if section == "finished":
            return float("inf")
        if section == "data":
            # The ranks wait for a data window through the store, with their own patience and verdict (exit 74): after it.
            from aura_hpc.data.storage import window_patience_s

            return window_patience_s(d.read_tries, d.read_timeout_s, d.shuffle_window) + 60
        if section == "start-up":
            limit = float(h.hang_startup_s)
        else:
            floor = h.hang_step_floor_s if section == "step" else h.hang_section_floor_s
            limit = max(float(floor), FACTOR * self.calibration.get(section, 0.0))
        # Past the collective timeout the waiting ranks' collective fails first (NCCL aborts them without a
        # stack): the watchdog must have spoken, kept its evidence and killed before it. NCCL's clock starts as
        # a collective is queued, which on a GPU can be a step before the newest beat (the host runs ahead).
        # Never below two steps, though: a step's own collectives (DDP's) do not beat, and a long step on a slow
        # link under a short dist.timeout_s is not a hang (NCCL then speaks first on a real one).
        step = self.calibration.get("step", 0.0)
        before_nccl = max(self.cfg.dist.timeout_s - 30.0 - EVIDENCE_S - step, 2 * step)
        return min(limit, max(float(h.hang_step_floor_s), before_nccl))

    def _learn(self, rank: int, now: dict[str, Any]) -> None:
        """The longest step (per step, between two readings) and section seen, kept across restarts."""
        before = self._seen.get(rank)
        skew = time.time() - time.monotonic()
        first_seen = before.skew if before is not None and before.beat == now["beat"] else skew  # when this beat was new
        self._seen[rank] = _Seen(now["beat"], now["step"], now["section"], first_seen)
        if before is None or now["beat"] <= before.beat:
            return
        # Less what the wall clock jumped between the readings: a step across a laptop's sleep took the sleep on
        # the wall clock, and five times that became the run's step timeout (kept in the calibration file).
        span = now["beat"] - before.beat - max(0.0, skew - before.skew)
        took, key = 0.0, ""
        if now["section"] == "step" and before.section == "step" and now["step"] > before.step > 0:
            took, key = span / (now["step"] - before.step), "step"
        elif before.section in ("evaluation", "checkpoint", "meeting") and now["section"] != before.section:
            took, key = span, before.section
        if key and took > self.calibration.get(key, 0.0):
            self.calibration[key] = round(took, 3)
            self._calibration_file.write_behind(self.calibration)

    # ---- watching ----------------------------------------------------------------------------
    def start(self) -> None:
        os.environ[progress.ENV] = str(self.folder)
        prepare_flight_recorder(self.folder, self.cfg.run_dir)
        self._seen, self._pids, self._newest, self._moved = {}, frozenset(), 0.0, time.monotonic()
        self.peer_hangs, self.started = [], time.time()
        if self.board is not None:
            self.board.new_attempt()  # every node, node 0 included: the verdicts of this attempt name its store's round
        # A stop of its own: the last attempt's thread, still in a slow webhook past stop()'s wait, stops at its next
        # poll instead of watching on beside this one (two verdicts, two kills of one hang).
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="aura-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        progress.remove_pages(self.folder)  # the next attempt's ranks write their own pages
        remove_pipes(self.folder)

    def close(self) -> None:
        self.stop()
        self._calibration_file.flush()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            ranks = self.read()
            if not ranks:
                continue
            for r, p in ranks.items():
                self._learn(r, p)
            newest = max(p["beat"] for p in ranks.values())
            if newest != self._newest:
                self._newest, self._moved = newest, time.monotonic()
            # Idleness on this watchdog's monotonic clock since a page last moved, in the pages' terms: the wall
            # clock counts a laptop's sleep (its ranks did not run either) and jumps with NTP, and a resumed
            # laptop's ranks were declared hung, killed and restarted from their last checkpoint.
            now = newest + (time.monotonic() - self._moved)
            pids = frozenset(p["pid"] for p in ranks.values())
            if self._pids and pids != self._pids:
                # New workers (the agent restarted them in place): the verdicts so far were another attempt's.
                self.peer_hangs, self.started = [], time.time()
                if self.board is not None:
                    self.board.mark_seen()
            self._pids = pids
            self.last_beat = max(self.last_beat, *(p["beat"] for p in ranks.values()))
            if self.board is not None:
                self.board.note_round()
            if now - max(p["beat"] for p in ranks.values()) > PEER_POLL_IDLE_S:
                self.peer_hangs = self.peer_verdicts()
            asked = self.stops.poll() if self.stops is not None else None
            if self.hung(ranks, now, stopping=asked is not None) or self.named_elsewhere(ranks, now):
                from aura_hpc import console

                self._busy.set()
                try:
                    hang = investigate_in_time(self, ranks)
                    hang = self._agree(hang)
                    self.add_native_stacks(hang, ranks)
                    console.error(hang.line)
                    self.hangs.append(hang)
                    self.kill(ranks)
                    hang.killed_at = time.time()
                    self._seen = {}
                finally:
                    self._busy.clear()
                notify(self, hang)

    def settle(self, wait_s: float) -> None:
        """Until a hang being handled is handled (its verdict known, its kill done): the launcher asks before
        it reads its workers' failure, which the other nodes' kill may cause while this node still waits."""
        deadline = time.monotonic() + wait_s
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _agree(self, hang: Hang) -> Hang:
        """With other nodes: this node's verdict on the board (peers read it before anything is killed), or,
        when every rank here only waits, the verdict of the node that names the culprit."""
        if self.board is None:
            return hang
        here = Verdict(self.board.node_rank, node_name(), hang.line, hang.culprits, time.time(), hang.progress_step)
        self.board.publish(here)
        if hang.culprits:
            # The other nodes' ranks wait for this culprit: their watchdogs take their stacks on reading this
            # verdict and answer with their own. Killing first would end them without any (a broken connection).
            self.board.wait_for_all(EVIDENCE_WAIT_S)
            return hang
        named = [v for v in self.board.wait_for_others(PEER_WAIT_S) if v.culprits]
        if not named:
            return hang
        v = named[0]
        line = f"{v.line} (named by node {v.node}; every rank on {here.host} waited for it: their stacks in {hang.folder})"
        with contextlib.suppress(OSError, ValueError):
            for path in (hang.folder / "hang.json", self.cfg.run_dir / "hangs" / "last.json") if hang.folder != self.folder else ():
                record = json.loads(path.read_text(encoding="utf-8"))
                record.update(line=line, culprits=v.culprits, named_by=v.as_dict())
                path.write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
        return Hang(line, hang.folder, v.culprits, v.step, hang.last_progress)

    def peer_verdicts(self) -> list[Verdict]:
        """The other nodes' verdicts in this attempt (a LAN run's board; none on one machine)."""
        return self.board.others() if self.board is not None else []

    def named_elsewhere(self, ranks: dict[int, dict[str, Any]], now: float) -> bool:
        """Another node named a culprit while every live rank here waits: this node's evidence is taken now,
        whatever its own timeouts say, before that node's kill ends these ranks too."""
        live = [p for p in ranks.values() if p["section"] != "finished" and process_alive(p["pid"])]
        return bool(live) and now - max(p["beat"] for p in live) > PEER_POLL_IDLE_S and any(v.culprits for v in self.peer_hangs)

    def peer_hang(self) -> Hang | None:
        """A hang another node declared in this attempt, when this node's workers ended on the broken
        collectives it left behind (before this node's own watchdog spoke)."""
        named = [v for v in self.peer_hangs if v.culprits] or self.peer_hangs
        if not named:
            return None
        v = named[0]
        return Hang(f"{v.line} (named by node {v.node})", self.cfg.run_dir / "hangs", v.culprits, v.step, self.last_beat)

    def read(self) -> dict[int, dict[str, Any]]:
        out = {}
        for f in self.folder.glob("rank*"):
            suffix = f.name.removeprefix("rank")
            if suffix.isdigit() and (p := progress.read(f)) is not None:
                out[int(suffix)] = p
        return out

    def hung(self, ranks: dict[int, dict[str, Any]], now: float, stopping: bool = False) -> bool:
        """No rank of this node has moved for longer than the most generous of their sections allows. Once a
        stop was asked, ranks that train finish their step and checkpoint at once: a few steps' time without
        moving is a hang, so Ctrl+C during one is answered in seconds, with the culprit, not after the agent's
        shutdown_timeout."""
        ranks = {r: p for r, p in ranks.items() if process_alive(p["pid"])}  # one that exited is the agent's to report
        if not ranks or all(p["section"] == "finished" for p in ranks.values()):
            return False
        idle = now - max(p["beat"] for p in ranks.values())
        step = self.calibration.get("step", 0.0)
        if stopping and step and all(p["section"] == "step" for p in ranks.values()):
            # Only once a step's time is known: the first steps (compilation, a long accumulation) may take minutes.
            return idle > max(STOPPING_STALL_S, 3 * step)
        return idle > max(self.timeout(p["section"]) for p in ranks.values())

    # ---- a hang --------------------------------------------------------------------------------
    def investigate(self, ranks: dict[int, dict[str, Any]], late: threading.Event | None = None, named: list[Hang] | None = None) -> Hang:
        """Every rank's stack, before anything is killed; the culprit named (into `named` before the files are written:
        a slow filesystem past the time given keeps the verdict). Once `late` is set, it asks and writes nothing more."""
        now = time.time()
        # The host in the name: on a shared run directory two nodes' watchdogs may speak in the same second.
        where = self.cfg.run_dir / "hangs" / f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{node_name()}"
        where.mkdir(parents=True, exist_ok=True)
        logs = {r: self.cfg.run_dir / "logs" / f"rank_{r}.log" for r in ranks}
        offsets = {r: log_size(logs[r]) for r in ranks}
        if late is not None and late.is_set():  # the run directory answered too late: the ranks may be new ones now
            raise TimeoutError("the run directory answered too late")
        asked_at = time.time()
        # A stopped process's threads are stopped too: its record is not asked for (nor waited for).
        flight = ask_flight_recorders(sorted(r for r, p in ranks.items() if not stopped(p["pid"])))
        for p in ranks.values():
            _signal(p["pid"], progress.STACK_SIGNAL)
        stacks = wait_for_stacks(logs, offsets, ANSWER_WAIT_S)
        # torch allows its own dump 15 s; the monitor thread reads the pipe once a second. A rank that did not
        # answer for its stack (stuck in the kernel) will not dump its record either.
        flight = {r: before for r, before in flight.items() if r in stacks}
        records = keep_flight_records(flight, where, asked_at + FLIGHT_RECORD_WAIT_S) if flight else {}
        stuck = flight_records.judge(flight_records.read_kept(where, records), sorted(ranks)) if records else None
        culprits, reason = name_culprits(ranks, stacks)
        if not culprits and stuck is not None and stuck.culprits:
            culprits, reason = stuck.culprits, "flight"  # every stack waits; the records tell which rank's device is stuck
        host = node_name()
        idle = now - max(p["beat"] for p in ranks.values())
        line = hang_line(ranks, stacks, culprits, reason, host, idle, where, stuck.line if stuck else "")
        hang = Hang.of(line, where, culprits, ranks)
        if named is not None:
            named.append(hang)
        for r, p in ranks.items():
            state, wchan = process_state(p["pid"])
            text = stacks.get(r) or f"(no answer to the stack request; kernel state {state or '?'}{f' in {wchan}' if wchan else ''})\n"
            (where / f"rank{r}.txt").write_text(text, encoding="utf-8")
        record = {
            "declared_at": now,
            "host": host,
            "line": line,
            "culprits": culprits,
            "ranks": ranks,
            "timeouts": {p["section"]: self.timeout(p["section"]) for p in ranks.values()},
            "calibration": self.calibration,
            # torch's analyzer reads them: python -m torch.distributed.flight_recorder.fr_trace
            "nccl_flight_records": list(records.values()),
            "flight_recorder": stuck.as_dict() if stuck else None,
        }
        (where / "hang.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
        if late is None or not late.is_set():  # a newer hang's record is not overwritten by this one's
            (self.cfg.run_dir / "hangs" / "last.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
        return hang

    def add_native_stacks(self, hang: Hang, ranks: dict[int, dict[str, Any]]) -> None:
        """py-spy's native frames (where installed), after each rank's file: after the verdict is out, since
        py-spy may take 20 s and the other nodes wait for that verdict before they kill."""
        if hang.folder == self.folder:
            return
        with contextlib.suppress(OSError):
            for r, native in py_spies({r: p["pid"] for r, p in ranks.items()}).items():
                if native and (hang.folder / f"rank{r}.txt").is_file():
                    with open(hang.folder / f"rank{r}.txt", "a", encoding="utf-8") as f:
                        f.write(f"\n--- py-spy dump --native ---\n{native}")

    def kill(self, ranks: dict[int, dict[str, Any]]) -> None:
        """Every worker of this node: a rank stuck in a collective would not leave by itself."""
        for r, p in ranks.items():
            _signal(p["pid"], signal.SIGKILL)  # a stopped process dies of it too
            progress.file_for(self.folder, r).unlink(missing_ok=True)  # a restarted rank writes a new page


PREFIX = "aura-progress-"  # then the launcher's PID: a killed launcher's folder is removed by the next one


def _sweep(base: Path) -> None:
    """Progress folders of launchers that are gone (killed before they could remove their own)."""
    for folder in base.glob(f"{PREFIX}*-*"):
        parts = folder.name.removeprefix(PREFIX).split("-")
        pid, ns = parts[0], parts[1][1:] if len(parts) > 2 and parts[1].startswith("n") else None
        if not pid.isdigit() or folder.is_symlink() or not folder.is_dir():
            continue
        if not agent_folder.gone(pid, ns):
            continue  # its launcher still runs (here, or in another container's PID namespace), or is another user's
        progress.remove_pages(folder)
        remove_pipes(folder)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when nothing else is in it


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def investigate_in_time(watch: HangWatch, ranks: dict[int, dict[str, Any]], hurry: Callable[[], bool] | None = None) -> Hang:
    """`investigate`, given INVESTIGATE_S: it writes RUN_DIR (shared storage), and on a mount that stopped
    answering (ranks stuck in state D on it: the hang itself) the watch waited with it forever, and named nothing,
    killed nothing. Past its time the hang is declared without the evidence (with its culprit where the stacks
    were read), and the mount named. `hurry`: once it says so, the culprit named is enough (the files go on being
    written)."""
    late, named = threading.Event(), []
    until = (lambda: bool(named) and hurry()) if hurry is not None else None
    finished, result = in_time(watch.investigate, ranks, late, named, limit=INVESTIGATE_S, until=until)
    if finished and isinstance(result, Hang):
        return result
    if until is not None and until():
        return named[0]  # its files are still being written: the act cannot wait for them
    late.set()
    why = f"{result}" if finished else f"{watch.cfg.run_dir} did not answer within {INVESTIGATE_S:.0f} s (a hung mount there?)"
    if named:  # the stacks were read and the culprit named; the files were not all written
        return Hang.of(f"{named[0].line}; its evidence could not all be kept: {why}", watch.folder, named[0].culprits, ranks)
    return Hang.of(f"hang: no rank of {node_name()} made progress; its evidence could not be kept: {why}", watch.folder, [], ranks)
