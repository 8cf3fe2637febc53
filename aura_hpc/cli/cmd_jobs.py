"""`status`, `logs`, `cancel`, `history`: following submitted jobs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _job_rows(rows: list[dict[str, object]]) -> list[list[str]]:
    def fmt(v: object, spec: str = "") -> str:
        if v is None or v == "":
            return "-"
        return format(v, spec) if spec and isinstance(v, (int, float)) else str(v)

    return [
        [
            fmt(r["job_id"]),
            fmt(r["name"]),
            fmt(r["state"]),
            fmt(r["nodes"]),
            fmt(r["elapsed"]),
            fmt(r["time_left"]),
            fmt(r["reason"]),
            fmt(r["step"]),
            fmt(r["loss"], ".4f"),
            fmt(r["tokens_per_s"], ",.0f"),
            fmt(r["run_dir"]),
        ]
        for r in rows
    ]


def cmd_status(a: argparse.Namespace) -> int:
    import json

    from aura_hpc import console
    from aura_hpc.launch.run_status import goodput_note, is_local_run, local_status
    from aura_hpc.slurm.commands import latest_metrics, status

    if a.target and is_local_run(a.target):  # started with `local`: no Slurm involved
        run_dir = Path(a.target)
        rows, notes = [local_status(run_dir, latest_metrics(run_dir.resolve()))], []
        notes += [n for n in [goodput_note(run_dir.resolve(), rows[0]["state"])] if n]
    elif a.target:
        rows, notes = status(a.target, a.all)
    else:  # the local runs here, and the Slurm jobs when a Slurm answers
        from aura_hpc.errors import AuraError

        here = Path("runs")
        local_runs = sorted(d for d in here.iterdir() if d.is_dir() and is_local_run(d)) if here.is_dir() else []
        rows = [local_status(d, latest_metrics(d.resolve())) for d in local_runs]
        try:
            slurm_rows, notes = status(None, a.all)
            rows += slurm_rows
        except AuraError as exc:
            notes = [f"no Slurm jobs: {exc}"]  # with its fix: on a laptop that says Slurm is not here
            if not rows:
                notes.insert(0, "no runs under ./runs (fix: `python -m aura_hpc status RUN_DIR` for a run elsewhere)")
    if a.json:
        print(json.dumps({"jobs": rows, "notes": notes}, indent=2))
        return 0
    columns = ["job", "name", "state", "nodes", "elapsed", "left", "reason", "step", "loss", "tokens/s", "run dir"]
    if rows:
        console.grid("aura_hpc jobs", columns, _job_rows(rows))
    for n in notes:
        console.info(n)
    return 0


def cmd_logs(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.launch.run_status import is_local_run, local_log, no_stderr_note
    from aura_hpc.slurm.commands import absent_log_note, follow_log, log_file

    if is_local_run(a.target):
        if a.stderr and (note := no_stderr_note(Path(a.target), a.rank)) is not None:
            console.info(note)
            return 0
        path = local_log(Path(a.target), a.rank, a.stderr)
        if a.follow:
            _follow_local(path, console.plain)
        else:
            console.plain(path.read_text(encoding="utf-8", errors="replace").rstrip("\n"))
        return 0
    if a.follow:
        return follow_log(a.target, a.rank, a.stderr, console.plain, console.info)
    _, path = log_file(a.target, a.rank, a.stderr)
    if not path.exists():
        console.info(absent_log_note(a.target, a.rank, a.stderr))
        return 0
    console.plain(path.read_text(encoding="utf-8", errors="replace").rstrip("\n"))
    return 0


def _follow_local(path: Path, printer: Any) -> None:
    """A local run's rank log as it grows, until its trainer lets go of the run directory."""
    import time

    from aura_hpc.launch.run_status import local_status
    from aura_hpc.slurm.submit import print_new_lines

    offset = 0
    while True:
        offset = print_new_lines(path, offset, printer)
        if local_status(path.parent.parent, {})["state"] not in ("RUNNING", "STOPPING"):
            print_new_lines(path, offset, printer, final=True)
            return
        time.sleep(0.5)


def cmd_cancel(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.launch.run_status import is_local_run, local_status
    from aura_hpc.slurm.commands import cancel

    if is_local_run(a.target):
        from aura_hpc.errors import LaunchError

        row = local_status(Path(a.target), {})
        holder = row["holder"]
        if row["state"] == "STOPPING":
            raise LaunchError(row["reason"])
        if not holder:
            raise LaunchError(f"{a.target} is a `local` run, not a Slurm job, and nothing runs there now: nothing to cancel")
        raise LaunchError(
            f"{a.target} is a `local` run, not a Slurm job (fix: Ctrl-C in its terminal, or `kill {holder['pid']}` on "
            f"{holder['host']}: it writes a checkpoint and stops)"
        )
    job_id = cancel(a.target)
    console.info(f"cancelled job {job_id} (ranks get SIGTERM: they write a checkpoint at the next step if there is time)")
    return 0


def cmd_history(a: argparse.Namespace) -> int:
    import json
    import time

    from aura_hpc import console
    from aura_hpc.errors import AuraError
    from aura_hpc.launch.run_status import is_local_run, local_config, local_status
    from aura_hpc.slurm.commands import history, latest_metrics

    # The runs `local` left under ./runs (all of them: --since is sacct's), then the Slurm jobs where a Slurm answers.
    here = Path("runs")
    rows: list[dict[str, object]] = []
    for d in sorted(d for d in here.iterdir() if d.is_dir() and is_local_run(d)) if here.is_dir() else []:
        row = local_status(d, latest_metrics(d.resolve()))
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(Path(str(local_config(d))).stat().st_mtime))
        rows.append({**row, "exit_code": "-", "submit": started, "requeues": "-"})
    notes = []
    try:
        rows += history(a.since, a.all)
    except AuraError as exc:
        if not rows:
            raise  # nothing to show at all: Slurm's problem is the one line, with its fix
        notes.append(f"no Slurm jobs: {exc}")
    if a.json:
        print(json.dumps({"jobs": rows, "notes": notes}, indent=2, default=str))
        return 0
    cols = ["job", "name", "state", "exit", "nodes", "elapsed", "submitted", "requeues", "run dir"]
    keys = ["job_id", "name", "state", "exit_code", "nodes", "elapsed", "submit", "requeues", "run_dir"]
    if rows:
        console.grid(f"runs under ./runs and Slurm jobs since {a.since}", cols, [[str(r.get(k) or "-") for k in keys] for r in rows])
    for n in notes:
        console.info(n)
    return 0


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "status",
        help="your aura_hpc jobs (squeue; sacct for finished ones), or the local runs under ./runs",
        description="Without a target: the local runs under ./runs (RUNNING, STOPPING, COMPLETED, STOPPED), and your aura_hpc Slurm jobs "
        "when a Slurm is reachable. With a job id or a run directory: that one's state, step, loss and tokens/s.",
    )
    p.add_argument("target", nargs="?", help="a job id or a run directory (default: all your aura_hpc jobs)")
    p.add_argument("--all", action="store_true", help="also your jobs not started by aura_hpc")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "logs",
        help="one rank's log of a Slurm job or a local run",
        description="Print (or follow with -f) one rank's log of a Slurm job or of a local run directory.",
    )
    p.add_argument("target", help="a job id or a run directory")
    p.add_argument("--rank", type=int, default=0, help="which rank (default 0)")
    p.add_argument("--stderr", action="store_true", help="the rank's stderr instead of stdout")
    p.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing until the job ends, then say how (exit status: the job's, 0 if it COMPLETED)",
    )
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser(
        "cancel",
        help="cancel a job (scancel)",
        description="Cancel a Slurm job by id or run directory (scancel); for a local run it says how to stop it (Ctrl+C, or the PID).",
    )
    p.add_argument("target", help="a job id or a run directory")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser(
        "history",
        help="your past runs: local ones under ./runs, Slurm jobs (sacct)",
        description="The local runs under ./runs (state, step, run directory) and your aura_hpc Slurm jobs since --since "
        "(sacct): state, elapsed, nodes, requeues, run directory.",
    )
    p.add_argument("--since", default="now-7days", help="sacct start time, e.g. 2026-11-01 or now-2days (default now-7days)")
    p.add_argument("--all", action="store_true", help="also your jobs not started by aura_hpc")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_history)
