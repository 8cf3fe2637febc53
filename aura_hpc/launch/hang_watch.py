"""The hang watchdog of a `local` run: it watches this node's ranks from the launcher, outside the loop.

Each rank keeps a progress page up to date (train/process/progress.py: section, steps done,
collectives entered). When no rank of this node has moved for longer than its section allows,
the run is hung. Before anything is killed, every rank is asked for its Python stack (faulthandler,
into its log; py-spy with native frames where installed); a rank that does not answer is stopped
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
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.config import RunConfig
from aura_hpc.train.process import progress

CALIBRATION = "hang_calibration.json"
ANSWER_WAIT_S = 5.0
FACTOR = 5.0  # a section may take this many times the longest seen before it counts as hung
STACK_HEADER = "(most recent call first):"
# Frames of a rank that waits for its peers: it is held up, not the one holding the others up.
# On NCCL the host waits for its peers through the device: in the step report's read (one step late)
# or a CUDA synchronize, not inside the collective.
WAITING_FRAMES = ("torch/distributed/", "comm/collectives.py", "in backward", "in _engine_run_backward", "in wait", "torch/cuda/")


@dataclass
class Hang:
    """What the watchdog found: the line for the user, and where the evidence is."""

    line: str
    folder: Path
    culprits: list[int]
    progress_step: int


@dataclass
class _Seen:
    beat: float = 0.0
    step: int = 0
    section: str = ""


@dataclass
class HangWatch:
    cfg: RunConfig
    folder: Path  # the node-local folder of the ranks' progress pages
    poll_s: float = 1.0
    calibration: dict[str, float] = field(default_factory=dict)
    hangs: list[Hang] = field(default_factory=list)  # every hang declared, oldest first
    _stop: threading.Event = field(default_factory=threading.Event)
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig) -> HangWatch:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        _sweep(base)
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
        watch = cls(cfg, folder)
        watch.calibration = _read_calibration(cfg.run_dir / CALIBRATION)
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
        # stack): the watchdog must speak before it.
        return min(limit, max(float(h.hang_step_floor_s), self.cfg.dist.timeout_s - 30.0))

    def _learn(self, rank: int, now: dict[str, Any]) -> None:
        """The longest step (per step, between two readings) and section seen, kept across restarts."""
        before = self._seen.get(rank)
        self._seen[rank] = _Seen(now["beat"], now["step"], now["section"])
        if before is None or now["beat"] <= before.beat:
            return
        took, key = 0.0, ""
        if now["section"] == "step" and before.section == "step" and now["step"] > before.step > 0:
            took, key = (now["beat"] - before.beat) / (now["step"] - before.step), "step"
        elif before.section in ("evaluation", "checkpoint", "meeting") and now["section"] != before.section:
            took, key = now["beat"] - before.beat, before.section
        if key and took > self.calibration.get(key, 0.0):
            self.calibration[key] = round(took, 3)
            _write_calibration(self.cfg.run_dir / CALIBRATION, self.calibration)

    # ---- watching ----------------------------------------------------------------------------
    def start(self) -> None:
        os.environ[progress.ENV] = str(self.folder)
        self._seen = {}
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="aura-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for f in self.folder.glob("rank*"):  # the next attempt's ranks write their own pages
            f.unlink(missing_ok=True)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            ranks = self.read()
            if not ranks:
                continue
            for r, p in ranks.items():
                self._learn(r, p)
            if self.hung(ranks, time.time()):
                from aura_hpc import console

                try:
                    hang = self.investigate(ranks)
                except Exception as exc:  # the evidence failed (a full disk?): the run is still hung
                    hang = Hang(f"hang: no rank of this node made progress; its evidence could not be kept ({exc})", self.folder, [], 0)
                console.error(hang.line)
                self.hangs.append(hang)
                self.kill(ranks)
                self._seen = {}
                self.notify(hang)

    def read(self) -> dict[int, dict[str, Any]]:
        out = {}
        for f in self.folder.glob("rank*"):
            suffix = f.name.removeprefix("rank")
            if suffix.isdigit() and (p := progress.read(f)) is not None:
                out[int(suffix)] = p
        return out

    def hung(self, ranks: dict[int, dict[str, Any]], now: float) -> bool:
        """No rank of this node has moved for longer than the most generous of their sections allows."""
        if all(p["section"] == "finished" for p in ranks.values()):
            return False
        idle = now - max(p["beat"] for p in ranks.values())
        return idle > max(self.timeout(p["section"]) for p in ranks.values())

    # ---- a hang --------------------------------------------------------------------------------
    def investigate(self, ranks: dict[int, dict[str, Any]]) -> Hang:
        """Every rank's stack, before anything is killed; the culprit named."""
        now = time.time()
        where = self.cfg.run_dir / "hangs" / time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        where.mkdir(parents=True, exist_ok=True)
        logs = {r: self.cfg.run_dir / "logs" / f"rank_{r}.log" for r in ranks}
        offsets = {r: _size(logs[r]) for r in ranks}
        for p in ranks.values():
            _signal(p["pid"], progress.STACK_SIGNAL)
        stacks = _wait_for_stacks(logs, offsets, ANSWER_WAIT_S)
        for r, p in ranks.items():
            text = stacks.get(r) or "(no answer to the stack request: stopped, or stuck outside Python)\n"
            native = _py_spy(p["pid"])
            (where / f"rank{r}.txt").write_text(text + (f"\n--- py-spy dump --native ---\n{native}" if native else ""), encoding="utf-8")
        culprits, reason = _culprits(ranks, stacks)
        host = socket.gethostname()
        idle = now - max(p["beat"] for p in ranks.values())
        line = _line(ranks, stacks, culprits, reason, host, idle, where)
        record = {
            "declared_at": now,
            "host": host,
            "line": line,
            "culprits": culprits,
            "ranks": ranks,
            "timeouts": {p["section"]: self.timeout(p["section"]) for p in ranks.values()},
            "calibration": self.calibration,
        }
        (where / "hang.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
        (self.cfg.run_dir / "hangs" / "last.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
        return Hang(line, where, culprits, min(p["step"] for p in ranks.values()))

    def notify(self, hang: Hang) -> None:
        """The `training.hang` event to health.webhook_url, when one is set (after the kill: a slow
        webhook never delays the restart)."""
        from aura_hpc.ops import webhook

        h = self.cfg.health
        url = webhook.resolve_url(h.webhook_url, h.webhook_url_env, h.webhook_url_file)
        if url:
            event = {
                "event": "training.hang",
                "host": socket.gethostname(),
                "line": hang.line,
                "culprits": hang.culprits,
                "step": hang.progress_step,
                "run_dir": str(self.cfg.run_dir),
                "evidence": str(hang.folder),
                "job_id": os.environ.get("SLURM_JOB_ID", ""),
            }
            webhook.deliver(url, h.webhook_type, event, h.webhook_timeout_s, h.webhook_retries)

    def kill(self, ranks: dict[int, dict[str, Any]]) -> None:
        """Every worker of this node: a rank stuck in a collective would not leave by itself."""
        for r, p in ranks.items():
            _signal(p["pid"], signal.SIGKILL)  # a stopped process dies of it too
            progress.file_for(self.folder, r).unlink(missing_ok=True)  # a restarted rank writes a new page


PREFIX = "aura-progress-"  # then the launcher's PID: a killed launcher's folder is removed by the next one


def _sweep(base: Path) -> None:
    """Progress folders of launchers that are gone (killed before they could remove their own)."""
    for folder in base.glob(f"{PREFIX}*-*"):
        pid = folder.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit() or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its launcher still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        for page in folder.glob("rank*"):
            page.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when nothing else is in it


def _culprits(ranks: dict[int, dict[str, Any]], stacks: dict[int, str]) -> tuple[list[int], str]:
    silent = sorted(r for r in ranks if not stacks.get(r))
    if silent:
        return silent, "silent"
    working = sorted(r for r in ranks if not _waiting(stacks[r]))
    if working and len(working) < len(ranks):
        return working, "working"
    least = min((p["step"], p["entered"]) for p in ranks.values())
    behind = sorted(r for r, p in ranks.items() if (p["step"], p["entered"]) == least)
    if len(behind) < len(ranks):
        return behind, "behind"
    return [], "elsewhere"


def _waiting(stack: str) -> bool:
    top = _main_stack(stack)[:4]
    report = any("loop/step.py" in f and f.endswith(" in read") for f in top)  # the step report, read one step late
    return report or any(any(w in frame for w in WAITING_FRAMES) for frame in top)


def _main_stack(stack: str) -> list[str]:
    """The training thread's frames, most recent first (faulthandler lists every thread)."""
    threads: list[list[str]] = []
    for line in stack.splitlines():
        if STACK_HEADER in line:
            threads.append([])
        elif threads and line.strip().startswith("File "):
            threads[-1].append(line.strip())
    for frames in threads:
        if any("aura_hpc/train/worker.py" in f and f.endswith(" in main") for f in frames):
            return frames
    return threads[0] if threads else []


def _top(stack: str) -> str:
    """The innermost frame of ours in the training thread ("step.py:123 in step"), with what it called."""
    frames = _main_stack(stack)
    # Our innermost frame that says what the rank was doing (the collectives module only relays).
    ours = next((f for f in frames if "aura_hpc/" in f and "aura_hpc/comm/" not in f), None)
    if ours is None:
        return frames[0] if frames else "?"

    def short(frame: str) -> str:
        parts = frame.replace('File "', "").replace('", line ', ":").split(" in ")
        path = parts[0].split("aura_hpc/", 1)[-1] if "aura_hpc/" in parts[0] else parts[0].rsplit("/", 1)[-1]
        return f"{path.strip()} in {parts[1].strip()}" if len(parts) > 1 else path.strip()

    inner = frames[0]
    return short(ours) + ("" if inner == ours else f" (inside {short(inner)})")


def _line(
    ranks: dict[int, dict[str, Any]], stacks: dict[int, str], culprits: list[int], reason: str, host: str, idle: float, where: Path
) -> str:
    def state(r: int) -> str:
        p = ranks[r]
        doing = "training" if p["section"] == "step" else p["section"]
        return f"{doing} after step {p['step']}, {p['entered']} collectives entered"

    if culprits:
        r = culprits[0]
        what = {
            "silent": "did not answer the request for its stack (stopped, or stuck outside Python)",
            "working": f"is not waiting for its peers: {_top(stacks.get(r, ''))}",
            "behind": f"is behind the others: {_top(stacks.get(r, ''))}",
        }[reason]
        others = [o for o in ranks if o not in culprits]
        waiting = ""
        if others:
            o, many = others[0], len(others) > 1
            who = f"rank{'s' if many else ''} {', '.join(map(str, others))} wait{'' if many else 's'}"
            waiting = f"; {who} at {_top(stacks.get(o, ''))} ({state(o)})"
        names = ", ".join(map(str, culprits))
        return f"hang: rank {names} on {host} {what} ({state(r)}), no progress for {idle:.0f}s{waiting}; stacks in {where}"
    r = min(ranks)
    return (
        f"hang: every rank on {host} waits for a peer ({state(r)}; at {_top(stacks.get(r, ''))}), no progress for {idle:.0f}s: "
        f"the rank holding them up is on another node; stacks in {where}"
    )


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _wait_for_stacks(logs: dict[int, Path], offsets: dict[int, int], wait_s: float) -> dict[int, str]:
    """What each rank's faulthandler wrote into its log after the request (a rank that answered has a
    stack header there)."""
    deadline = time.time() + wait_s
    got: dict[int, str] = {}
    while True:
        for r, path in logs.items():
            if r in got:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(offsets[r])
                    text = f.read(1 << 20).decode("utf-8", errors="replace")
            except OSError:
                continue
            if STACK_HEADER in text:
                time.sleep(0.2)  # the other threads' stacks follow within the same handler
                with open(path, "rb") as f:
                    f.seek(offsets[r])
                    got[r] = f.read(1 << 20).decode("utf-8", errors="replace")
        if len(got) == len(logs) or time.time() > deadline:
            return got
        time.sleep(0.1)


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--native"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout or out.stderr


def _read_calibration(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if k in progress.SECTIONS and isinstance(v, (int, float)) and 0 <= v < 1e6}


def _write_calibration(path: Path, data: dict[str, float]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
