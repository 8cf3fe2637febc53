"""Getting a run directory ready before any worker starts: data, checks, config.yaml."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from aura_hpc.config import RunConfig, embedding_rows, load_run_file
from aura_hpc.errors import ConfigError, DataError, LaunchError
from aura_hpc.launch.run_lock import RunLock, check_free


def builtin_data_dir(cfg: RunConfig) -> Path:
    from aura_hpc.data.corpus import CORPUS_VERSION

    return Path(cfg.output_dir) / "prepared" / f"{CORPUS_VERSION}-bpe{cfg.data.vocab_size}"


def _newest_complete_checkpoint(run_dir: Path) -> Path | None:
    steps = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE.json").is_file())
    return steps[-1] if steps else None


def _file_digest(path: Path) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _check_same_tokenizer(cfg: RunConfig) -> None:
    """Resuming on data prepared with another tokenizer would load embeddings of another vocabulary."""
    ckpt = _newest_complete_checkpoint(cfg.run_dir)
    if ckpt is None or not cfg.data.path:
        return
    theirs = _file_digest(ckpt / "tokenizer" / "tokenizer.json")
    ours = _file_digest(Path(cfg.data.path) / "tokenizer" / "tokenizer.json")
    if theirs is not None and ours is not None and theirs != ours:
        raise DataError(
            f"data.path {cfg.data.path} was prepared with another tokenizer than the one run {cfg.run_dir} was trained with "
            f"(checkpoint {ckpt.name}) (fix: resume with the data the run was trained on, or start a new --run-name)"
        )


def _check_zero_world_size(cfg: RunConfig, world_size: int) -> None:
    """ZeRO partitions resume only at the world size that wrote them: refused here, once, before any worker."""
    import json

    ckpt = _newest_complete_checkpoint(cfg.run_dir)
    if ckpt is None or not cfg.dist.strategy.startswith("zero"):
        return
    try:
        meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the workers verify the checkpoint and say what is wrong with it
    written_on = meta.get("world_size")
    if str(meta.get("strategy", "")).startswith("zero") and isinstance(written_on, int) and written_on != world_size:
        raise ConfigError(
            f"checkpoint {ckpt.name} holds DeepSpeed ZeRO partitions for {written_on} ranks and this run has {world_size}: "
            f"ZeRO checkpoints resume at the world size they were written at (fix: resume on {written_on} processes, or convert "
            "it with DeepSpeed's ds_to_universal; fsdp checkpoints reshard to any world size)"
        )


def _check_resume_compatible(cfg: RunConfig, world_size: int) -> None:
    _check_same_tokenizer(cfg)
    _check_zero_world_size(cfg, world_size)
    old = cfg.run_dir / "config.yaml"
    if not old.exists() or not (cfg.run_dir / "checkpoints").is_dir():
        return
    try:
        previous = load_run_file(old)
    except ConfigError:
        return  # an unreadable old config: the checkpoint's own fingerprint is checked at resume
    if previous.model_fingerprint() != cfg.model_fingerprint():
        raise ConfigError(
            f"run directory {cfg.run_dir} holds checkpoints of a different model shape or data.seq_len "
            "(fix: use a new --run-name, or resume with the original config)"
        )


def preflight_data(cfg: RunConfig, world_size: int) -> None:
    """Data checks that need no GPU: refuse before any worker starts."""
    from aura_hpc.data.prepare import prepare_hint, read_manifest

    path = Path(cfg.data.path)
    if path.is_file():
        out = path.with_name(f"{path.stem}-prepared")
        raise DataError(
            f"data.path {path} is a file; the trainer reads a prepared directory (tokenizer + packed tokens) "
            f"(fix: python -m aura_hpc prepare {path} --out {out}, then --set data.path={out})"
        )
    m = read_manifest(path)
    if m is None:
        raise DataError(f"data.path {path} is not a prepared directory (no manifest.json) (fix: {prepare_hint(path)})")
    vocab = int(m["tokenizer"]["vocab_size"])
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} does not match the data's tokenizer ({vocab}) "
            "(fix: --set model.vocab_size=0 to take it from the data)"
        )
    embedding_rows(cfg.model, vocab)
    from aura_hpc.data.packed import PackedTokens

    PackedTokens(cfg.data.path, cfg.data.seq_len)  # token files present and as long as the manifest says
    check_sample_prompt(cfg, path / "tokenizer")
    t = cfg.train
    sequences = max(0, (int(m["train_tokens"]) - 1) // cfg.data.seq_len)
    effective = t.batch_size * world_size * t.grad_accum
    if sequences < effective and not t.allow_oversubscription:
        raise DataError(
            f"the prepared data has {sequences} training sequences of {cfg.data.seq_len} tokens, fewer than one effective "
            f"batch of {effective} (= {t.batch_size} per device x {world_size} process{'es' if world_size != 1 else ''} x "
            f"{t.grad_accum} accumulation) "
            "(fix: more data, a smaller train.batch_size/data.seq_len, fewer processes, or "
            "--set train.allow_oversubscription=true to repeat the data)"
        )


def prompt_tokens(tokenizer_dir: Path, prompt: str) -> int:
    """How many tokens `prompt` is with the prepared tokenizer (the `tokenizers` library alone: fast to import)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids)


def check_sample_prompt(cfg: RunConfig, tokenizer_dir: Path) -> None:
    """The samples fit the model's context: refused before training, not after it (a crash at the
    final sample used to leave no summary, and every re-run then said 'nothing to do')."""
    t, room = cfg.train, cfg.model.n_positions
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return
    n = prompt_tokens(tokenizer_dir, t.sample_prompt)
    if n + t.sample_tokens > room:
        fix = f"--set train.sample_tokens={room - n}" if n < room else "a shorter train.sample_prompt"
        raise ConfigError(
            f"train.sample_prompt is {n} tokens and train.sample_tokens {t.sample_tokens}: more than model.n_positions "
            f"({room}) (fix: {fix})"
        )


def check_writable(out: Path) -> None:
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise LaunchError(f"output_dir {out} cannot be created: {existing} is a file, not a directory (fix: --output-dir a folder path)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise LaunchError(f"output_dir {out} is not writable ({exc.strerror}) (fix: --output-dir a writable folder)") from None


RUN_DIR_MODE = 0o750


def make_run_dir(path: Path) -> None:
    """A new run directory is readable by its owner and group only: on a shared cluster filesystem the
    weights, configs and logs are not every user's (an existing one keeps the mode its owner chose)."""
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, RUN_DIR_MODE)


def export_webhook_secret(cfg: RunConfig) -> None:
    """A literal health.webhook_url is stored redacted; the workers (local children, or the Slurm job,
    which inherits the submitting environment) read it from this variable instead."""
    from aura_hpc.config.tree import WEBHOOK_SECRET_ENV, is_literal_url

    if is_literal_url(cfg.health.webhook_url) and not cfg.health.webhook_url_env:
        os.environ[WEBHOOK_SECRET_ENV] = cfg.health.webhook_url
    if cfg.health.webhook_url_file and not os.access(cfg.health.webhook_url_file, os.R_OK):
        raise ConfigError(
            f"health.webhook_url_file {cfg.health.webhook_url_file} cannot be read (fix: a readable file holding the URL, "
            "on storage the compute nodes share)"
        )


def ensure_data(cfg: RunConfig, world_size: int) -> None:
    """The built-in corpus prepared when no data.path is given, then the data checks."""
    if not cfg.data.path:
        from aura_hpc.data.prepare import PrepareSpec, prepare

        target = builtin_data_dir(cfg)
        manifest = prepare(PrepareSpec(out_dir=target, builtin=True, vocab_size=cfg.data.vocab_size, val_fraction=0.05))
        if not manifest.get("up_to_date"):
            logging.getLogger("aura_hpc").info("prepared the built-in Spanish corpus in %s", target)
        cfg.data.path = str(target)
    preflight_data(cfg, world_size)


def prepare_run_dir(cfg: RunConfig, world_size: int, lock: bool = False, check_lock: bool = True) -> RunLock | None:
    """Side effects before launch: the built-in data if needed, the run directory, config.yaml.

    Shared by `local` and `submit`, so both refuse the same bad data before any worker starts.
    Nothing in an existing run directory changes until the new run is known to be valid and no
    other trainer holds it; with `lock`, the run lock is taken (and returned) before config.yaml
    is written. LAN nodes other than node 0 pass check_lock=False: node 0 holds the lock.
    """
    check_writable(Path(cfg.output_dir))
    if check_lock:
        check_free(cfg.run_dir)
    ensure_data(cfg, world_size)
    _check_resume_compatible(cfg, world_size)
    export_webhook_secret(cfg)
    try:
        make_run_dir(cfg.run_dir)
        held = RunLock(cfg.run_dir).acquire() if lock else None
        if held is not None:
            _remove_partial_checkpoints(cfg.run_dir / "checkpoints")
        config_path = cfg.run_dir / "config.yaml"
        tmp = config_path.with_suffix(".yaml.tmp")
        tmp.write_text(cfg.to_yaml(), encoding="utf-8")
        tmp.replace(config_path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise LaunchError(
            f"no space left on the disk of {cfg.run_dir} ({exc.strerror}) before training started "
            "(fix: free space there, lower train.keep_last, or use an output_dir on a larger disk)"
        ) from None
    return held


def _remove_partial_checkpoints(root: Path) -> None:
    """Checkpoint folders a crash left half-written (the trainer writes `.tmp-step_*` and renames it
    when complete): removed first, so a disk they filled has room again. Only the lock holder is here."""
    import shutil

    for p in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
        if p.is_dir():
            logging.getLogger("aura_hpc").info("removing partial checkpoint %s left by an interrupted save", p.name)
            shutil.rmtree(p, ignore_errors=True)
