"""The one typed config tree: dataclasses loaded from YAML, overridden from the CLI.

Deliberately free of torch/transformers imports: the CLI loads and validates configs
before deciding whether any heavy machinery is needed at all.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from aura_hpc.errors import ConfigError


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 256
    vocab_size: int = 0  # 0: take the vocabulary size of the prepared data's tokenizer
    dropout: float = 0.0


@dataclass
class DataConfig:
    path: str = ""  # prepared directory; "" = the package's own Spanish corpus
    seq_len: int = 128
    vocab_size: int = 4096  # used only when `local` prepares the built-in corpus


@dataclass
class TrainConfig:
    max_steps: int = 150
    max_tokens: int = 0  # > 0: derive max_steps from a token budget instead
    stop_at: int = 0  # > 0: checkpoint and stop at this step; re-run to continue
    batch_size: int = 8  # sequences per device per micro-step
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15
    schedule: str = "cosine"
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "auto"
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    keep_last: int = 3
    sample_every: int = 0  # 0: only a final sample
    sample_prompt: str = "En un lugar de la Mancha"
    sample_tokens: int = 40
    allow_oversubscription: bool = False
    threads: int = 0  # torch intra-op threads per process; 0 = launcher's OMP_NUM_THREADS
    tune_malloc: bool = True  # CPU training: fixed glibc mmap/trim thresholds (see aura_hpc/malloc_tuning.py)
    nan_rollback_after: int = 3  # consecutive non-finite steps (skipped) before rolling back
    nan_lr_scale: float = 0.5  # multiply the learning rate by this at each rollback (1 = keep)
    nan_max_rollbacks: int = 3  # then stop: the run diverges


@dataclass
class DistConfig:
    backend: str = "auto"
    strategy: str = "ddp"
    timeout_s: int = 600  # collective (all_reduce, barrier) timeout
    init_timeout_s: int = 120  # process-group initialisation timeout


@dataclass
class HealthConfig:
    """Resource monitor and GPU circuit breaker, run in a background thread on one rank per node."""

    monitor_interval_s: float = 0.0  # > 0: sample CPU/RAM/disk/net/GPUs to RUN_DIR/resources/node<N>.jsonl and TensorBoard
    breaker: bool = True  # GPU circuit breaker (acts only where NVML sees GPUs, or with nvml_replay)
    breaker_interval_s: float = 5.0
    temp_margin_c: float = 3.0  # open when a GPU is this close to its slowdown temperature
    throttle_reasons: str = "hw_slowdown,hw_thermal,sw_thermal,hw_power_brake"
    throttle_samples: int = 3  # consecutive throttled samples before opening
    webhook_url: str = ""  # a secret, never logged; "env:VAR" reads it from an environment variable
    webhook_type: str = "generic"  # generic JSON | discord | slack
    webhook_timeout_s: float = 5.0
    webhook_retries: int = 2
    nvml_replay: str = ""  # recorded readings (JSON lines) replayed instead of NVML: tests, incident replays


@dataclass
class SlurmConfig:
    """What `submit` asks Slurm for. Precedence: CLI flags > this section > cluster profile > these defaults."""

    cluster: str = "generic"  # a profile in sbatch_templates/ (name or path)
    nodes: int = 1
    gpus_per_node: int = 0  # 0: a CPU job (gloo); one task per GPU otherwise
    cpus_per_task: int = 0  # 0: Slurm's default
    mem: str = ""  # per node, e.g. 64G; "0" = all of it; "": Slurm's default
    time: str = "01:00:00"  # minutes, HH:MM:SS or D-HH:MM:SS
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclusive: bool = False
    job_name: str = ""  # "": aura-<run_name>
    signal: str = "USR2"  # sent signal_lead_s before the time limit: checkpoint, then requeue
    signal_lead_s: int = 120
    max_requeues: int = 10  # automatic requeues after the pre-timeout signal, then stop
    array_parallelism: int = 0  # sweeps: array elements running at once; 0 = all
    nccl_debug: bool = False  # NCCL_DEBUG=INFO with INIT,NET subsystems, one file per host and pid


@dataclass
class RunConfig:
    run_name: str = "tiny"
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def model_fingerprint(self) -> str:
        """What must match between a checkpoint and the config resuming from it."""
        m = dataclasses.asdict(self.model)
        m.pop("preset")
        m.pop("dropout")
        key = {"model": m, "seq_len": self.data.seq_len}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


CHOICES: dict[str, tuple[str, ...]] = {
    "train.schedule": ("cosine", "linear", "constant"),
    "train.optimizer": ("adamw", "sgd"),
    "train.precision": ("auto", "fp32", "bf16", "fp16", "fp64"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "dist.strategy": ("ddp",),
    "slurm.signal": ("USR2", "USR1", "TERM", "INT", "HUP"),
    "health.webhook_type": ("generic", "discord", "slack"),
}

SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "slurm": SlurmConfig,
    "health": HealthConfig,
}
TOP_LEVEL = ("run_name", "output_dir")
# Keys resolved relative to the config file they appear in.
_PATH_KEYS = {("data", "path")}


def configs_dir() -> Path:
    """Shipped configs: the repo's `configs/` (mapped into the package as aura_hpc.configs)."""
    env = os.environ.get("AURA_HPC_CONFIGS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent / "configs"
    if repo.is_dir():
        return repo
    return Path(str(resources.files("aura_hpc.configs")))


def shipped_configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(configs_dir().glob("*.yaml"))}


def _valid_keys() -> list[str]:
    keys = list(TOP_LEVEL)
    for name, cls in SECTIONS.items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(f"unknown config key '{key}': {hint}valid keys are {', '.join(valid)}")


def _coerce(key: str, value: Any, typ: Any, from_cli: bool) -> Any:
    typ = typ if isinstance(typ, str) else typ.__name__
    fix = f"(fix: --set {key}=<{typ}>)"
    if typ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key} must be true or false, got {value!r} {fix}")
    if typ == "int":
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a whole number, got {value!r} {fix}")
        if isinstance(value, int):
            return value
        try:
            f = float(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key} must be a whole number, got {value!r} {fix}") from None
        if not f.is_integer():
            raise ConfigError(f"{key} must be a whole number, got {value!r} {fix}")
        return int(f)
    if typ == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r} {fix}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r} {fix}") from None
    if typ == "str":
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r} {fix}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {typ}")  # pragma: no cover


def _merge(
    base: dict[str, Any], raw: dict[str, Any], origin: str, base_dir: Path | None, given: dict[str, str] | None = None, label: str = ""
) -> None:
    """Merge `raw` (a YAML mapping) into `base`, rejecting unknown keys and coercing types.

    `given` records, for each key set here, `label` (where it came from: config or cli).
    """
    valid = _valid_keys()
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: a config must be a YAML mapping of sections, got {type(raw).__name__}")
    for top, value in raw.items():
        if top in TOP_LEVEL:
            base[top] = _coerce(top, value, "str", False)
            if given is not None:
                given[top] = label
            continue
        if top not in SECTIONS:
            raise _unknown_key(str(top), valid)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: section '{top}' must be a mapping of keys, got {value!r}")
        types = {f.name: f.type for f in dataclasses.fields(SECTIONS[top])}
        for k, v in value.items():
            dotted = f"{top}.{k}"
            if k not in types:
                raise _unknown_key(dotted, valid)
            v = _coerce(dotted, v, types[k], False)
            if (top, k) in _PATH_KEYS and v and base_dir is not None and not os.path.isabs(v):
                v = str((base_dir / v).resolve())
            base[top][k] = v
            if given is not None:
                given[dotted] = label


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set section.key=value` strings to a nested mapping (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} is not KEY=VALUE (fix: e.g. --set train.lr=3e-4)")
        key, _, text = item.partition("=")
        key = key.strip()
        value: Any = yaml.safe_load(text) if text.strip() else ""
        if isinstance(value, (dict, list)):
            value = text
        if "." in key:
            section, _, name = key.partition(".")
            if section not in SECTIONS or not name:
                raise _unknown_key(key, _valid_keys())
            out.setdefault(section, {})[name] = value
        else:
            out[key] = value
    return out


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (fix: pass an existing file or a preset name)") from None
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" line {line + 1}" if line is not None else ""
        raise ConfigError(
            f"config file {path}{where} is not valid YAML: {getattr(exc, 'problem', exc)} "
            "(fix: check the brackets, quotes and indentation there)"
        ) from None
    return data or {}


def resolve_config_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    shipped = shipped_configs()
    if name_or_path in shipped:
        return shipped[name_or_path]
    raise ConfigError(
        f"config '{name_or_path}' is neither a file nor a shipped preset (fix: use one of {', '.join(shipped)}, or a path to a .yaml file)"
    )


def load_config(
    config: str | None = None,
    overrides: list[str] | None = None,
    output_dir: str | None = None,
    run_name: str | None = None,
    given: dict[str, str] | None = None,
) -> RunConfig:
    """defaults <- model preset <- config file <- --set overrides <- --output-dir/--run-name.

    `given`, when passed, is filled with each key the config file ("config") or the command
    line ("cli") set, so later layers (a cluster profile) know what not to override.
    """
    merged = RunConfig().to_dict()
    file_raw: dict[str, Any] = {}
    base_dir: Path | None = None
    if config:
        path = resolve_config_path(config)
        file_raw = _load_yaml(path)
        base_dir = path.parent.resolve()
    cli_raw = parse_overrides(overrides or [])
    # A model preset names a shipped config whose model section is the base for model keys.
    file_model = (file_raw.get("model") or {}) if isinstance(file_raw, dict) else {}
    preset = (cli_raw.get("model") or {}).get("preset") or (file_model.get("preset") if isinstance(file_model, dict) else None)
    if preset:
        shipped = shipped_configs()
        if str(preset) not in shipped:
            raise ConfigError(f"model.preset '{preset}' is unknown (fix: use one of {', '.join(shipped)})")
        preset_model = _load_yaml(shipped[str(preset)]).get("model") or {}
        _merge(merged, {"model": preset_model}, str(shipped[str(preset)]), None)
    _merge(merged, file_raw, str(config), base_dir, given, "config")
    _merge(merged, cli_raw, "--set", Path.cwd(), given, "cli")
    if output_dir is not None:
        merged["output_dir"] = output_dir
        if given is not None:
            given["output_dir"] = "cli"
    if run_name is not None:
        merged["run_name"] = run_name
        if given is not None:
            given["run_name"] = "cli"
    cfg = from_dict(merged)
    validate(cfg)
    return cfg


def from_dict(d: dict[str, Any]) -> RunConfig:
    return RunConfig(
        run_name=d["run_name"],
        output_dir=d["output_dir"],
        **{name: cls(**d.get(name, {})) for name, cls in SECTIONS.items()},
    )


def load_run_file(path: str | Path) -> RunConfig:
    """A resolved config.yaml from a run directory (already complete; still validated)."""
    merged = RunConfig().to_dict()
    _merge(merged, _load_yaml(Path(path)), str(path), None)
    cfg = from_dict(merged)
    validate(cfg)
    return cfg


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def validate(cfg: RunConfig) -> None:
    """Cross-field checks; each error names the fix."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r} (fix: --set {key}={allowed[0]})")
    m, d, t = cfg.model, cfg.data, cfg.train
    positive = {
        "model.n_layer": m.n_layer,
        "model.n_embd": m.n_embd,
        "model.n_head": m.n_head,
        "model.n_positions": m.n_positions,
        "data.seq_len": d.seq_len,
        "train.batch_size": t.batch_size,
        "train.grad_accum": t.grad_accum,
        "train.keep_last": t.keep_last,
        "train.log_every": t.log_every,
        "train.eval_batches": t.eval_batches,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be greater than 0, got {value} (fix: --set {key}=<positive number>)")
    non_negative = {
        "train.max_tokens": t.max_tokens,
        "train.stop_at": t.stop_at,
        "train.warmup_steps": t.warmup_steps,
        "train.eval_every": t.eval_every,
        "train.checkpoint_every": t.checkpoint_every,
        "train.sample_every": t.sample_every,
        "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip,
        "train.threads": t.threads,
        "model.vocab_size": m.vocab_size,
        "train.sample_tokens": t.sample_tokens,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be 0 or more, got {value} (fix: --set {key}=0)")
    if t.max_steps <= 0 and t.max_tokens <= 0:
        raise ConfigError(f"train.max_steps must be greater than 0, got {t.max_steps} (fix: --set train.max_steps=1000)")
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be greater than 0, got {t.lr} (fix: --set train.lr=3e-4)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be between 0 and 1, got {t.min_lr_ratio} (fix: --set train.min_lr_ratio=0.1)")
    if t.nan_rollback_after < 1:
        raise ConfigError(
            f"train.nan_rollback_after must be at least 1, got {t.nan_rollback_after} (fix: --set train.nan_rollback_after=3)"
        )
    if not 0 < t.nan_lr_scale <= 1:
        raise ConfigError(f"train.nan_lr_scale must be in (0, 1], got {t.nan_lr_scale} (fix: --set train.nan_lr_scale=0.5)")
    if t.nan_max_rollbacks < 0:
        raise ConfigError(f"train.nan_max_rollbacks must be 0 or more, got {t.nan_max_rollbacks} (fix: --set train.nan_max_rollbacks=3)")
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout} (fix: --set model.dropout=0.0)")
    if m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head}) "
            f"(fix: e.g. --set model.n_head={_divisor_near(m.n_embd, m.n_head)})"
        )
    if d.seq_len > m.n_positions:
        raise ConfigError(
            f"data.seq_len ({d.seq_len}) is longer than model.n_positions ({m.n_positions}) "
            f"(fix: --set data.seq_len={m.n_positions} or raise model.n_positions)"
        )
    if m.vocab_size and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size {m.vocab_size} is too small for a byte-level tokenizer (fix: 0 = from data)")
    if not 256 <= d.vocab_size <= 1_000_000:
        raise ConfigError(f"data.vocab_size must be between 256 and 1000000, got {d.vocab_size} (fix: --set data.vocab_size=8192)")
    if t.max_tokens <= 0 and t.warmup_steps >= t.max_steps:
        raise ConfigError(
            f"train.warmup_steps ({t.warmup_steps}) must be smaller than train.max_steps ({t.max_steps}) "
            f"(fix: --set train.warmup_steps={max(0, t.max_steps // 10)})"
        )
    if t.max_tokens <= 0 and t.stop_at > t.max_steps:
        raise ConfigError(f"train.stop_at ({t.stop_at}) is after train.max_steps ({t.max_steps}) (fix: lower train.stop_at)")
    if not _RUN_NAME.match(cfg.run_name):
        raise ConfigError(f"run_name {cfg.run_name!r} must be letters, digits, '.', '_' or '-' (fix: --run-name my-run)")
    if not cfg.output_dir:
        raise ConfigError("output_dir is empty (fix: --output-dir runs)")
    validate_slurm(cfg.slurm)
    h = cfg.health
    if h.monitor_interval_s < 0 or h.breaker_interval_s <= 0:
        raise ConfigError(
            "health.monitor_interval_s must be >= 0 and health.breaker_interval_s > 0 (fix: --set health.breaker_interval_s=5)"
        )
    from aura_hpc.gpu_health import THROTTLE_BITS

    unknown = [r for r in h.throttle_reasons.split(",") if r.strip() and r.strip() not in THROTTLE_BITS]
    if unknown:
        raise ConfigError(f"health.throttle_reasons: unknown {', '.join(unknown)} (fix: a comma list of {', '.join(THROTTLE_BITS)})")
    if h.webhook_url and not (h.webhook_url.startswith(("http://", "https://", "env:"))):
        # The value itself is not echoed: it is a secret.
        raise ConfigError(
            "health.webhook_url must start with http://, https:// or env:VAR (fix: --set health.webhook_url=env:AURA_GPU_WEBHOOK)"
        )


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_minutes(value: str) -> int:
    """Slurm's --time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) to whole minutes, rounded up."""
    m = _SLURM_TIME.match(value.strip())
    if not m:
        raise ConfigError(f"slurm.time {value!r} is not a Slurm time (fix: --time 04:00:00, or minutes like --time 240)")
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    assert a is not None
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + (b or 0) * 60 + c
    elif b is not None:  # M:S
        seconds = a * 60 + b
    else:  # minutes
        seconds = a * 60
    return -(-seconds // 60)


def validate_slurm(s: SlurmConfig) -> None:
    if s.nodes < 1:
        raise ConfigError(f"slurm.nodes must be at least 1, got {s.nodes} (fix: --nodes 1)")
    if s.gpus_per_node < 0:
        raise ConfigError(f"slurm.gpus_per_node must be 0 (CPU job) or more, got {s.gpus_per_node} (fix: --gpus 8, or --gpus 0)")
    if s.cpus_per_task < 0:
        raise ConfigError(f"slurm.cpus_per_task must be 0 (Slurm's default) or more, got {s.cpus_per_task} (fix: --cpus-per-task 8)")
    minutes = slurm_minutes(s.time)
    if minutes < 1:
        raise ConfigError(f"slurm.time {s.time!r} is zero (fix: --time 01:00:00)")
    if s.signal_lead_s < 0 or s.signal_lead_s >= minutes * 60:
        raise ConfigError(
            f"slurm.signal_lead_s ({s.signal_lead_s}) must be between 0 and the time limit ({minutes * 60}s) "
            "(fix: --set slurm.signal_lead_s=120, or a longer --time)"
        )
    if s.max_requeues < 0:
        raise ConfigError(f"slurm.max_requeues must be 0 or more, got {s.max_requeues} (fix: --set slurm.max_requeues=10)")
    if s.array_parallelism < 0:
        raise ConfigError(f"slurm.array_parallelism must be 0 (all) or more, got {s.array_parallelism} (fix: --array-parallelism 4)")
    if s.mem and not re.match(r"^\d+[KMGT]?B?$", s.mem, re.IGNORECASE):
        raise ConfigError(f"slurm.mem {s.mem!r} is not a Slurm memory size (fix: --mem 64G, or --mem 0 for all of a node's memory)")


def _divisor_near(n: int, k: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - k), d))


def max_steps_for(cfg: RunConfig, world_size: int) -> int:
    """The schedule horizon: train.max_steps, or the step count that covers train.max_tokens."""
    t = cfg.train
    if t.max_tokens > 0:
        per_step = t.batch_size * t.grad_accum * world_size * cfg.data.seq_len
        return max(1, -(-t.max_tokens // per_step))
    return t.max_steps
