"""A hang's evidence: what each rank's stack says, and which rank holds the others up.

The watchdog (launch/hang_watch.py) asks every rank for its Python stack (faulthandler writes it
into the rank's log) and reads it back here. A rank that does not answer is stopped or stuck outside
Python; one whose training thread is not inside a collective or a wait on the device is working while
its peers wait; otherwise the one that entered the fewest collectives is behind.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from aura_hpc.config.device import release
from aura_hpc.train.process.flight_dump import DUMP_VARS, PIPE_VAR

STACK_HEADER = "(most recent call first):"
# Frames of a rank that waits for its peers: it is held up, not the one holding the others up.
# On NCCL the host waits for its peers through the device: in the step report's read (one step late)
# or a CUDA synchronize, not inside the collective.
WAITING_FRAMES = ("torch/distributed/", "comm/collectives.py", "in backward", "in _engine_run_backward", "in wait", "torch/cuda/")


def name_culprits(ranks: dict[int, dict[str, Any]], stacks: dict[int, str]) -> tuple[list[int], str]:
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
    # faulthandler lists the newest thread first: the main thread is the last one. Not the thread that wrote
    # the dump (worker_log's), which is always busy writing it.
    others = [frames for frames in threads if not any(f.endswith(" in _dump_when_asked") for f in frames)]
    return others[-1] if others else []


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


def hang_line(
    ranks: dict[int, dict[str, Any]],
    stacks: dict[int, str],
    culprits: list[int],
    reason: str,
    host: str,
    idle: float,
    where: Path,
    flight: str = "",
) -> str:
    """The one line that names the rank holding the others up; `flight`: what the flight records say."""

    def state(r: int) -> str:
        p = ranks[r]
        doing = "training" if p["section"] == "step" else p["section"]
        return f"{doing} after step {p['step']}, {p['entered']} collectives entered"

    records = f"; flight records: {flight}" if flight else ""
    if culprits:
        r = culprits[0]
        what = {
            "silent": f"did not answer the request for its stack{_silent_why(ranks[r].get('pid'))}",
            "working": f"is not waiting for its peers: {_top(stacks.get(r, ''))}",
            "behind": f"is behind the others: {_top(stacks.get(r, ''))}",
            "flight": f"holds up the others by the flight records: {_top(stacks.get(r, ''))}",
        }[reason]
        others = [o for o in ranks if o not in culprits]
        waiting = ""
        if others:
            o, many = others[0], len(others) > 1
            who = f"rank{'s' if many else ''} {', '.join(map(str, others))} wait{'' if many else 's'}"
            waiting = f"; {who} at {_top(stacks.get(o, ''))} ({state(o)})"
        names = ", ".join(map(str, culprits))
        return f"hang: rank {names} on {host} {what} ({state(r)}), no progress for {idle:.0f}s{waiting}{records}; stacks in {where}"
    r = min(ranks)
    if all(stacks.get(o) and not _waiting(stacks[o]) for o in ranks):  # none waits: a step longer than allowed
        return (
            f"hang: every rank on {host} is still computing ({state(r)}; at {_top(stacks.get(r, ''))}), no progress for "
            f"{idle:.0f}s: a step longer than the watchdog allows (fix: --set health.hang_step_floor_s=<a few steps' seconds>)"
            f"{records}; stacks in {where}"
        )
    return (
        f"hang: every rank on {host} waits for a peer ({state(r)}; at {_top(stacks.get(r, ''))}), no progress for {idle:.0f}s: "
        f"the rank holding them up is on another node{records}; stacks in {where}"
    )


def process_state(pid: Any) -> tuple[str, str]:
    """(the kernel's state letter, the kernel function it sleeps in) of a process on this node; ("", "") if unknown."""
    try:
        state = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError, TypeError):
        return "", ""
    try:
        wchan = Path(f"/proc/{int(pid)}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return state, "" if wchan in ("", "0") else wchan


def stopped(pid: Any) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a debugger: all its threads are, its watchdog's helpers too."""
    return process_state(pid)[0] in ("T", "t")


def _silent_why(pid: Any) -> str:
    state, wchan = process_state(pid)
    if stopped(pid):
        return ": it is stopped (state T: SIGSTOP, or a debugger)"
    if state == "D":
        where = f" in {wchan}" if wchan else ""
        return (
            f": it is stuck in the kernel (state D{where}: uninterruptible I/O, such as a network filesystem that stopped "
            "answering; it dies only once that I/O ends)"
        )
    return " (stuck outside Python: in native code that holds Python's GIL, or in the kernel; py-spy's native stack shows where)"


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def wait_for_stacks(logs: dict[int, Path], offsets: dict[int, int], wait_s: float) -> dict[int, str]:
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


def py_spies(pids: dict[int, int]) -> dict[int, str]:
    """py-spy's native dump of every rank at once (each takes up to 20 s: one after another, 8 ranks would take minutes)."""
    if shutil.which("py-spy") is None or not pids:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
        return dict(zip(pids, pool.map(py_spy, pids.values()), strict=True))


PY_SPY_S = 20.0  # one dump's limit


def py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--native"], capture_output=True, text=True, timeout=PY_SPY_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout or out.stderr


# NCCL's flight recorder (torch's ProcessGroupNCCL): the last collectives of each rank, with their
# sequence numbers and state. With TORCH_NCCL_DEBUG_INFO_PIPE_FILE set, its monitor thread (not the
# training thread, which may be stuck) makes a named pipe <stem><rank>.pipe and dumps the record to
# <TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank> when anything is written into it. On gloo (torch >= 2.13) a
# thread of our worker answers on the same pipe (train/process/flight_dump.py).
PIPE_STEM = "nccl_pipe_"
TRACE_STEM = "nccl_flight_record_rank_"


def prepare_flight_recorder(progress_folder: Path, run_dir: Path) -> None:
    """The variables the workers inherit (a user's own settings win): pipes node-local, dumps beside the
    ranks' logs (that folder made here: torch writes into it, it does not make it). torch 2.13 records
    2,000 collectives and reads the pipe every second by default, and warns on the older names; older
    releases (2.6) record nothing and read the pipe every 8 minutes unless told, under those names."""
    import torch

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(PIPE_VAR, str(progress_folder / PIPE_STEM))
    prefix = next((os.environ[v] for v in DUMP_VARS if os.environ.get(v)), str(run_dir / "logs" / TRACE_STEM))
    if release(torch.__version__) >= (2, 13):
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
        return
    # A size the user gave under the newer name, under the one these releases read (they know no TORCH_FR_*).
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", os.environ.get("TORCH_FR_BUFFER_SIZE") or "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = prefix


def _paths() -> tuple[str, str]:
    """(the pipe stem, the dump prefix) the workers were given."""
    return os.environ.get(PIPE_VAR, ""), next((os.environ[v] for v in DUMP_VARS if os.environ.get(v)), "")


def ask_flight_recorders(ranks: list[int]) -> dict[int, tuple[int, int, int]]:
    """Write into each rank's pipe (never blocking: a pipe nobody reads is skipped); for each rank asked, what
    its dump file was before (inode, size, mtime), so that a new dump is told from an old one on any filesystem."""
    stem, prefix = _paths()
    asked: dict[int, tuple[int, int, int]] = {}
    for r in ranks if stem and prefix else []:
        pipe = Path(f"{stem}{r}.pipe")
        try:
            if not stat.S_ISFIFO(pipe.lstat().st_mode):
                continue
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # absent (gloo, no NCCL group yet), or no reader (ENXIO)
            continue
        try:
            before = _identity(Path(f"{prefix}{r}"))
            os.write(fd, b"1")
            asked[r] = before
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def _identity(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def keep_flight_records(asked: dict[int, tuple[int, int, int]], where: Path, deadline: float) -> dict[int, str]:
    """Copy each asked rank's new dump into the hang's folder once it is whole (a pickle ends in b"."; torch
    writes it in place, not atomically); the names kept, by rank. A rank whose dump never comes is left out."""
    _, prefix = _paths()
    kept: dict[int, str] = {}
    pending = dict(asked)
    while pending and time.time() < deadline:
        for r, before in list(pending.items()):
            dump = Path(f"{prefix}{r}")
            now = _identity(dump)
            if now == before or now[1] == 0:
                continue
            time.sleep(0.2)
            try:
                data = dump.read_bytes()
            except OSError:
                continue
            if len(data) != _identity(dump)[1] or not data.endswith(b"."):
                continue  # still being written
            kept[r] = f"nccl_flight_record_rank{r}"
            (where / kept[r]).write_bytes(data)
            del pending[r]
        time.sleep(0.2)
    return dict(sorted(kept.items()))


def remove_pipes(progress_folder: Path) -> None:
    """The ranks' flight-recorder pipes, once their attempt is over (torch leaves them)."""
    for pipe in progress_folder.glob(f"{PIPE_STEM}*.pipe"):
        try:
            if stat.S_ISFIFO(pipe.lstat().st_mode):
                pipe.unlink()
        except OSError:
            pass
