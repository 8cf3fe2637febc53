"""`prepare --submit`: the same prepare as a chain of Slurm jobs, for a corpus one machine would
take hours over. Submitted with submitit from the login node:

    1. tokenizer   one task: the tokenizer, trained once on the sample (or loaded)
    2. encode      an array of --nodes tasks (after 1): task k encodes pieces k, k+N, k+2N, ...
                   with --workers processes each, into the shared build folder
    3. finish      one task (after every task of 2): the manifest, and the swap into place

Every stage is the resumable local prepare restricted to its part, so a failed or cancelled task
loses only its unfinished pieces: submitting again (or a plain `prepare` of the same inputs)
redoes just those, and nothing is trained on before stage 3 wrote the manifest. --out must be on
storage every node shares (NFS, Lustre); the build folder is its hidden sibling.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aura_hpc.data import out_dir
from aura_hpc.data.prepare import PrepareSpec, encode_jobs, input_key, make_tokenizer, plan_pieces, prepare, resolve_inputs
from aura_hpc.errors import DataError, LaunchError


@dataclass(frozen=True)
class PrepareJobs:
    tokenizer: str
    encode: str  # the array's job id
    finish: str
    logs: Path


def run_stage(spec: PrepareSpec, stage: str, task: int = 0, tasks: int = 1) -> str:
    """One stage, on a compute node (what each submitted job runs)."""
    from aura_hpc.data import shards
    from aura_hpc.data.tokenizer import read_saved

    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    files = [] if (spec.builtin or spec.dataset) else resolve_inputs(spec.inputs)
    key = input_key(spec, files)
    out = Path(spec.out_dir)
    build = out_dir.build_name(out, key)
    if stage == "finish":
        m = prepare(spec)  # finds the tokenizer and every piece done: writes the manifest and swaps
        return f"prepared {out}: {m['train_tokens']:,} train / {m['val_tokens']:,} validation tokens in {len(m['shards'])} shards"
    if not build.is_dir():
        raise DataError(f"the build folder {build} is missing: is --out on storage every node shares? (fix: an NFS/Lustre --out)")
    pieces = plan_pieces(spec, files)
    if stage == "tokenizer":
        make_tokenizer(spec, pieces, build / "tokenizer")
        return f"tokenizer ready in {build / 'tokenizer'} ({len(pieces)} pieces to encode)"
    tok = read_saved(build / "tokenizer")
    mine = encode_jobs(spec, pieces, build, tok)[task::tasks]
    shards.encode_all(mine, max(1, spec.workers), 0)
    return f"task {task} of {tasks}: encoded {len(mine)} piece(s)"


def submit(spec: PrepareSpec, nodes: int, partition: str | None, time_min: int, account: str | None) -> PrepareJobs:
    """Check on the login node (nothing is queued when the inputs or --out are refused), then submit the chain."""
    from aura_hpc.slurm import query as slurm_query

    if spec.max_tokens:
        raise DataError(
            "--max-tokens reads the pieces in order and cannot be split over an array (fix: drop it, or prepare without --submit)"
        )
    if str(spec.out_dir).startswith("s3://"):
        raise DataError(
            "--submit builds on storage the nodes share; s3:// is not (fix: --out on NFS, then upload, or prepare without --submit)"
        )
    if nodes < 1:
        raise DataError(f"--nodes must be at least 1, got {nodes} (fix: --nodes 4)")
    from aura_hpc.slurm import script_safety

    # What reaches the jobs' #SBATCH lines, checked as `submit` checks its own (nothing made yet).
    script_safety.check_directive("--partition", partition)
    script_safety.check_directive("--account", account)
    script_safety.check_path("--out", str(Path(spec.out_dir).expanduser().resolve()))
    script_safety.check_text("the Python interpreter's path", sys.executable)
    slurm_query.require("sbatch")
    slurm_query.require_config()
    files = [] if (spec.builtin or spec.dataset) else resolve_inputs(spec.inputs)
    key = input_key(spec, files)
    out = Path(spec.out_dir).expanduser().resolve()  # a link followed, as prepare() does: the finish job's build is the array's
    spec.out_dir = out
    from aura_hpc.data.prepare import existing_manifest, input_folders

    existing, damaged = existing_manifest(out, spec.force)
    if existing and existing.get("input_key") == key and not spec.force:
        raise DataError(f"{out} is already prepared from these inputs (fix: nothing to do; --force to redo)")
    local = [f for f in files if isinstance(f, Path)]
    folders = [] if spec.builtin or spec.dataset else input_folders(spec.inputs)
    out_dir.check_out_dir(out, local, folders, existing, spec.force, damaged)
    out.parent.mkdir(parents=True, exist_ok=True)
    for note in out_dir.clean_leftovers(out, key):
        print(note)
    build = out_dir.build_name(out, key)
    build.mkdir(exist_ok=True)
    # Marked as built by Slurm jobs, not by this process: a later prepare on this host neither
    # removes it as a dead build nor waits for this process; the finish job takes it over.
    (build / out_dir.MARKER).write_text(json.dumps({"host": "slurm-jobs", "pid": os.getpid(), "created": time.time()}))
    logs = out.parent / f".{out.name}.slurm"
    import submitit

    ex = submitit.SlurmExecutor(folder=logs, python=sys.executable)
    params: dict[str, Any] = {"nodes": 1, "ntasks_per_node": 1, "cpus_per_task": max(1, spec.workers), "time": time_min}
    params["job_name"] = "aura-prepare"
    params["wckey"] = None  # not submitit's "submitit": refused where a site enforces wckeys (as `submit`)
    params["srun_args"] = [f"--cpus-per-task={params['cpus_per_task']}"]  # srun does not inherit it (Slurm 22.05+)
    if partition:
        params["partition"] = partition
    if account:
        params["account"] = account
    quiet = contextlib.redirect_stderr(io.StringIO())
    from aura_hpc.slurm import sbatch_env

    for line in sbatch_env.warnings(""):
        print(f"warning: {line}")
    try:
        with quiet, sbatch_env.left_out(""):  # a job's SLURM_* variables, where this runs inside one
            ex.update_parameters(**params)
            tok = ex.submit(run_stage, spec, "tokenizer")
            ex.update_parameters(
                **params,
                additional_parameters={"dependency": f"afterok:{tok.job_id}", "kill_on_invalid_dep": "yes"},
                array_parallelism=nodes,
            )
            array = ex.map_array(run_stage, [spec] * nodes, ["encode"] * nodes, list(range(nodes)), [nodes] * nodes)
            array_id = str(array[0].job_id).split("_")[0]
            ex.update_parameters(
                **params, additional_parameters={"dependency": f"afterok:{array_id}", "kill_on_invalid_dep": "yes"}, array_parallelism=1
            )
            fin = ex.submit(run_stage, spec, "finish")
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError, OSError) as exc:
        raise LaunchError(
            f"sbatch refused the prepare jobs: {str(exc).strip().splitlines()[-1][:200]} (fix: check --partition/--time)"
        ) from None
    return PrepareJobs(str(tok.job_id), array_id, str(fin.job_id), logs)


# How long an ended job's result file may take to appear here: written on a node, read over NFS, whose folder cache
# (acdirmax, 60 s by default) keeps a file missing for up to a minute after it was written.
RESULT_LAG_S = 90.0


def wait(jobs: PrepareJobs) -> str:
    """Block until the finish job ends; its result line, or a LaunchError with the failed job's last words, or with
    the job of the chain that will not start unless someone acts (held, or asking what the cluster never grants). The end
    is read from the queue (slurm/submit.py's watch), not from submitit's watcher, which asks the accounting alone: on
    a cluster without it ("accounting storage is disabled"), a finish job that ended without its result (cancelled
    after a failed or cancelled tokenizer or encode job: kill_on_invalid_dep) kept the wait going for ever."""
    import submitit

    from aura_hpc.slurm.submit import watch

    said: list[str] = []  # why the finish job will not start, where it will not (held, or behind a job that is)
    row = watch([jobs.finish], printer=said.append)[jobs.finish]
    if said:
        raise LaunchError(f"prepare {said[-1]}")
    fin = submitit.SlurmJob(folder=jobs.logs, job_id=jobs.finish)
    fix = "submitting again redoes only the unfinished pieces"
    if not _appears(fin.paths.result_pickle, fin.paths.stdout):  # submitit's result() would wait for it for ever
        failed = _first_failure(jobs)
        state = row.state if row else "no longer known to Slurm"  # CANCELLED after an earlier job failed, not "exit 1"
        why = f"; {failed}" if failed else ""
        raise LaunchError(
            f"prepare job {jobs.finish} did not end with its result ({state}{why}) (fix: see the logs in "
            f"{jobs.logs}: a failed or cancelled tokenizer or encode job cancels the jobs after it; {fix})"
        )
    try:
        return str(fin.result())
    except Exception as exc:  # submitit raises the job's own error, with its log
        raise LaunchError(f"prepare job {jobs.finish} failed: {_last_words(exc)} (fix: see the logs in {jobs.logs}; {fix})") from None


def _appears(result: Path, started: Path) -> bool:
    """Whether a job's result file is there, given time to cross NFS where the job started (wrote its log)."""
    deadline = time.monotonic() + RESULT_LAG_S
    while True:
        with contextlib.suppress(OSError):  # a folder's changed attribute refreshes NFS's cache of it (as submitit does)
            result.parent.chmod(result.parent.stat().st_mode)
        if result.exists():
            return True
        if not started.exists() or time.monotonic() > deadline:
            return False
        time.sleep(1)


def _first_failure(jobs: PrepareJobs) -> str:
    """The first earlier job of the chain that left an error: its id and last words ("" when none did)."""
    import submitit

    # The encode array's elements (ARRAY_INDEX_TASK_result.pkl) in index order: by name, element 10 came before 2.
    named = {p.name.rsplit("_", 2)[0] for p in jobs.logs.glob(f"{jobs.encode}_*_*_result.pkl")}
    elements = sorted((j for j in named if j.rsplit("_", 1)[1].isdigit()), key=lambda j: int(j.rsplit("_", 1)[1]))
    for job_id in [jobs.tokenizer, *elements]:
        job = submitit.SlurmJob(folder=jobs.logs, job_id=job_id)
        if not job.paths.result_pickle.exists():
            continue
        try:
            job.result()
        except Exception as exc:
            return f"job {job_id} failed: {_last_words(exc)}"
    return ""


def _last_words(exc: Exception) -> str:
    """A submitit error's cause: the last line of the job's traceback, not of its message (the log's path)."""
    text = str(exc).strip()
    parts = [p for p in text.split("----------------------") if p.strip()]
    trace = parts[1] if len(parts) >= 3 else text  # message, traceback, where the logs are
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]
