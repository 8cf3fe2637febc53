"""Which settings may differ between the machines of one run; every other one must be equal everywhere.

`local` and `submit` ranks run in lockstep: a difference in anything that decides a collective
(strategy, logging and checkpoint steps, activation checkpointing under ZeRO-3) or the model makes
the ranks wait for each other until `dist.timeout_s`, or train different models. A parameter-server
worker runs its own loop: how it logs, compiles and checkpoints changes how that PC runs, not the
gradient it sends nor the update the server makes of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from aura_hpc.config.tree import RunConfig

# Each rank's threads and allocator: how fast its own machine runs, nothing another rank sees.
PER_MACHINE = frozenset({"train.threads", "train.tune_malloc"})
# The data settings that decide which tokens each rank reads, in which order; the data section's others say
# where a machine finds them (its path, cache, tokenizer folder), and the manifest's hash compares what it found.
SHARED_DATA = (
    "data.seq_len",
    "data.shuffle_window",
    "data.stream",
    "data.val_fraction",
    "data.shard_mb",
    "data.text_column",
    "data.dataset_subset",
    "data.dataset_split",
    "data.dataset_revision",
)
PER_PS_WORKER = PER_MACHINE | {
    "train.log_every",
    "train.compile",
    "train.fused_optimizer",
    "train.async_checkpoint",
    "train.activation_checkpointing",
}


def shared(cfg: RunConfig, sections: Iterable[str], free: frozenset[str]) -> dict[str, Any]:
    """Every setting of `sections` but the ones `free` lets differ, by dotted name."""
    out: dict[str, Any] = {}
    for section in sections:
        for name, value in dataclasses.asdict(getattr(cfg, section)).items():
            if f"{section}.{name}" not in free:
                out[f"{section}.{name}"] = value
    return out


def shared_data(cfg: RunConfig) -> dict[str, Any]:
    return {key: getattr(cfg.data, key.removeprefix("data.")) for key in SHARED_DATA}
