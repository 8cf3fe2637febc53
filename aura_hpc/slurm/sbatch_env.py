"""sbatch's input variables (SBATCH_TIMELIMIT, SBATCH_NO_REQUEUE, ...) override the #SBATCH lines of the script it
reads (man sbatch: INPUT ENVIRONMENT VARIABLES). Left in a user's shell, they silently changed the job the dry run
showed: `SBATCH_TIMELIMIT=5` gave a planned 4-hour job 5 minutes, `SBATCH_NO_REQUEUE` took away the requeue that
the pre-timeout signal relies on. The plan wins: the ones that collide with its lines are named and left out.
A shell inside a job holds that job's own SLURM_* variables, which sbatch passes on just as well: they are left
out too."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping

from aura_hpc.errors import shown

# An #SBATCH option of ours -> the variables that override it (or, for GPUs and memory, the request it makes).
_OVERRIDING = {
    "time": ("SBATCH_TIMELIMIT",),
    "partition": ("SBATCH_PARTITION",),
    "account": ("SBATCH_ACCOUNT",),
    "qos": ("SBATCH_QOS",),
    "constraint": ("SBATCH_CONSTRAINT",),
    "exclusive": ("SBATCH_EXCLUSIVE",),
    "gpus-per-node": ("SBATCH_GPUS_PER_NODE", "SBATCH_GPUS", "SBATCH_GRES"),
    "gres": ("SBATCH_GRES",),
    "mem": ("SBATCH_MEM_PER_NODE", "SBATCH_MEM_PER_CPU", "SBATCH_MEM_PER_GPU"),
    "signal": ("SBATCH_SIGNAL",),
    "requeue": ("SBATCH_NO_REQUEUE", "SBATCH_REQUEUE"),
    "job-name": ("SBATCH_JOB_NAME",),
    "output": ("SBATCH_OUTPUT",),
    "error": ("SBATCH_ERROR",),
    "open-mode": ("SBATCH_OPEN_MODE",),
    "array": ("SBATCH_ARRAY_INX",),
}


# Variables that change the planned job whatever its lines say: an array of copies in one run directory, an
# sbatch that blocks until the job ends, per-task GPUs or per-GPU CPUs beside the plan's per-node requests, tasks
# without the submitting environment (a site's SBATCH_EXPORT=NONE in .bashrc: the plan's variables, PYTHONPATH).
_ALWAYS = {
    "SBATCH_ARRAY_INX": "array",
    "SBATCH_WAIT": "wait",
    "SBATCH_GPUS_PER_TASK": "gpus-per-task",
    "SBATCH_CPUS_PER_GPU": "cpus-per-gpu",
    "SBATCH_EXPORT": "export",
}


# Inside a job (an interactive allocation, an array element, a job that submits the next one) the shell holds that
# job's SLURM_* variables, and Slurm overwrites in the new job only those it sets for it: from an array element,
# submitit took the new job for element SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID and waited 60 s for its pickle
# (tried); a requeued job's SLURM_RESTART_COUNT made a new job's first attempt its fourth; srun reads SLURM_NTASKS,
# SLURM_CPUS_PER_TASK and SLURM_MEM_PER_* as its own options. Kept: what a user or a site module sets for the
# clients, which Slurm never sets for a job (SLURM_JWT: the client authenticates with it, not munge; a review read
# them in Slurm 22.05-25.05's source).
_CLIENT_SETTINGS = frozenset(
    {
        "SLURM_CONF", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT", "SLURM_MPI_TYPE", "SLURM_JWT", "SLURM_SACK_KEY", "SLURM_SACK_JWKS",
        "SLURM_DEBUG_FLAGS", "SLURM_EXIT_ERROR", "SLURM_BITSTR_LEN", "SUBMITIT_PREEMPT_SIGNAL",
    }
)  # fmt: skip


def of_the_enclosing_job(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The variables that describe the job this shell is inside (none outside one), which a new job must not inherit."""
    if "SLURM_JOB_ID" not in environ:
        return []
    return sorted(n for n in environ if n.startswith(("SLURM_", "SLURMD_", "SRUN_", "SUBMITIT_")) and n not in _CLIENT_SETTINGS)


def colliding(script: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Each variable set in `environ` that would override a line of `script` (or change the planned job
    whatever its lines), with the option it stands for."""
    options = set(re.findall(r"^#SBATCH --([a-z-]+)", script, re.M))
    found = {name: option for option in sorted(options) for name in _OVERRIDING.get(option, ()) if name in environ}
    return found | {name: option for name, option in _ALWAYS.items() if name in environ and name not in found}


def warnings(script: str, environ: Mapping[str, str] = os.environ) -> list[str]:
    lines = set(re.findall(r"^#SBATCH --([a-z-]+)", script, re.M))
    said = [
        f"{name}={shown(environ[name], 30)} in this shell would "
        + (f"override the script's --{option}" if option in lines else f"add --{option} to the planned job")
        + " (sbatch lets its environment win); submit leaves it out, so the job is the one planned here"
        for name, option in colliding(script, environ).items()
    ]
    if inherited := of_the_enclosing_job(environ):
        array, task = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
        job = f"{array}_{task}" if array.isdigit() and task.isdigit() else environ["SLURM_JOB_ID"]  # as squeue names it
        job = job if job.replace("_", "").isdigit() else shown(job, 30)
        said.append(
            f"this shell is inside Slurm job {job}: its {len(inherited)} SLURM_* variables "
            "(array id, restart count, tasks, memory) would describe that job to the new one; submit leaves them out"
        )
    return said


@contextlib.contextmanager
def left_out(script: str) -> Iterator[None]:
    """sbatch (submitit's, and --test-only) runs inside without the variables that collide with `script`, and
    without those of a job this shell is inside."""
    saved = {name: os.environ.pop(name) for name in [*colliding(script), *of_the_enclosing_job()]}
    try:
        yield
    finally:
        os.environ.update(saved)
