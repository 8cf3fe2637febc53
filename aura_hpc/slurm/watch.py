"""The hang watchdog of a Slurm job: one per node, beside the node's tasks (started by slurm/job.py).

The same watchdog as `local`'s (launch/hang_watch.py: the ranks' progress pages, timeouts calibrated
from the run, every rank's stack before anything is killed, the culprit named, RUN_DIR/hangs/). What
differs is the act: there is no agent here to start the workers again, so the watchdog asks Slurm
to requeue the job (it resumes from its newest checkpoint, as after a pre-timeout signal), then kills
its node's ranks, which ends the job step. A hang that comes back without progress counts against
health.hang_restarts; past it, the job is not requeued, and the line says why.

Only the node that names a culprit acts. A node whose ranks all wait for a peer elsewhere leaves it to
that node's watchdog (its verdict appears in the shared RUN_DIR/hangs/), and acts itself only when
none appears within ELSEWHERE_WAIT_S (a culprit stuck outside any watchdog's view). The requeue ends
every node's ranks, so the acting node first waits (EVIDENCE_WAIT_S at most) for the other nodes'
records: a node whose ranks wait takes their stacks as soon as it reads a culprit's record, whatever
its own timeouts say.

    python -m aura_hpc.slurm.watch CONFIG PROGRESS_DIR JOB_ID RESTART_COUNT TASK_PID
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aura_hpc.launch.goodput import record_hang
from aura_hpc.launch.hang_board import Verdict
from aura_hpc.launch.hang_evidence import remove_pipes
from aura_hpc.launch.hang_notice import notify
from aura_hpc.launch.hang_watch import (
    EVIDENCE_WAIT_S,
    PEER_POLL_IDLE_S,
    Hang,
    HangWatch,
    investigate_in_time,
    process_alive,
    read_calibration,
)
from aura_hpc.launch.in_time import in_time
from aura_hpc.ops import excluded_nodes
from aura_hpc.slurm import exclude
from aura_hpc.train.process.dist_env import node_name

ELSEWHERE_WAIT_S = 60.0
BUDGET_FILE = "slurm_hang_restarts.json"
# Each look the act takes into RUN_DIR (the budget, the other nodes' records, the nodes to leave out): a mount that
# stops answering is a common hang, and the act waited in it forever, the job neither requeued nor its ranks killed.
RUN_DIR_S = 20.0


class SlurmHangWatch(HangWatch):
    job_id: int = 0
    restarts: int = 0

    nodes: int = 1
    earlier: frozenset[str] | set[str] = frozenset()  # RUN_DIR/hangs/ folders of earlier attempts (note_earlier_records)
    stop_asked: bool = False  # Slurm's pre-timeout signal (or scancel --signal) reached the step: the ranks stop
    run_dir_hung: bool = False  # a look into RUN_DIR went unanswered: the act goes on without it
    handling: bool = False  # a hang is declared and not yet acted on: SIGTERM no longer ends this process (main)
    # SIGTERM came while a hang is handled: the step is ending, most often because a waiting rank's own collective
    # timed out first (--kill-on-bad-exit ends every task). Slurm's KillWait (30 s by default) is left before SIGKILL:
    # the requeue goes at once, without the waits for the other nodes' evidence and py-spy's frames.
    ending: bool = False

    def in_run_dir(self, work: Any, *args: Any, default: Any, slurm_s: float = 0.0) -> Any:
        """`work(*args)`, which reads or writes RUN_DIR, waited for RUN_DIR_S (and `slurm_s` more for the scontrol
        calls it makes); `default` past it (and from then on), or where it failed (a full disk). What still runs
        finishes on its own once the mount answers: it asks Slurm nothing that changes the job."""
        if self.run_dir_hung:
            return default
        finished, result = in_time(work, *args, limit=RUN_DIR_S + slurm_s)
        if not finished:
            self.run_dir_hung = True
            hung = f"{self.cfg.run_dir} did not answer within {RUN_DIR_S:g} s (a mount that hangs?)"
            print(f"[watchdog] {hung}: acting without it", flush=True)
        elif isinstance(result, Exception):
            print(f"[watchdog] {self.cfg.run_dir}: {type(result).__name__}: {result}", flush=True)
        return result if finished and not isinstance(result, Exception) else default

    def act(self, hang: Hang, ranks: dict[int, dict[str, Any]], alone: bool = False) -> bool:
        """Requeue (within budget) and kill this node's ranks; False when another node acts (unless `alone`:
        this node already left it to one that did not)."""
        if not hang.culprits and not alone and self._another_node_named(hang):
            return False
        if hang.culprits and self.nodes > 1:
            self._wait_for_evidence_elsewhere()
        if self.ending:
            if self._trained_to_the_end():
                print("[watchdog] the ranks trained to the end while the hang was handled: not requeued", flush=True)
                return True
            print("[watchdog] the job step is ending (SIGTERM: a rank's own collective timeout, or a cancel) while the hang is "
                  "handled: requeuing first, within Slurm's KillWait", flush=True)  # fmt: skip
        # Alone, after the node that named the culprit acted (and counted the hang) without ending this task:
        # the same hang, not one more against the budget.
        requeue, why = self.in_run_dir(self._within_budget, hang.progress_step, not alone, default=(None, ""))
        if requeue is None:  # the hangs in a row are not known (a preemption or a time limit requeues too): slurm.max_requeues
            most = self.cfg.slurm.max_requeues
            requeue, unread = self.restarts < most, "the run directory's count of hangs in a row unread"
            nth, budget_said = f"the job's requeue {self.restarts + 1}", f"slurm.max_requeues={most}"
            why = f"{nth} of at most {budget_said}: {unread}" if requeue else f"it would be {nth}, past {budget_said} ({unread})"
        stopped = exclude.why_stopped(self.job_id, self.restarts) if requeue else exclude.Stopped()
        if stopped:  # a hang seen while a cancel or another hand's requeue stops the ranks: neither undone nor doubled
            requeue = False
        if hang.culprits and self.cfg.health.hang_exclude_node:
            ranks_named = ", ".join(map(str, hang.culprits))
            self.in_run_dir(excluded_nodes.record, self.cfg.run_dir, node_name(), f"rank {ranks_named} hung there", default=None)
        if requeue:
            print(f"[watchdog] requeuing job {self.job_id} after the hang: it resumes from its newest checkpoint ({why})", flush=True)
            say = lambda m: print(f"[watchdog] {m}", flush=True)  # noqa: E731
            judged: Any = True  # the step ending: judged after the requeue, which must come first
            if not self.ending:
                # The judgement asks scontrol too (JUDGE_BUDGET_S, then why_stopped's own wait): that time is Slurm's, not the mount's.
                judge, slurm_s = exclude.judge_unless_stopped, exclude.JUDGE_BUDGET_S + 40.0
                judged, stopped = self.in_run_dir(
                    judge, self.job_id, self.cfg.run_dir, say, self.restarts, default=(None, None), slurm_s=slurm_s
                )
                if stopped is None:  # not judged in time: a cancel meanwhile is still not undone by the requeue
                    stopped = exclude.why_stopped(self.job_id, self.restarts)
            if stopped:
                self._not_requeued(stopped)
            else:
                exclude.outlive_the_requeue()
                if failed := exclude.requeue(self.job_id):
                    print(f"[watchdog] scontrol requeue {self.job_id} failed: {failed} (fix: resubmit the same command)", flush=True)
                else:
                    slurm_s = 40.0 + (exclude.JUDGE_BUDGET_S if judged is True else 0.0)
                    self.in_run_dir(exclude.apply_after_requeue, self.job_id, self.cfg.run_dir, say, judged, default=None, slurm_s=slurm_s)
        elif stopped:
            self._not_requeued(stopped)
        else:
            print(f"[watchdog] not requeued: {why} (fix: see the hang's line and stacks, then resubmit)", flush=True)
        self.kill(ranks)
        return True

    def _trained_to_the_end(self) -> bool:
        """Every rank of this node finished the run's steps (a stall that ended by itself while it was handled: the
        SIGTERM is job.py's, its ranks done). Not a rank that only stopped: SIGCONT wakes a stopped culprit too."""
        ranks = self.read()
        return bool(ranks) and all(p["section"] == "finished" and p["step"] >= self.cfg.train.max_steps for p in ranks.values())

    def _not_requeued(self, stopped: exclude.Stopped) -> None:
        if not stopped.requeued_anyway:  # a cancel
            print(f"[watchdog] not requeued: {stopped.why} (fix: see the hang's line and stacks, then resubmit)", flush=True)
            return
        print(f"[watchdog] {stopped.line}", flush=True)
        say = lambda m: print(f"[watchdog] {m}", flush=True)  # noqa: E731
        self.in_run_dir(exclude.after_another_hands_requeue, self.job_id, self.cfg.run_dir, say, default=None)

    def note_earlier_records(self) -> None:
        """The hang records already in RUN_DIR/hangs/ when this attempt starts: an earlier attempt's. Told by
        what is there, not by their times: each is stamped by its node's clock, and a node whose clock ran a
        minute behind this one's had its record of this attempt taken for an older one's."""
        self.earlier = {p.parent.name for p in (self.cfg.run_dir / "hangs").glob("*/hang.json")}

    def peer_verdicts(self) -> list[Verdict]:
        """The other nodes' hang records of this attempt, from the shared RUN_DIR/hangs/."""
        me, found = node_name(), []
        for record in (self.cfg.run_dir / "hangs").glob("*/hang.json"):
            if record.parent.name in self.earlier:
                continue
            try:
                data = json.loads(record.read_text(encoding="utf-8"))
                v = Verdict(-1, str(data["host"]), str(data["line"]), [int(c) for c in data["culprits"]], float(data["declared_at"]), 0)
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if v.host != me:
                found.append(v)
        return sorted(found, key=lambda v: (not v.culprits, v.declared_at))

    def _another_node_named(self, hang: Hang) -> bool:
        """Another node's watchdog named the culprit (its record in the shared hangs/ folder). Looked for once when the
        step is ending: then this node acts itself (a second requeue of one attempt is told apart: exclude.why_stopped)."""
        deadline = time.time() + ELSEWHERE_WAIT_S
        while not self.run_dir_hung:
            named = [v for v in self.in_run_dir(self.peer_verdicts, default=[]) if v.culprits]
            if named:
                print(f"[watchdog] {named[0].line[:2000]}", flush=True)
                return True
            if self.ending or time.time() >= deadline:
                break
            time.sleep(1.0)
        return False

    def _wait_for_evidence_elsewhere(self) -> None:
        """Until every other node of the job has kept its ranks' stacks (its record), or EVIDENCE_WAIT_S, or the step ends."""
        started = time.time()
        late = os.environ.get("AURA_FAULT_PEER_RECORDS_LATE_S", "")  # tests: the other nodes' records seen this late
        late_s = float(late) if late.isdigit() else 0.0
        while time.time() < started + EVIDENCE_WAIT_S and not self.run_dir_hung and not self.ending:
            if time.time() - started >= late_s and len({v.host for v in self.in_run_dir(self.peer_verdicts, default=[])}) >= self.nodes - 1:
                return
            time.sleep(0.5)

    def _within_budget(self, step: int, count: bool = True) -> tuple[bool, str]:
        """Hangs without progress in a row (kept in the run directory across the job's requeues); `count`:
        this hang is one more (not one another node counted already). An attempt of the job hangs once (the
        requeue ends it): when no node names a culprit, every node acts after ELSEWHERE_WAIT_S, and each
        counted the same hang (3 nodes spent a budget of 2 on one), so an attempt is counted once."""
        path = self.cfg.run_dir / "hangs" / BUDGET_FILE
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            kept = {}
        furthest, in_a_row = int(kept.get("furthest", -1)), int(kept.get("in_a_row", 0))
        budget = self.cfg.health.hang_restarts
        attempt = f"{self.job_id}.{self.restarts}"  # a job submitted again starts its restarts at 0
        if (count or in_a_row == 0) and kept.get("attempt") != attempt:
            in_a_row = 1 if step > furthest else in_a_row + 1
            # Named by host and pid: the nodes share this folder, and containers' pids repeat across nodes.
            tmp = path.with_name(f".{path.name}.{node_name()}.{os.getpid()}")
            body = {"furthest": max(step, furthest), "in_a_row": in_a_row, "attempt": attempt}
            tmp.write_text(json.dumps(body), encoding="utf-8")
            os.replace(tmp, path)
        if in_a_row > budget:
            return False, f"it hung {in_a_row} times in a row without progress (health.hang_restarts={budget})"
        return True, f"hang restart {in_a_row} of at most {budget} in a row without progress"


# What asks the ranks to stop (train/process/stop.py's signals but SIGTERM, which ends the attempt): watched on. SIGQUIT's
# default ended this watch without its `finally`.
STOP_ASKED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)


def main(argv: list[str]) -> int:
    from aura_hpc.config import load_config
    from aura_hpc.train.process import progress

    # Slurm signals every process of the step, this one included. The pre-timeout warning (--signal=USR2@...)
    # or `scancel --signal` asks the ranks to checkpoint and stop: keep watching them do it, a training rank
    # that does not stop being a hang within seconds (as under `local`); by default the signal ended this
    # process. SIGTERM ends the attempt (a requeue, the time limit, scancel): leave through `finally`, which
    # removes the attempt's pages from the node's /dev/shm. Caught first: one that came while this process read
    # the config ended it.
    asked: dict[str, Any] = {"stop": False, "watch": None}

    def stop_asked(*_: object) -> None:
        asked["stop"] = True
        if asked["watch"] is not None:
            asked["watch"].stop_asked = True

    def terminated(*_: object) -> None:
        # Only a flag: the main thread may be inside a print, and a second one from here raises.
        watch = asked["watch"]
        if watch is None or not watch.handling:
            sys.exit(0)
        watch.ending = True

    for sig in STOP_ASKED:
        signal.signal(sig, stop_asked)
    signal.signal(signal.SIGTERM, terminated)
    config, folder, job_id, restarts, task_pid = argv
    try:
        cfg = load_config(config)
        watch = SlurmHangWatch(cfg, Path(folder))
        watch.job_id, watch.restarts = int(job_id), int(restarts)
        watch.nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        watch.calibration = read_calibration(cfg.run_dir / "hang_calibration.json")
        watch.started = time.time()
        watch.note_earlier_records()
        os.environ[progress.ENV] = folder
        asked["watch"] = watch
        watch.stop_asked = watch.stop_asked or asked["stop"]
        return _watch(watch, int(task_pid))
    finally:  # the attempt's pages (ours alone: a folder holding anything else stays)
        if asked["watch"] is not None:
            asked["watch"]._calibration_file.flush()
        progress.remove_pages(Path(folder))
        remove_pipes(Path(folder))
        with contextlib.suppress(OSError):
            Path(folder).rmdir()


def _watch(watch: SlurmHangWatch, task_pid: int) -> int:
    left_at: tuple[float, float] | None = None  # when this node left the hang to another's (and its ranks' newest beat)
    while process_alive(task_pid):
        ranks = watch.read()
        if ranks:
            for r, p in ranks.items():
                watch._learn(r, p)
            if all(p["section"] == "finished" for p in ranks.values()):
                return 0
            now, newest = time.time(), max(p["beat"] for p in ranks.values())
            still = left_at is not None and newest <= left_at[1]  # no rank moved since
            if still and left_at is not None and now - left_at[0] < ELSEWHERE_WAIT_S:
                time.sleep(watch.poll_s)  # the node that named the culprit requeues the job (which ends this task)
                continue
            if now - newest > PEER_POLL_IDLE_S:  # read in RUN_DIR, which may be the mount that hangs
                finished, verdicts = in_time(watch.peer_verdicts, limit=PEER_POLL_IDLE_S)
                watch.peer_hangs = verdicts if finished and isinstance(verdicts, list) else watch.peer_hangs
            if watch.hung(ranks, now, stopping=watch.stop_asked) or watch.named_elsewhere(ranks, now):
                watch.handling = True
                hurry = lambda: watch.ending  # noqa: E731
                hang = investigate_in_time(watch, ranks, hurry)  # its evidence, within a time: RUN_DIR may be a mount that hangs
                print(f"[watchdog] {hang.line}", flush=True)
                sys.stderr.write(f"error: {hang.line}\n")
                # After the record: the other nodes wait for it; py-spy may take 20 s, and it writes into RUN_DIR.
                if not watch.ending:
                    in_time(watch.add_native_stacks, hang, ranks, limit=60.0, until=hurry)
                if watch.act(hang, ranks, alone=still):
                    watch.in_run_dir(record_hang, watch.cfg.run_dir, f"slurm-{watch.job_id}", hang.last_progress, time.time(), default=None)
                    notify(watch, hang)
                    return 0
                if watch.ending:  # another node acts on the hang; this node's step ends
                    return 0
                watch.handling = False
                watch._seen, left_at = {}, (time.time(), newest)
        time.sleep(watch.poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
