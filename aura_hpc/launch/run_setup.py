"""Getting a run directory ready before any worker starts: data, checks, config.yaml."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from aura_hpc.config import RunConfig, embedding_rows, load_run_file
from aura_hpc.errors import ConfigError, DataError, LaunchError


def builtin_data_dir(cfg: RunConfig) -> Path:
    from aura_hpc.data.corpus import CORPUS_VERSION

    return Path(cfg.output_dir) / "prepared" / f"{CORPUS_VERSION}-bpe{cfg.data.vocab_size}"


def _check_resume_compatible(cfg: RunConfig) -> None:
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
    from aura_hpc.data.prepare import read_manifest

    m = read_manifest(Path(cfg.data.path))
    if m is None:
        raise DataError(
            f"data.path {cfg.data.path} is not a prepared directory (no manifest.json) "
            f"(fix: python -m aura_hpc prepare FILES --out {cfg.data.path})"
        )
    vocab = int(m["tokenizer"]["vocab_size"])
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} does not match the data's tokenizer ({vocab}) "
            "(fix: --set model.vocab_size=0 to take it from the data)"
        )
    embedding_rows(cfg.model, vocab)
    from aura_hpc.data.packed import PackedTokens

    PackedTokens(cfg.data.path, cfg.data.seq_len)  # token files present and as long as the manifest says
    t = cfg.train
    sequences = max(0, (int(m["train_tokens"]) - 1) // cfg.data.seq_len)
    effective = t.batch_size * world_size * t.grad_accum
    if sequences < effective and not t.allow_oversubscription:
        raise DataError(
            f"the prepared data has {sequences} training sequences of {cfg.data.seq_len} tokens, fewer than one effective "
            f"batch of {effective} (= {t.batch_size} per device x {world_size} processes x {t.grad_accum} accumulation) "
            "(fix: more data, a smaller train.batch_size/data.seq_len, fewer processes, or "
            "--set train.allow_oversubscription=true to repeat the data)"
        )


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise LaunchError(f"output_dir {out} is not writable ({exc.strerror}) (fix: --output-dir a writable folder)") from None


def prepare_run_dir(cfg: RunConfig, world_size: int) -> None:
    """Side effects before launch: the built-in data if needed, the run directory, config.yaml.

    Shared by `local` and `submit`, so both refuse the same bad data before any worker starts.
    """
    check_writable(Path(cfg.output_dir))
    if not cfg.data.path:
        from aura_hpc.data.prepare import PrepareSpec, prepare

        target = builtin_data_dir(cfg)
        manifest = prepare(PrepareSpec(out_dir=target, builtin=True, vocab_size=cfg.data.vocab_size, val_fraction=0.05))
        if not manifest.get("up_to_date"):
            logging.getLogger("aura_hpc").info("prepared the built-in Spanish corpus in %s", target)
        cfg.data.path = str(target)
    preflight_data(cfg, world_size)
    _check_resume_compatible(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    config_path = cfg.run_dir / "config.yaml"
    tmp = config_path.with_suffix(".yaml.tmp")
    tmp.write_text(cfg.to_yaml(), encoding="utf-8")
    tmp.replace(config_path)
