"""What a resume checks before it takes a checkpoint: that it fits this run (optimizer, strategy, precision,
sample order, data), and that rank 0's is the newest any node holds. Each refusal is one line with its fix."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.config import RunConfig
from aura_hpc.errors import CheckpointError
from aura_hpc.train.checkpoint import files as checkpoint

log = logging.getLogger("aura_hpc")


def same_kind(chosen: str, meta: dict[str, Any], field: str, ours: str | None) -> None:
    """The checkpoint's optimizer (its state) and, when sharded, its strategy (its shards) are this run's."""
    was = meta.get(field)
    if ours is not None and was and was != ours:
        setting = {"strategy": "dist.strategy", "optimizer": "train.optimizer"}[field]
        raise CheckpointError(
            f"checkpoint {chosen} was written with {setting}={was} and this run uses {ours}: its saved state does not fit "
            f"(fix: resume with --set {setting}={was}, or a new --run-name)"
        )


def order_settings(cfg: RunConfig) -> dict[str, Any]:
    """The settings of the sample order samples_seen counts along (checked by _same_settings at a resume), and
    the learning rate the optimizer's state was scaled from (a resume with another scales it: apply_settings)."""
    return {"seed": cfg.train.seed, "shuffle_window": cfg.data.shuffle_window, "train_lr": cfg.train.lr}


def same_data(chosen: str, meta: dict[str, Any], ours: Any, said: bool) -> bool:
    """Whether the checkpoint was trained on this data. Other data (a corpus prepared again, a stream's files edited)
    is not refused: going on over new text is a use. But the position is only a count of samples, now in another
    order, and a stream's piece sizes learned then are not these pieces'; it is said at the resume, with what it costs."""
    theirs, ours = str(meta.get("data_sha256") or ""), str(ours or "")  # a manifest's value is not trusted to be text
    if not theirs or not ours or theirs == ours:
        return True
    if said:
        log.warning(
            "checkpoint %s was trained on other data (data_sha256 %s, this data's %s): the run goes on at sample %s of this "
            "data's order, so some of its sequences may train twice and others never, and its validation split may now hold text "
            "already trained on (eval_loss reads low) (fix: for an exact resume, the data the "
            "checkpoint was trained on: the same prepared folder, or a stream's files as they were and the release that "
            "started the run, as a release of 2026-12-03 streams consecutive small files as one piece)",
            chosen, theirs[:12], ours[:12], meta["samples_seen"],
        )  # fmt: skip
    return False


def same_settings(chosen: str, meta: dict[str, Any], cfg: RunConfig) -> None:
    """The optimizer whose state the checkpoint holds, and the sample order samples_seen counts along: another
    seed or shuffle window trains some sequences twice."""
    same_kind(chosen, meta, "optimizer", cfg.train.optimizer)
    for field, setting, ours in (
        ("seed", "train.seed", cfg.train.seed),
        ("shuffle_window", "data.shuffle_window", cfg.data.shuffle_window),
    ):
        if meta.get(field) is not None and meta[field] != ours:
            raise CheckpointError(
                f"checkpoint {chosen} was written with {setting}={meta[field]} and this run uses {ours}: the sample order "
                f"differs, so the rest of the epoch would train some sequences twice and others never (fix: resume with "
                f"--set {setting}={meta[field]}, or a new --run-name)"
            )


def same_precision(chosen: str, meta: dict[str, Any], strategy: str, bf16: bool) -> None:
    """DeepSpeed names a ZeRO checkpoint's optimizer files by precision (`bf16_zero_pp_rank_*` under bf16) and
    its fallback to the other name never runs (engine.py: `_get_all_zero_checkpoint_names` returns a list, not
    None): a run that trained in bf16 and resumes in fp32 (`train.precision=auto` on GPUs without bf16, a LAN
    node without it, or fp32 chosen to chase NaNs) met a missing file as a traceback on every rank."""
    was = meta.get("bf16")
    if not strategy.startswith("zero") or was is None or bool(was) == bf16:
        return
    then, now = ("bf16", "fp32") if was else ("fp32", "bf16")
    raise CheckpointError(
        f"checkpoint {chosen} was written by DeepSpeed ZeRO training in {then} and this run trains in {now}: DeepSpeed "
        f"names its optimizer files by precision, so it cannot read them (fix: resume with --set train.precision={then} on "
        f"GPUs that have it, or start a new --run-name)"
    )


def newest_elsewhere(root: Path, main_newest: int | None, is_main: bool) -> None:
    """Every rank's newest complete checkpoint against rank 0's, on every rank (one gather): where the nodes keep
    their own output_dir (LAN machines), rank 0 resumes from its own folder, and a newer checkpoint on another
    machine (the run's node 0 before, started now with another --node-rank) was passed over: the run began
    again from an older step, or from step 0, unsaid."""
    ours = -1 if main_newest is None else main_newest
    try:  # rank 0 listed its folder already
        mine = ours if is_main else max((c.step for c in checkpoint.list_complete(root)), default=-1)
    except OSError:
        mine = -1  # this rank's own folder unreadable: rank 0's listing decides, as before
    theirs = collectives.gather_json([mine, socket.gethostname(), str(root)])
    ahead = [(rank, int(step), str(host)[:64], str(where)[:300]) for rank, (step, host, where) in enumerate(theirs) if int(step) > ours]
    if not ahead:
        return
    rank, step, host, where = max(ahead, key=lambda a: a[1])
    has = f"step {main_newest}" if main_newest is not None else "none"
    raise CheckpointError(
        f"rank {rank} on {host} holds checkpoint step {step} in {where}, newer than rank 0's newest ({has}): node 0 resumes "
        f"from its own output_dir and would pass it over (fix: start node 0 (--node-rank 0) on {host}, or copy that "
        f"checkpoints/ folder to node 0's output_dir; or, if it is from an older run of this name, remove it there)"
    )
