"""How the data covers a run, said before it starts (`local`/`submit` and their --dry-run): the
sequences the run reads against those the data holds (epochs), and a validation split too small
to measure anything. Reads the manifest only: nothing is downloaded or tokenized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aura_hpc.errors import DataError

TINY_VALIDATION = 32  # sequences: below this an eval_loss moves more with the batch than with the model


def _manifest(cfg: Any) -> dict[str, Any] | None:
    from aura_hpc.data import storage

    path = cfg.data.path
    if not path:
        from aura_hpc.launch.run_setup import builtin_data_dir

        path = str(builtin_data_dir(cfg))
    try:
        if storage.is_remote(path):
            return storage.read_manifest(path, storage.Policy(tries=cfg.data.read_tries, timeout_s=cfg.data.read_timeout_s))
        where = Path(path) / "manifest.json"
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    except DataError:  # from storage (a damaged manifest's own class too): the preflight says it in full
        return None
    from aura_hpc.data.manifest import check_manifest

    return check_manifest(manifest, str(where))  # a folder anyone could write: its values become counts here


def _sequences(manifest: dict[str, Any], split: str, seq_len: int) -> tuple[int, int]:
    """(sequences, tokens) of a split, counted as the trainer cuts them (per shard)."""
    shards = manifest.get("shards") or [{"split": s, "tokens": int(manifest.get(f"{s}_tokens", 0))} for s in ("train", "val")]
    mine = [int(s["tokens"]) for s in shards if s["split"] == split]
    return sum(max(0, (n - 1) // seq_len) for n in mine), sum(mine)


def coverage(cfg: Any, world: int) -> tuple[list[str], list[str]]:
    """(lines to show, warnings) about the data of a run at this world size; a run the data cannot
    fill one batch of is refused here, before its warnings are shown."""
    from aura_hpc.config import max_steps_for

    t, d = cfg.train, cfg.data
    per_step = t.batch_size * world * t.grad_accum
    steps = max_steps_for(cfg, world)
    needed = steps * per_step
    if d.stream:
        return [f"data: streamed from {d.dataset or d.path}; its size is known only as it is read ({needed:,} sequences needed)"], []
    manifest = _manifest(cfg)
    if manifest is None:
        what = "the built-in Spanish corpus, prepared at the first run" if not d.path else f"{d.path} (not readable now)"
        return [f"data: {what}; this run reads {needed:,} sequences of {d.seq_len} tokens"], []
    n_train, train_tokens = _sequences(manifest, "train", d.seq_len)
    n_val, val_tokens = _sequences(manifest, "val", d.seq_len)
    from aura_hpc.config.checks import too_few_sequences

    refusal = too_few_sequences(cfg, n_train, world)
    if refusal:
        raise DataError(refusal)
    lines, warnings = [], []
    if n_train:
        epochs = needed / n_train
        repeat = f" (each sequence is seen about {epochs:.1f} times)" if epochs > 1.05 else ""
        lines.append(
            f"data: {n_train:,} training sequences of {d.seq_len} tokens ({train_tokens:,} tokens); {steps:,} steps x {per_step} "
            f"sequences = {needed:,} sequences = {epochs:.2f} epochs{repeat}"
        )
    wanted = t.eval_sequences or t.eval_batches * t.batch_size
    used = min(wanted, n_val)
    lines.append(f"validation: {n_val:,} sequence{'s' if n_val != 1 else ''}; each evaluation reads {used:,}")
    # Each input file is a piece of its own, and a piece's tokens short of one more sequence are dropped: small
    # files lose much of their text, and their validation tokens (a few per file) may add up to no sequence at all.
    small_files = "each input file is prepared on its own, and its tokens short of a whole sequence are dropped"
    # Data prepared before prepare joined small shards (data/prepare.py:_join_small).
    join = f"prepare it again with this release, which joins the small files' shards, or a smaller data.seq_len than {d.seq_len}"
    fix = "prepare again with a larger --val-fraction, e.g. 0.05, or more text"
    if val_tokens // d.seq_len >= 2 * max(n_val, 1) and n_val < TINY_VALIDATION:
        fix = join
    if n_val == 0:
        warnings.append(
            f"the validation split holds no complete sequence of {d.seq_len} tokens: no eval_loss will be computed (fix: {fix})"
        )
    elif n_val < TINY_VALIDATION:
        warnings.append(
            f"the validation split is tiny: {n_val} sequence{'s' if n_val != 1 else ''} of {d.seq_len} tokens, so eval_loss will be "
            f"noise (fix: {fix})"
        )
    if fix == join:
        warnings.append(f"validation: {val_tokens:,} tokens give {n_val} sequence(s): {small_files}")
    if train_tokens and n_train * d.seq_len < 0.9 * train_tokens:
        warnings.append(
            f"{1 - n_train * d.seq_len / train_tokens:.0%} of the {train_tokens:,} training tokens are in no sequence of "
            f"{d.seq_len}: {small_files} (fix: {join})"
        )
    return lines, warnings
