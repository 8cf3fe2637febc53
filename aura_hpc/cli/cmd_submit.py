"""`submit`: the plan (`--dry-run` prints it), then submitit; `--wait`/`--follow`."""

from __future__ import annotations

import argparse

from aura_hpc.cli.common import add_run_options, show_plan
from aura_hpc.errors import EXIT_USER_ERROR


def cmd_submit(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.slurm.plan import describe, plan_submit

    least, most = _node_range(a.nodes)
    gpu_type, gpus = _gpus(a.gpus)
    flags = {
        "nodes": most,
        "min_nodes": least,
        "gpus_per_node": gpus,
        "gpu_type": gpu_type,
        "cpus_per_task": a.cpus_per_task,
        "mem": a.mem,
        "time": a.time,
        "partition": a.partition,
        "account": a.account,
        "qos": a.qos,
        "constraint": a.constraint,
        "exclude": a.exclude,
        "exclusive": a.exclusive,
        "job_name": a.job_name,
        "cluster": a.cluster,
        "nccl_debug": a.nccl_debug,
        "array_parallelism": a.array_parallelism,
        "container": a.container,
        "container_image": a.container_image,
        "container_mounts": a.container_mounts,
        "container_workdir": a.container_workdir,
    }
    plan = plan_submit(a.config, a.overrides, a.output_dir, a.run_name, flags, a.sweep, a.after, check=a.check, force=a.force)
    if plan.data_problem and not a.dry_run:  # refused in one line: warnings matter only for a run that goes on
        from aura_hpc.errors import DataError

        raise DataError(plan.data_problem)
    for w in plan.warnings:
        console.warn(w)
    if a.dry_run:
        console.heading("aura_hpc submit --dry-run: nothing is written or submitted")
        console.grid("settings (cli > config > profile > default)", ["setting", "value", "from"], [list(r) for r in describe(plan)])
        for p in plan.points:
            console.info(f"run directory: {p.cfg.run_dir}" + (f"  ({p.label})" if p.label else ""))
        world = f"{plan.min_world_size}-{plan.world_size}" if plan.min_world_size < plan.world_size else str(plan.world_size)
        console.info(f"tasks: {plan.nodes_shown} node(s) x {plan.tasks_per_node} task(s) = world size {world}")
        if not plan.check:
            show_plan(plan.points[0].cfg, plan.world_size, plan.memory, plan.profile.gpu_mem_gib if plan.slurm.gpus_per_node else None)
            for line in plan.data_lines:
                console.info(line)
        if plan.data_problem:
            console.warn(f"submit would refuse this: {plan.data_problem}")
        if plan.prepare_builtin:
            console.info(f"data: the built-in Spanish corpus would be prepared in {plan.prepare_builtin}")
        console.info("environment: sbatch exports your current environment (Slurm's default), plus the script's exports:")
        for k, v in plan.env.items():
            console.plain(f"  {k}={v}")
        console.info(f"sbatch script ({plan.folder / '<jobid>_submission.sh'}):")
        console.plain(plan.script)
        return EXIT_USER_ERROR if plan.data_problem else 0  # the run's status: a script gating on the dry run stops here
    from aura_hpc.slurm import submit as submitting

    ids = submitting.submit(plan, warn=console.warn)
    if plan.check:
        console.info(f"submitted check job {ids[0]} on {plan.slurm.nodes} node(s); logs in {plan.folder}")
        status = submitting.wait(ids, submitting.rank_log(plan.folder, ids[0]), printer=console.plain)
        return status
    for p, job_id in zip(plan.points, ids, strict=True):
        console.info(f"submitted job {job_id}: {p.cfg.run_dir}" + (f"  ({p.label})" if p.label else ""))
    console.info(f"follow it: python -m aura_hpc status {ids[0]}   |   python -m aura_hpc logs {ids[0]} --follow")
    if not (a.wait or a.follow):
        return 0
    log = submitting.rank_log(plan.folder, ids[0]) if a.follow else None
    final = submitting.watch(ids, log, printer=console.plain)
    queued = [j for j, row in final.items() if row is not None and row.active]  # will not start unless someone acts
    ended = {j: final[j] for j in ids if j not in queued}
    if ended:
        code = submitting.exit_status(ended)
        console.info(f"job{'s' if len(ended) > 1 else ''} {', '.join(ended)} ended: {'COMPLETED' if code == 0 else f'exit status {code}'}")
    if queued:
        console.info(f"job{'s' if len(queued) > 1 else ''} {', '.join(queued)} still queued; the wait ends here (why: above)")
    return submitting.exit_status(final)


def _profiles() -> list[str]:
    """The shipped cluster profiles' names (the folder's listing: no import of the Slurm code)."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "sbatch_templates"
    if not here.is_dir():
        here = Path(__file__).resolve().parents[1] / "sbatch_templates"
    return sorted(p.stem for p in here.glob("*.sh")) or ["generic"]


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "submit",
        help="submit the trainer to Slurm (submitit)",
        description="Generate and submit the Slurm job with submitit: one task per GPU (one per node with --gpus 0). "
        "Slurm values: CLI > the config's slurm section > the cluster profile > defaults (shown by --dry-run).",
    )
    add_run_options(p)
    p.add_argument("--cluster", "--profile", dest="cluster", help=f"a profile from sbatch_templates/ ({', '.join(_profiles())}) or a file")
    p.add_argument(
        "--nodes",
        "--nnodes",
        dest="nodes",
        help="number of nodes, or MIN:MAX: the job starts on as many as Slurm gives between them (spares to leave a bad node out)",
    )
    p.add_argument(
        "--gpus",
        "--nproc-per-node",
        dest="gpus",
        metavar="[TYPE:]N",
        help="GPUs per node, e.g. 8 or h100:8 (a typed gres); one task per GPU (0: a CPU job with gloo)",
    )
    p.add_argument("--cpus-per-task", type=int, help="CPUs per task (rank)")
    p.add_argument("--mem", help="memory per node, e.g. 64G (0 = all)")
    p.add_argument("--time", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--qos", help="quality of service")
    p.add_argument("--constraint", help="node features, e.g. h100")
    p.add_argument("--exclusive", action="store_true", default=None, help="whole nodes only")
    p.add_argument("--exclude", help="nodes the job never runs on, e.g. gpu[07-08] (a requeue adds those it leaves out)")
    p.add_argument("--job-name", help="Slurm job name (default: aura-<run name>)")
    p.add_argument("--nccl-debug", action="store_true", default=None, help="NCCL_DEBUG=INFO (INIT,NET), one file per host in the run dir")
    p.add_argument("--container", choices=["none", "pyxis", "apptainer"], help="run the job in a container (default: the profile's)")
    p.add_argument("--container-image", help="pyxis: registry image or .sqsh; apptainer: .sif file or docker:// URI")
    p.add_argument("--container-mounts", help="/host:/container[:ro],... (output_dir and data.path at their own paths)")
    p.add_argument("--container-workdir", help="working directory inside the container")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2", help="a job array over these values (repeatable: a grid)")
    p.add_argument("--array-parallelism", type=int, help="sweep elements running at once (default: all)")
    p.add_argument("--after", metavar="JOBID", help="start only after this job completed successfully (afterok)")
    p.add_argument("--dry-run", action="store_true", help="print the settings and the exact sbatch script; submit nothing")
    p.add_argument("--force", action="store_true", help="submit even when the memory plan says it will not fit the GPUs")
    p.add_argument("--check", action="store_true", help="run `check` on every node of such an allocation instead of training")
    p.add_argument("--wait", action="store_true", help="block until the job ends; the exit status is the job's")
    p.add_argument("--follow", action="store_true", help="like --wait, streaming rank 0's log")
    p.set_defaults(func=cmd_submit)


def _gpus(given: str | None) -> tuple[str | None, int | None]:
    """--gpus 8 or h100:8 (sbatch's --gpus-per-node=TYPE:N) -> (type or None, count or None)."""
    if given is None:
        return None, None
    from aura_hpc.errors import ConfigError
    from aura_hpc.slurm.profiles import gpu_request

    asked = gpu_request(given)
    if asked is None:
        raise ConfigError(f"--gpus {given!r} is not a GPU count (fix: --gpus 8, or --gpus h100:8 for a GPU type of the cluster's gres)")
    return asked[0] or None, int(asked[1])


def _node_range(given: str | None) -> tuple[int | None, int | None]:
    """--nodes 4 or 2:4 (torchrun's form; Slurm's 2-4 too) -> (min or None, max)."""
    if given is None:
        return None, None
    from aura_hpc.errors import ConfigError

    parts = given.replace("-", ":").split(":")
    if not all(p.strip().isdigit() for p in parts) or len(parts) > 2:
        raise ConfigError(f"--nodes {given!r} is not a node count (fix: --nodes 4, or --nodes 2:4 to start on 2 to 4 nodes)")
    if len(parts) == 1:
        return None, int(parts[0])
    if int(parts[0]) < 1:  # Slurm reads a minimum of 0 as "exactly the maximum"
        raise ConfigError(f"--nodes {given!r} starts at 0 nodes (fix: --nodes 1:{parts[1]})")
    return int(parts[0]), int(parts[1])
