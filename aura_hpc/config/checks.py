"""Cross-field checks of a loaded config; every error names the fix."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import unicodedata

from aura_hpc.config.health_checks import validate_health
from aura_hpc.config.slurm_checks import validate_slurm
from aura_hpc.config.tree import (
    CHOICES,
    SECTIONS,
    TOP_LEVEL,
    DataConfig,
    ModelConfig,
    RunConfig,
)
from aura_hpc.errors import BREAKING_CATEGORIES, ConfigError, shown

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# A text prompt may hold newlines and tabs; no other setting may hold errors.BREAKING_CATEGORIES.
_MULTILINE_KEYS = {"train.sample_prompt"}


def line_breaking(value: str, allowed: str = "") -> str | None:
    """The first character of `value` that could start a line or hide one, if any."""
    for c in value:
        if c not in allowed and unicodedata.category(c) in BREAKING_CATEGORIES:
            return c
    return None


def describe_char(c: str) -> str:
    names = {"\n": "line feed", "\r": "carriage return", "\0": "NUL", "\t": "tab"}
    name = unicodedata.name(c, "") or names.get(c, "control character")
    shown = repr(c)[1:-1] if not c.isprintable() else c
    return f"'{shown}' (U+{ord(c):04X} {name.lower()})"


def check_text_value(key: str, value: str) -> None:
    c = line_breaking(value, "\n\t" if key in _MULTILINE_KEYS else "")
    if c is not None:
        raise ConfigError(f"{key} contains the character {describe_char(c)}, which no setting may hold (fix: remove it)")


def _check_text_values(cfg: RunConfig) -> None:
    values = [(k, getattr(cfg, k)) for k in TOP_LEVEL]
    for name in SECTIONS:
        section = getattr(cfg, name)
        values += [(f"{name}.{f.name}", getattr(section, f.name)) for f in dataclasses.fields(section)]
    for key, value in values:
        if isinstance(value, str):
            check_text_value(key, value)


# Upper bounds far above any real run: a value past one is a typo (1e300 for 3e-4) that would
# otherwise surface as an overflow inside a worker, or as the kernel's OOM killer.
LIMITS: dict[str, tuple[float, str]] = {
    "train.lr": (10.0, "3e-4"),
    "train.weight_decay": (10.0, "0.1"),
    "train.grad_clip": (1e6, "1.0"),
    "train.max_steps": (1e10, "1000"),
    "train.max_tokens": (1e15, "1000000000"),
    "train.warmup_steps": (1e9, "100"),
    "train.batch_size": (1e6, "8"),
    "train.grad_accum": (1e6, "1"),
    "train.eval_batches": (1e6, "4"),
    "train.eval_sequences": (1e8, "0"),
    "train.sample_tokens": (1e6, "40"),
    "train.threads": (4096, "0"),
    "model.n_layer": (1024, "12"),
    "model.n_embd": (65536, "768"),
    "model.n_head": (1024, "12"),
    "model.n_positions": (1 << 20, "1024"),
    "model.vocab_size": (1 << 24, "0"),
    "model.padded_vocab_size": (1 << 24, "0"),
    "data.seq_len": (1 << 20, "1024"),
}
MAX_ANY_INT = 10**12  # every other whole-number setting


def _check_ranges(cfg: RunConfig) -> None:
    """Every number finite, and none absurdly large."""
    for name in SECTIONS:
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            key, value = f"{name}.{f.name}", getattr(section, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value} (fix: --set {key}=<number>)")
            top, example = LIMITS.get(key, (MAX_ANY_INT, "<smaller number>"))
            if abs(value) > top:
                raise ConfigError(f"{key} = {value:g} is beyond any real run (at most {top:g}) (fix: --set {key}={example})")
    t = cfg.train
    for key, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {value} (fix: --set {key}={0.9 if key.endswith('1') else 0.95})")


_OTHER_SCHEMES = ("gs://", "gcs://", "az://", "abfs://", "hf://", "http://", "https://", "r2://")


def url_problem(url: str, what: str) -> str | None:
    """What is wrong with a data location given as a URL: a secret in it (it would be written to
    config.yaml and logs), or a scheme we do not read. None for s3://bucket/prefix and local paths."""
    low = url.lower()
    for scheme in _OTHER_SCHEMES:
        if low.startswith(scheme):
            return f"{what} {url.split('?')[0]!r}: {scheme} is not supported (fix: s3://bucket/prefix for object storage)"
    if not url.startswith("s3://"):
        return None
    bucket = url[len("s3://") :].split("/", 1)[0]
    if "@" in bucket or ":" in bucket or "?" in url:
        return (
            f"{what} holds credentials or options in the URL; they would be written to config.yaml and logs "
            "(fix: s3://bucket/prefix, with the keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile)"
        )
    if not bucket:
        return f"{what} {url!r} names no bucket (fix: s3://bucket/prefix)"
    return None


def revision_problem(dataset: str, revision: str | None, setting: str) -> str | None:
    """A revision pins a Hub dataset's commit; a local folder has none to pin (`datasets` ignores one in silence)."""
    if revision and not dataset:
        return f"{setting} {revision!r} pins a Hugging Face dataset's commit, and no dataset is given (fix: drop it)"
    if revision and (os.path.exists(os.path.expanduser(dataset)) or dataset.startswith(("/", ".", "~"))):
        return (
            f"{setting} {revision!r} applies to a dataset on the Hugging Face Hub, and {dataset!r} is a local folder "
            f"(fix: check that revision out in the folder, `git -C {dataset} checkout {revision}`, and drop {setting})"
        )
    return None


def _check_stream(d: DataConfig) -> None:
    if problem := revision_problem(d.dataset, d.dataset_revision, "data.dataset_revision"):
        raise ConfigError(problem)
    if d.dataset and not d.stream:
        raise ConfigError(
            "data.dataset is streamed only with data.stream=true (fix: --set data.stream=true, or prepare it first: "
            f"python -m aura_hpc prepare --dataset {d.dataset} --out DIR)"
        )
    if not d.stream:
        return
    if not d.tokenizer:
        raise ConfigError(
            "data.stream=true needs data.tokenizer, the tokenizer to encode the stream with (fix: --set data.tokenizer=DIR, "
            "a prepared directory or a saved tokenizer folder)"
        )
    if d.dataset and d.path:
        raise ConfigError("data.stream reads data.dataset or data.path, not both (fix: drop one of them)")
    if not d.dataset and not d.path:
        raise ConfigError("data.stream=true needs a source (fix: --set data.path=s3://bucket/raw-text, or data.dataset=NAME)")
    if not 0 < d.val_fraction < 0.5 or d.shard_mb <= 0:
        raise ConfigError("data.val_fraction must be in (0, 0.5) and data.shard_mb above 0 (fix: --set data.val_fraction=0.01)")


def validate(cfg: RunConfig) -> None:
    """Cross-field checks; each error names the fix."""
    from aura_hpc.config.tracking import validate_tracking

    _check_text_values(cfg)
    _check_ranges(cfg)
    validate_tracking(cfg)
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {shown(value)} (fix: --set {key}={allowed[0]})")
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
        "data.cache_gb": d.cache_gb,
        "data.read_tries": d.read_tries,
        "data.read_timeout_s": d.read_timeout_s,
        "dist.timeout_s": cfg.dist.timeout_s,
        "dist.init_timeout_s": cfg.dist.init_timeout_s,
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
        "train.checkpoint_every_s": t.checkpoint_every_s,
        "train.sample_every": t.sample_every,
        "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip,
        "train.threads": t.threads,
        "model.vocab_size": m.vocab_size,
        "model.padded_vocab_size": m.padded_vocab_size,
        "train.sample_tokens": t.sample_tokens,
        "data.shuffle_window": d.shuffle_window,
        "train.seed": t.seed,
        "train.eval_sequences": t.eval_sequences,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be 0 or more, got {value} (fix: --set {key}=0)")
    if t.max_steps <= 0 and t.max_tokens <= 0:
        raise ConfigError(f"train.max_steps must be greater than 0, got {t.max_steps} (fix: --set train.max_steps=1000)")
    if not t.sample_prompt.strip():  # every run ends with a sample: it continues this text
        raise ConfigError("train.sample_prompt is empty: samples continue it (fix: --set train.sample_prompt='En un lugar de la Mancha')")
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
    problem = url_problem(d.path, "data.path") if d.path else None
    if problem:
        raise ConfigError(problem)
    _check_stream(d)
    if m.vocab_size and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size {m.vocab_size} is too small for a byte-level tokenizer (fix: 0 = from data)")
    if not 256 <= d.vocab_size <= 1_000_000:
        raise ConfigError(f"data.vocab_size must be between 256 and 1000000, got {d.vocab_size} (fix: --set data.vocab_size=8192)")
    if t.max_tokens <= 0 and t.stop_at > t.max_steps:
        raise ConfigError(f"train.stop_at ({t.stop_at}) is after train.max_steps ({t.max_steps}) (fix: lower train.stop_at)")
    if not _RUN_NAME.match(cfg.run_name):
        raise ConfigError(
            f"run_name {shown(cfg.run_name)} must be ASCII letters (no accents or ñ), digits, '.', '_' or '-' (fix: --run-name my-run)"
        )
    if not cfg.output_dir:
        raise ConfigError("output_dir is empty (fix: --output-dir runs)")
    validate_strategy(cfg)
    validate_slurm(cfg.slurm)
    validate_ps(cfg)
    validate_health(cfg.health)


def validate_ps(cfg: RunConfig) -> None:
    p = cfg.ps
    if not 1 <= p.port <= 65535:
        raise ConfigError(f"ps.port must be a TCP port (1-65535), got {p.port} (fix: --set ps.port=30005, or ps's --port 30005)")
    if not 1 <= p.workers <= 1024:
        raise ConfigError(f"ps.workers must be between 1 and 1024, got {p.workers} (fix: --set ps.workers=2, or ps's --workers 2)")
    if not 1 <= p.push_every <= 10_000:
        raise ConfigError(f"ps.push_every must be between 1 and 10000, got {p.push_every} (fix: --set ps.push_every=1)")
    if p.max_staleness < 0:
        raise ConfigError(f"ps.max_staleness must be >= 0, got {p.max_staleness} (fix: --set ps.max_staleness=4)")
    if p.join_timeout_s <= 0 or p.worker_timeout_s <= 0:
        raise ConfigError("ps.join_timeout_s and ps.worker_timeout_s must be > 0 (fix: --set ps.worker_timeout_s=120)")


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


def recorded_horizon(cfg: RunConfig) -> int:
    """Under train.max_tokens, the horizon (steps) the run's newest checkpoint recorded for this token budget:
    the one a resume keeps at any world size. 0 when none did (no checkpoint; another budget, a new horizon)."""
    if cfg.train.max_tokens <= 0:
        return 0
    steps = sorted((cfg.run_dir / "checkpoints").glob("step_*/meta.json"))
    try:
        meta = json.loads(steps[-1].read_text()) if steps else {}
        same_budget = int(meta.get("max_tokens", cfg.train.max_tokens)) == cfg.train.max_tokens
        return int(meta.get("max_steps", 0)) if same_budget else 0
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def fit_to_horizon(cfg: RunConfig, world_size: int) -> list[str]:
    """Checks against the schedule's horizon (train.max_steps, or the steps train.max_tokens makes at this
    world size, or recorded when the run started). A warmup as long as the run is clamped with a warning, as torchtitan does (a short
    test run goes on); a stop_at beyond the run is refused. Returns the warnings.

    The clamp itself is the worker's (train/parts/schedule.py), against the horizon it agrees on: a run
    resumed at another world size under train.max_tokens keeps the horizon recorded when it started, and
    its warmup with it (clamping the setting here, at the new world size's horizon, moved the schedule)."""
    t = cfg.train
    horizon = recorded_horizon(cfg) or max_steps_for(cfg, world_size)
    notes = []
    if t.warmup_steps > horizon:
        notes.append(
            f"train.warmup_steps ({t.warmup_steps}) is longer than the run ({horizon} steps): using {horizon} "
            f"(the learning rate rises over the whole run; --set train.warmup_steps={max(0, horizon // 10)} for a decay)"
        )
    if t.stop_at > horizon:
        raise ConfigError(f"train.stop_at ({t.stop_at}) is after the end of the run ({horizon} steps) (fix: lower train.stop_at)")
    return notes


def check_at_world_size(cfg: RunConfig, world_size: int) -> list[str]:
    """What the plans check once the world size is known, before anything starts: the schedule's horizon
    (fit_to_horizon, its warnings returned), and a DeepSpeed JSON's train_batch_size, which only the workers compared,
    after a Slurm queue's wait and the process group's start."""
    notes = fit_to_horizon(cfg, world_size)
    d = cfg.dist
    if d.strategy.startswith("zero") and d.deepspeed_config:
        from aura_hpc.config.deepspeed import deepspeed_config

        deepspeed_config(cfg, world_size, bf16={"bf16": True, "auto": None}.get(cfg.train.precision, False))
    return notes


def embedding_rows(m: ModelConfig, tokenizer_vocab: int) -> int:
    """The tokenizer's vocabulary, or model.padded_vocab_size when set (never fewer rows than tokens)."""
    if m.padded_vocab_size and m.padded_vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.padded_vocab_size {m.padded_vocab_size} is smaller than the data's tokenizer ({tokenizer_vocab} tokens) "
            f"(fix: --set model.padded_vocab_size={-(-tokenizer_vocab // 128) * 128}, or 0 for no padding)"
        )
    return m.padded_vocab_size or tokenizer_vocab


def validate_strategy(cfg: RunConfig) -> None:
    """What each dist.strategy does not support is refused here, with the reason."""
    d, t = cfg.dist, cfg.train
    if d.compress != "none" and d.strategy != "ddp":
        raise ConfigError(
            f"dist.compress={d.compress} compresses DDP's gradient all-reduce; dist.strategy is {d.strategy} "
            "(fix: --set dist.strategy=ddp, or dist.compress=none)"
        )
    if not 1 <= d.powersgd_rank <= 1024:
        raise ConfigError(f"dist.powersgd_rank must be between 1 and 1024, got {d.powersgd_rank} (fix: --set dist.powersgd_rank=4)")
    if d.sync_every < 1 or d.diloco_replicas < 0:
        raise ConfigError("dist.sync_every must be at least 1 and dist.diloco_replicas 0 or more (fix: --set dist.sync_every=50)")
    if not 0 <= d.diloco_overlap < d.sync_every:
        raise ConfigError(
            f"dist.diloco_overlap={d.diloco_overlap} must be 0 or more and below dist.sync_every={d.sync_every}: a meeting must "
            f"land before the next begins (fix: --set dist.diloco_overlap={d.sync_every // 10})"
        )
    if not 0 < d.outer_lr <= 10 or not 0 <= d.outer_momentum < 1:
        raise ConfigError(
            f"dist.outer_lr must be in (0, 10] and dist.outer_momentum in [0, 1), got {d.outer_lr} and {d.outer_momentum} "
            "(fix: the paper's --set dist.outer_lr=0.7 --set dist.outer_momentum=0.9)"
        )
    zero = d.strategy.startswith("zero")
    if d.strategy != "ddp" and t.precision == "fp16":
        raise ConfigError(
            f"train.precision fp16 is not supported with dist.strategy={d.strategy} (its loss scaling is DDP's GradScaler) "
            "(fix: --set train.precision=bf16)"
        )
    if t.precision == "fp16" and d.compress == "powersgd":
        # GradScaler's routine overflow steps (at the start, and after each doubling of the scale) compress inf
        # gradients: PowerSGD keeps them in its error feedback and warm-start factors, every later step is NaN and
        # skipped, the scale halves to nothing, and the loss stays flat with no word (the overflow is the scaler's).
        raise ConfigError(
            "dist.compress=powersgd with train.precision fp16: fp16's overflow steps put inf into PowerSGD's error feedback, "
            "which turns every later step into NaN (fix: --set train.precision=bf16 on a GPU that has it, or "
            "--set dist.compress=bf16)"
        )
    if t.precision == "fp16" and t.loss == "chunked":
        raise ConfigError(
            "train.loss=chunked with fp16: the chunked loss computes its gradients in the forward pass, before fp16's loss "
            "scaling, and small probabilities underflow to zero (fix: --set train.loss=auto, which uses the full logits under "
            "fp16, or train.precision=bf16 on a GPU that has it)"
        )
    if zero and t.precision == "fp64":
        raise ConfigError(f"DeepSpeed ({d.strategy}) does not train in fp64 (fix: --set train.precision=fp32, or dist.strategy=fsdp)")
    if d.strategy == "zero3" and t.compile == "true":
        raise ConfigError(
            "train.compile=true with zero3: DeepSpeed's parameter gathering hooks and per-block compilation are not "
            "supported together here (fix: --set train.compile=auto, which leaves it off under zero3)"
        )
    if d.deepspeed_config and not zero:
        raise ConfigError(
            f"dist.deepspeed_config is used only by zero1/zero2/zero3, and dist.strategy is {d.strategy} "
            "(fix: --set dist.strategy=zero2, or drop dist.deepspeed_config)"
        )
    if d.zero_offload_optimizer and not zero:
        raise ConfigError(f"dist.zero_offload_optimizer needs dist.strategy zero1/2/3, not {d.strategy} (fix: --set dist.strategy=zero2)")
    if d.fsdp_cpu_offload and d.strategy != "fsdp":
        raise ConfigError(f"dist.fsdp_cpu_offload needs dist.strategy=fsdp, not {d.strategy} (fix: --set dist.strategy=fsdp)")
    if zero and d.deepspeed_config:
        from aura_hpc.config.deepspeed import deepspeed_config

        # Conflicts with what the trainer sets are named before launch; under precision auto, bf16 is decided by
        # the workers' GPUs (each checks the JSON's bf16.enabled again then).
        deepspeed_config(cfg, None, bf16={"bf16": True, "auto": None}.get(cfg.train.precision, False))


def too_few_sequences(cfg: RunConfig, sequences: int, world: int) -> str | None:
    """The refusal of a run whose data holds less than one effective batch (None when it does, or
    when the user asked to repeat the data)."""
    t = cfg.train
    effective = t.batch_size * world * t.grad_accum
    if sequences >= effective or t.allow_oversubscription:
        return None
    return (
        f"the prepared data has {sequences} training sequences of {cfg.data.seq_len} tokens, fewer than one effective "
        f"batch of {effective} (= {t.batch_size} per device x {world} process{'es' if world != 1 else ''} x "
        f"{t.grad_accum} accumulation) "
        "(fix: more data, a smaller train.batch_size/data.seq_len, fewer processes, or "
        "--set train.allow_oversubscription=true to repeat the data)"
    )
