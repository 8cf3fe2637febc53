"""The hang watchdog of a Slurm job: one per node, beside the node's tasks (started by slurm/job.py).

The same watchdog as `local`'s (launch/hang_watch.py: the ranks' progress pages, timeouts calibrated
from the run, every rank's stack before anything is killed, the culprit named, RUN_DIR/hangs/). What
differs is the act: there is no agent here to start the workers again, so the watchdog asks Slurm
to requeue the job (it resumes from its newest checkpoint, as after a pre-timeout signal), then kills
its node's ranks, which ends the job step. A hang that comes back without progress counts against
health.hang_restarts; past it, the job is not requeued, and the line says why.

Only the node that names a culprit acts. A node whose ranks all wait for a peer elsewhere leaves it to
that node's watchdog (its verdict appears in the shared RUN_DIR/hangs/), and acts itself only when
none appears within ELSEWHERE_WAIT_S (a culprit stuck outside any watchdog's view).

    python -m aura_hpc.slurm.watch CONFIG PROGRESS_DIR JOB_ID RESTART_COUNT TASK_PID
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aura_hpc.launch.goodput import record_hang
from aura_hpc.launch.hang_evidence import remove_pipes
from aura_hpc.launch.hang_watch import Hang, HangWatch, process_alive, read_calibration
from aura_hpc.ops import excluded_nodes
from aura_hpc.slurm import exclude
from aura_hpc.train.process.dist_env import node_name

ELSEWHERE_WAIT_S = 60.0
BUDGET_FILE = "slurm_hang_restarts.json"


class SlurmHangWatch(HangWatch):
    job_id: int = 0
    restarts: int = 0

    def act(self, hang: Hang, ranks: dict[int, dict[str, Any]]) -> bool:
        """Requeue (within budget) and kill this node's ranks; False when another node acts."""
        if not hang.culprits and self._another_node_named(hang):
            return False
        requeue, why = self._within_budget(hang.progress_step)
        if hang.culprits and self.cfg.health.hang_exclude_node:
            ranks_named = ", ".join(map(str, hang.culprits))
            excluded_nodes.record(self.cfg.run_dir, node_name(), f"rank {ranks_named} hung there")
        if requeue:
            print(f"[watchdog] requeuing job {self.job_id} after the hang: it resumes from its newest checkpoint ({why})", flush=True)
            exclude.outlive_the_requeue()
            done = subprocess.run(["scontrol", "requeue", str(self.job_id)], capture_output=True, text=True)
            if done.returncode > 0:
                reason = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
                print(f"[watchdog] scontrol requeue {self.job_id} failed: {reason} (fix: resubmit the same command)", flush=True)
            if done.returncode <= 0:
                exclude.apply_after_requeue(self.job_id, self.cfg.run_dir, lambda m: print(f"[watchdog] {m}", flush=True))
        else:
            print(f"[watchdog] not requeued: {why} (fix: see the hang's line and stacks, then resubmit)", flush=True)
        self.kill(ranks)
        return True

    def _another_node_named(self, hang: Hang) -> bool:
        """Another node's watchdog named the culprit (its record in the shared hangs/ folder)."""
        deadline = time.time() + ELSEWHERE_WAIT_S
        me = node_name()
        while time.time() < deadline:
            for record in (self.cfg.run_dir / "hangs").glob("*/hang.json"):
                try:
                    data = json.loads(record.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                if data.get("host") != me and data.get("culprits") and float(data.get("declared_at", 0)) > self.started:
                    print(f"[watchdog] {data.get('line', '')[:2000]}", flush=True)
                    return True
            time.sleep(1.0)
        return False

    def _within_budget(self, step: int) -> tuple[bool, str]:
        """Hangs without progress in a row (kept in the run directory across the job's requeues)."""
        path = self.cfg.run_dir / "hangs" / BUDGET_FILE
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            kept = {}
        furthest, in_a_row = int(kept.get("furthest", -1)), int(kept.get("in_a_row", 0))
        in_a_row = 1 if step > furthest else in_a_row + 1
        budget = self.cfg.health.hang_restarts
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"furthest": max(step, furthest), "in_a_row": in_a_row}), encoding="utf-8")
        os.replace(tmp, path)
        if in_a_row > budget:
            return False, f"it hung {in_a_row} times in a row without progress (health.hang_restarts={budget})"
        return True, f"hang restart {in_a_row} of at most {budget} in a row without progress"


def main(argv: list[str]) -> int:
    from aura_hpc.config import load_config
    from aura_hpc.train.process import progress

    config, folder, job_id, restarts, task_pid = argv
    cfg = load_config(config)
    watch = SlurmHangWatch(cfg, Path(folder))
    watch.job_id, watch.restarts = int(job_id), int(restarts)
    watch.calibration = read_calibration(cfg.run_dir / "hang_calibration.json")
    watch.started = time.time()
    os.environ[progress.ENV] = folder
    try:
        return _watch(watch, int(task_pid))
    finally:  # the attempt's pages (ours alone: a folder holding anything else stays)
        for page in Path(folder).glob("rank*"):
            page.unlink(missing_ok=True)
        remove_pipes(Path(folder))
        with contextlib.suppress(OSError):
            Path(folder).rmdir()


def _watch(watch: SlurmHangWatch, task_pid: int) -> int:
    while process_alive(task_pid):
        ranks = watch.read()
        if ranks:
            for r, p in ranks.items():
                watch._learn(r, p)
            if all(p["section"] == "finished" for p in ranks.values()):
                return 0
            if watch.hung(ranks, time.time()):
                hang = watch.investigate(ranks)
                print(f"[watchdog] {hang.line}", flush=True)
                sys.stderr.write(f"error: {hang.line}\n")
                if watch.act(hang, ranks):
                    record_hang(watch.cfg.run_dir, f"slurm-{watch.job_id}", hang.last_progress, time.time())
                    watch.notify(hang)
                    return 0
                watch._seen = {}
        time.sleep(watch.poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
