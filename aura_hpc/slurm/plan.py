"""`submit`, step 1: the job description, built and checked without side effects.

The plan holds everything `--dry-run` prints and `submit` hands to submitit: the resolved
config of each run, the Slurm values with where each came from (CLI > config > cluster
profile > defaults), the setup lines and the exact sbatch script.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aura_hpc.config import RunConfig, SlurmConfig, check_at_world_size, coerce, load_config, slurm_minutes, validate_slurm
from aura_hpc.config.device import validate_for_device
from aura_hpc.config.slurm_checks import ONE_CPU_PER_RANK
from aura_hpc.data.vocab import tokenizer_vocab
from aura_hpc.errors import ConfigError
from aura_hpc.launch.memory import MemoryPlan, check_fits
from aura_hpc.launch.memory import plan as plan_memory
from aura_hpc.ops.disk import filesystem_type, is_network_fs
from aura_hpc.slurm import profiles, sbatch_env, script_safety
from aura_hpc.slurm.containers import ContainerPlan, plan_container

# Filesystems every node of a cluster sees alike.


@dataclass
class RunPoint:
    """One run directory (a sweep has one per point)."""

    cfg: RunConfig
    label: str = ""  # e.g. "train.lr=3e-4" for a sweep point
    swept: frozenset[str] = frozenset()  # the keys this point sets itself (a profile's figure does not replace them)

    @property
    def config_path(self) -> Path:
        return self.cfg.run_dir / "config.yaml"


@dataclass
class SubmitPlan:
    points: list[RunPoint]
    profile: profiles.Profile
    slurm: SlurmConfig
    sources: dict[str, str]  # slurm.* key or output_dir -> cli | config | profile | default
    params: dict[str, Any]  # submitit SlurmExecutor parameters
    folder: Path  # submitit's folder: the batch script, pickles and per-task logs
    script: str  # the exact sbatch script
    env: dict[str, str] = field(default_factory=dict)  # variables the script exports for aura_hpc
    warnings: list[str] = field(default_factory=list)
    prepare_builtin: Path | None = None  # the built-in corpus is prepared here before submitting
    check: bool = False  # `submit --check`: run `check` on every node instead of training
    memory: MemoryPlan | None = None  # per GPU (per task for a CPU job), for the first point
    data_problem: str | None = None  # why `submit` would refuse data.path (shown by --dry-run)
    container: ContainerPlan | None = None  # the image the job runs in (slurm.container), if any
    data_lines: list[str] = field(default_factory=list)  # how the data covers the run (launch/data_plan.py)

    @property
    def python(self) -> str:
        """The command that runs the job's Python (submitit's `python`): the image's, or this interpreter."""
        return self.container.python_command() if self.container is not None else shlex.quote(sys.executable)

    @property
    def tasks_per_node(self) -> int:
        return 1 if self.check else max(1, self.slurm.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.slurm.nodes * self.tasks_per_node

    @property
    def min_world_size(self) -> int:
        """The fewest ranks the job may start with (--nodes MIN:MAX); the world size otherwise."""
        return (self.slurm.min_nodes or self.slurm.nodes) * self.tasks_per_node

    @property
    def nodes_shown(self) -> str:
        least = self.slurm.min_nodes
        return f"{least}-{self.slurm.nodes}" if least and least < self.slurm.nodes else str(self.slurm.nodes)

    @property
    def is_array(self) -> bool:
        return len(self.points) > 1


def parse_sweeps(items: list[str]) -> list[list[str]]:
    """`--sweep train.lr=1e-4,3e-4` (repeatable) -> the override lists of every point (a grid)."""
    axes: list[list[str]] = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or "." not in key or not vals:
            raise ConfigError(f"--sweep {item!r} is not KEY=V1,V2,... (fix: e.g. --sweep train.lr=1e-4,3e-4,1e-3)")
        if key.startswith("slurm.") or key in ("run_name", "output_dir"):
            raise ConfigError(f"--sweep {key}: the points of a sweep share one job array's resources (fix: sweep train/model/data keys)")
        axes.append([f"{key}={v}" for v in vals])
    return [list(p) for p in itertools.product(*axes)] if axes else [[]]


def _point_name(overrides: list[str]) -> str:
    parts = []
    for o in overrides:
        key, _, value = o.partition("=")
        parts.append(f"{key.split('.')[-1]}{value}")
    name = "-".join(parts)
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _check_output_dir(out: str, nodes: int, warnings: list[str]) -> None:
    p = Path(out)
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"output_dir {out} cannot be created: {existing} is a file, not a directory (fix: --output-dir a path under a directory)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"output_dir {out} is not writable by you (fix: --output-dir a shared folder you can write, e.g. /shared/$USER/runs)"
        )
    if nodes > 1 and not is_network_fs(p):
        warnings.append(
            f"output_dir {out} is on a local filesystem ({filesystem_type(existing.resolve())}), not a network one: "
            "with several nodes, every node must see the same checkpoints (use an NFS/Lustre/GPFS path)"
        )


def _check_data(cfg: RunConfig, world: int, nodes: int, warnings: list[str]) -> str | None:
    """What is wrong with the prepared data, if anything (`submit` refuses it, `--dry-run` shows it),
    and whether every node sees it."""
    from aura_hpc.errors import AuraError
    from aura_hpc.launch.run_setup import preflight_data

    try:
        preflight_data(cfg, world)
    except AuraError as exc:
        return str(exc)
    if nodes > 1 and not cfg.data.stream and not cfg.data.path.startswith("s3://") and not is_network_fs(Path(cfg.data.path)):
        warnings.append(
            f"data.path {cfg.data.path} is on a local filesystem ({filesystem_type(Path(cfg.data.path).resolve())}), not a "
            "network one: every node must read the same prepared data (use an NFS/Lustre/GPFS path, or copy it to each node)"
        )
    return None


def _slurm_cli_overrides(flags: dict[str, Any]) -> list[str]:
    out = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        out.append(f"slurm.{key}={'true' if value is True else value}")
    return out


def resolve_slurm(cfg: RunConfig, given: dict[str, str], prof: profiles.Profile) -> tuple[SlurmConfig, dict[str, str]]:
    """CLI > config > profile > defaults, with the source of each value."""
    s = copy.deepcopy(cfg.slurm)
    types = {f.name: f.type for f in dataclasses.fields(SlurmConfig)}
    sources: dict[str, str] = {}
    for name in types:
        key = f"slurm.{name}"
        if key in given:
            sources[name] = given[key]
        elif name in prof.values:
            setattr(s, name, _from_profile(prof, name, types[name]))
            sources[name] = "profile"
            if name == "nodes" and re.fullmatch(r"\d+-\d+", str(prof.values[name]).strip()) and "slurm.min_nodes" not in given:
                s.min_nodes, sources["min_nodes"] = int(str(prof.values[name]).split("-")[0]), "profile"
        else:
            sources.setdefault(name, "default")  # min_nodes may come from the profile's --nodes=MIN-MAX
    validate_slurm(s)
    return s, sources


def _from_profile(prof: profiles.Profile, name: str, typ: Any) -> Any:
    """A profile's #SBATCH value as the setting's type; one that is not names the line and the fix (the message
    read "fix: --set #SBATCH in prof.sh: gpus_per_node=<int>", no command at all)."""
    value = str(prof.values[name]).strip()
    option = next((o for o, k in profiles.SBATCH_TO_KEY.items() if k == name), name)
    if name == "nodes" and re.fullmatch(r"\d+-\d+", value):  # sbatch's --nodes=MIN-MAX
        value = value.split("-")[1]
    try:
        return coerce(f"slurm.{name}", value, typ, False)
    except ConfigError:
        kind = {"int": "a count", "bool": "on or off"}.get(typ if isinstance(typ, str) else typ.__name__, "a value")
        raise ConfigError(
            f"cluster profile {prof.path}: #SBATCH --{option}={value} is not {kind} aura_hpc can plan with "
            f"(fix: edit that line, or override it with --set slurm.{name}=...)"
        ) from None


def plan_submit(
    config: str | None,
    overrides: list[str],
    output_dir: str | None,
    run_name: str | None,
    slurm_flags: dict[str, Any],
    sweeps: list[str] | None = None,
    after: str | None = None,
    check: bool = False,
    force: bool = False,
) -> SubmitPlan:
    """Everything `submit` will do, decided and checked up front; nothing is written or submitted."""
    base_overrides = [*overrides, *_slurm_cli_overrides(slurm_flags)]
    given: dict[str, str] = {}
    cfg = load_config(config, base_overrides, output_dir, run_name, given)
    prof = profiles.load(cfg.slurm.cluster)
    slurm, sources = resolve_slurm(cfg, given, prof)
    if slurm.gpu_type and slurm.gpus_per_node == 0:
        if sources.get("gpu_type") == "profile":  # --gpus 0 on a profile of typed GPUs: a CPU job
            slurm.gpu_type, sources["gpu_type"] = "", sources.get("gpus_per_node", "default")
        else:
            raise ConfigError(
                f"slurm.gpu_type {slurm.gpu_type} asks for GPUs in a CPU job (--gpus 0) "
                f"(fix: --gpus {slurm.gpu_type}:8, or --set slurm.gpu_type=)"
            )
    if "output_dir" in given:
        sources["output_dir"] = given["output_dir"]
    elif prof.output_dir:
        cfg.output_dir = prof.output_dir
        sources["output_dir"] = "profile"
    else:
        sources["output_dir"] = "default"
    warnings: list[str] = []
    # Where sbatch starts the job: `--set output_dir=runs` was taken so, `--output-dir runs` (and the default) refused.
    if not os.path.isabs(cfg.output_dir):
        cfg.output_dir = str((Path.cwd() / cfg.output_dir).resolve())
    _check_output_dir(cfg.output_dir, slurm.nodes, warnings)
    max_gpus = prof.max_gpus_per_node
    if max_gpus is not None and slurm.gpus_per_node > max_gpus:
        raise ConfigError(
            f"--gpus {slurm.gpus_per_node} is more than the {max_gpus} GPUs per node of cluster profile "
            f"'{prof.name}' (fix: --gpus {max_gpus} and more --nodes)"
        )
    if slurm.gpus_per_node == 0 and cfg.dist.backend == "nccl":
        raise ConfigError("dist.backend nccl needs GPUs and this is a CPU job (--gpus 0) (fix: --gpus 8, or --set dist.backend=gloo)")
    if after is not None and not after.replace("_", "").isdigit():
        raise ConfigError(f"--after {after!r} is not a job id (fix: --after 12345, the id `submit` printed)")

    grid = parse_sweeps(sweeps or [])
    points: list[RunPoint] = []
    if check:
        # `check` across the allocation: one task per node, results beside the runs.
        if sweeps:
            raise ConfigError("--check and --sweep do not go together (fix: drop one of them)")
        points.append(RunPoint(cfg, "check"))
        folder = Path(cfg.output_dir) / "checks" / cfg.run_name
        run_dir_env = str(folder)
    elif grid == [[]]:
        points.append(RunPoint(cfg))
        folder = cfg.run_dir / "slurm"
        run_dir_env = str(cfg.run_dir)
    else:
        sweep_dir = Path(cfg.output_dir) / cfg.run_name
        for extra in grid:
            pcfg = load_config(config, [*base_overrides, *extra], str(sweep_dir), _point_name(extra))
            pcfg.slurm = slurm
            same = next((p for p in points if p.cfg.run_dir == pcfg.run_dir), None)
            if same is not None:  # two elements of the array in one run directory: the second fails on its lock
                raise ConfigError(
                    f"--sweep points {same.label!r} and {', '.join(extra)!r} share the run directory {pcfg.run_dir.name} "
                    "(fix: list each value once)"
                )
            points.append(RunPoint(pcfg, ", ".join(extra), frozenset(o.partition("=")[0] for o in extra)))
        folder = sweep_dir / "slurm"
        run_dir_env = str(sweep_dir)
    for p in points:
        for key, value in prof.screen.items():  # what the screen expects of this hardware, unless set
            if f"health.{key}" not in given.keys() | p.swept:
                setattr(p.cfg.health, key, value)
        if p.cfg.data.path and "://" not in p.cfg.data.path:
            p.cfg.data.path = str(Path(p.cfg.data.path).expanduser().resolve())
    for p in points:
        for note in check_at_world_size(p.cfg, slurm.nodes * max(1, slurm.gpus_per_node)):
            if note not in warnings:
                warnings.append(note)
    data_problem = None
    if (points[0].cfg.data.path or points[0].cfg.data.stream) and not check:
        data_problem = _check_data(points[0].cfg, (slurm.min_nodes or slurm.nodes) * max(1, slurm.gpus_per_node), slurm.nodes, warnings)

    env = {"AURA_RUN_DIR": run_dir_env, "PYTHONUNBUFFERED": "1"}
    setup = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    if prof.setup:
        setup += [f"# cluster profile: {prof.path}", *prof.setup]
    if slurm.nccl_debug:
        nccl = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": f"{run_dir_env}/nccl_debug/%h-%p.log"}
        env.update(nccl)
        setup += ["# --nccl-debug", f"mkdir -p {shlex.quote(run_dir_env + '/nccl_debug')}"]
        setup += [f"export {k}={shlex.quote(v)}" for k, v in nccl.items()]

    params: dict[str, Any] = {
        "job_name": slurm.job_name or f"aura-{'check-' if check else ''}{cfg.run_name}",
        "nodes": slurm.nodes,
        "ntasks_per_node": 1 if check else max(1, slurm.gpus_per_node),
        "time": slurm_minutes(slurm.time),
        "signal_delay_s": slurm.signal_lead_s,
        "comment": "aura_hpc",
        # No wckey unless the profile sets one (#SBATCH --wckey): submitit's "submitit" failed sbatch where a site
        # enforces wckeys ("Invalid wckey specification"); without it Slurm takes the user's default.
        "wckey": None,
        "setup": setup,
        # A rank that dies takes the others down at once instead of leaving them in a collective;
        # the per-task logs are appended across requeues, not truncated.
        "srun_args": ["--kill-on-bad-exit=1", "--open-mode=append"],
        "additional_parameters": {**prof.extra_sbatch, "signal": f"{slurm.signal}@{slurm.signal_lead_s}", "requeue": True},
    }
    if slurm.min_nodes and slurm.min_nodes < slurm.nodes and not check:
        # sbatch --nodes=MIN-MAX (submitit's own `nodes` is a count): the ranks learn the world size Slurm gave.
        params["additional_parameters"]["nodes"] = f"{slurm.min_nodes}-{slurm.nodes}"
    if slurm.gpus_per_node:
        # sbatch's own TYPE:N (a typed gres); one task per GPU whatever the type.
        params["gpus_per_node"] = f"{slurm.gpu_type}:{slurm.gpus_per_node}" if slurm.gpu_type else slurm.gpus_per_node
    if slurm.cpus_per_task:
        params["cpus_per_task"] = slurm.cpus_per_task
        # srun no longer inherits sbatch's --cpus-per-task (Slurm 22.05+): each rank got one core, and its
        # OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK threads all ran on it.
        params["srun_args"].append(f"--cpus-per-task={slurm.cpus_per_task}")
    elif slurm.gpus_per_node and not check:
        warnings.append(ONE_CPU_PER_RANK)
    for key in ("mem", "partition", "account", "qos", "constraint", "exclude"):
        if getattr(slurm, key):
            params[key] = getattr(slurm, key)
    if slurm.exclusive:
        params["exclusive"] = True
    if after:
        params["dependency"] = f"afterok:{after}"
    if len(points) > 1:
        params["array_parallelism"] = slurm.array_parallelism or len(points)

    prepare_builtin = None
    if not cfg.data.path and not cfg.data.stream and not check:
        from aura_hpc.launch.run_setup import builtin_data_dir

        prepare_builtin = builtin_data_dir(cfg)
    # The fewest ranks it may start with: the most memory per rank under sharding, the fewest ranks to cover the data.
    world = (slurm.min_nodes or slurm.nodes) * (1 if check else max(1, slurm.gpus_per_node))
    memory = None
    if not check:
        first = points[0].cfg
        validate_for_device(first, slurm.gpus_per_node > 0)
        if first.dist.strategy == "diloco":
            from aura_hpc.config.replicas import check_equal_nodes

            node_counts = range(slurm.min_nodes or slurm.nodes, slurm.nodes + 1)  # --nodes=MIN-MAX: any of them
            check_equal_nodes(first.dist.diloco_replicas, node_counts, max(1, slurm.gpus_per_node))
        zero = next((p.cfg.dist.strategy for p in points if p.cfg.dist.strategy.startswith("zero")), "")  # a sweep's too
        if zero and slurm.min_nodes and slurm.min_nodes < slurm.nodes:
            # A requeue on fewer nodes (a node left out, or fewer free) found shards it cannot load: exit 2, the job over.
            raise ConfigError(
                f"a range of {slurm.min_nodes} to {slurm.nodes} nodes with dist.strategy={zero}: a requeue on another number of "
                "nodes could not resume, as ZeRO's checkpoints load only at the world size that wrote them (fix: exactly "
                f"{slurm.nodes} nodes, --nodes {slurm.nodes} --set slurm.min_nodes=0; or dist.strategy=fsdp, whose "
                "checkpoints load at any world size)"
            )
        vocab = tokenizer_vocab(first)
        memory = plan_memory(first, vocab, world, gpu=slurm.gpus_per_node > 0)
        limit = prof.gpu_mem_gib
        if limit and slurm.gpus_per_node > 0:
            refusal, warning = check_fits(first, vocab, world, limit, force)
            if refusal:
                raise ConfigError(refusal.replace("this cluster's GPUs", f"cluster profile '{prof.name}'s GPUs"))
            if warning:
                warnings.append(warning.replace("their", f"cluster profile '{prof.name}'s"))
    builtin = str(prepare_builtin) if prepare_builtin else ""
    container = plan_container(slurm, cfg.output_dir, points[0].cfg.data.path or builtin, gpus=slurm.gpus_per_node > 0)
    if container is not None:
        params["srun_args"] = [*params["srun_args"], *container.srun_args]
    _check_script_values(params, folder, env, prof)
    python = container.python_command() if container is not None else shlex.quote(sys.executable)
    script = sbatch_script(folder, params, len(points), python)
    script_safety.assert_directives_intact(script, _planned_directives(params, len(points)))
    warnings += sbatch_env.warnings(script)
    plan = SubmitPlan(points, prof, slurm, sources, params, folder, script, env, warnings, prepare_builtin, check, memory)
    plan.data_problem = data_problem
    plan.container = container
    if not check:
        from aura_hpc.launch.data_plan import coverage

        plan.data_lines, data_warnings = coverage(points[0].cfg, world)
        plan.warnings += [w for w in data_warnings if w not in plan.warnings]
    return plan


# submitit parameters that are not #SBATCH options (see submitit.slurm.slurm._make_sbatch_string).
_NOT_DIRECTIVES = {"setup", "srun_args", "signal_delay_s", "additional_parameters", "array_parallelism"}
_CONFIG_KEY_OF = {"job_name": "slurm.job_name", "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos"}


def _check_script_values(params: dict[str, Any], folder: Path, env: dict[str, str], prof: profiles.Profile) -> None:
    """Every value the sbatch script will hold, checked before the script is made (see script_safety)."""
    script_safety.check_path("output_dir", str(folder))
    script_safety.check_text("the Python interpreter's path", sys.executable)
    for key, value in params.items():
        if key in _NOT_DIRECTIVES:
            continue
        script_safety.check_directive(_CONFIG_KEY_OF.get(key, f"slurm.{key}"), value)
    for key, value in params["additional_parameters"].items():
        where = f"#SBATCH --{key} in {prof.path}" if key in prof.extra_sbatch else f"slurm.{key}"
        script_safety.check_directive(where, value)
    for key, value in env.items():
        script_safety.check_text(f"the exported {key}", value)


def _planned_directives(params: dict[str, Any], n_points: int) -> set[str]:
    keys = {k.replace("_", "-") for k, v in params.items() if k not in _NOT_DIRECTIVES and v is not None}
    keys |= {k.replace("_", "-") for k in params["additional_parameters"]}
    keys |= {"signal", "output", "error", "open-mode"} | ({"array"} if n_points > 1 else set())  # (submitit's own)
    return keys


def submitit_command(folder: Path, python: str | None = None) -> str:
    """The job's command line, as submitit's SlurmExecutor writes it (`python`: a container's)."""
    return " ".join([python or shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_script(folder: Path, params: dict[str, Any], n_points: int, python: str | None = None) -> str:
    """The script submitit will submit, produced by submitit's own generator."""
    from submitit.slurm.slurm import _make_sbatch_string

    extra = {"map_count": n_points} if n_points > 1 else {}
    return str(_make_sbatch_string(command=submitit_command(folder, python), folder=folder, **params, **extra))


def describe(plan: SubmitPlan) -> list[tuple[str, str, str]]:
    """(setting, value, source) rows for --dry-run."""
    s = plan.slurm
    rows = [("cluster profile", f"{plan.profile.name} ({plan.profile.path})", plan.sources.get("cluster", "default"))]
    for f in dataclasses.fields(SlurmConfig):
        if f.name == "cluster":
            continue
        value = getattr(s, f.name)
        if f.name == "job_name":
            value = plan.params["job_name"]
        rows.append(
            (f"slurm.{f.name}", str(value) if value not in ("", None) else "(Slurm's default)", plan.sources.get(f.name, "default"))
        )
    rows.append(("output_dir", plan.points[0].cfg.output_dir if not plan.is_array else str(plan.folder.parent), plan.sources["output_dir"]))
    return rows
