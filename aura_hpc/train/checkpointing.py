"""Saving, resuming and rolling back a run, agreed by every rank (the files themselves: checkpoint.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from aura_hpc.config import RunConfig
from aura_hpc.errors import CheckpointError, TrainingError
from aura_hpc.train import checkpoint, distributed
from aura_hpc.train.dist_env import DistEnv
from aura_hpc.train.runtime import Runtime, rng_state, set_rng_state
from aura_hpc.train.schedule import scale_learning_rate
from aura_hpc.train.state import Layout, Parts, Position

log = logging.getLogger("aura_hpc")


class Checkpointer:
    def __init__(self, cfg: RunConfig, env: DistEnv, rt: Runtime, parts: Parts, layout: Layout, pos: Position) -> None:
        self.cfg, self.env, self.rt = cfg, env, rt
        self.parts, self.layout, self.pos = parts, layout, pos
        self.root = cfg.run_dir / "checkpoints"

    # ---- resume -------------------------------------------------------------------------
    def resume(self) -> None:
        """Every rank resumes from the newest valid checkpoint that rank 0 sees.

        Ranks that cannot read it themselves (LAN machines without shared storage) receive it
        from rank 0 over the process group.
        """
        chosen = self.newest_name()
        if chosen is None:
            if self.env.is_main:
                log.info("no checkpoint in %s: starting from step 0", self.root)
            return
        samples_seen = self.load(chosen)
        self.pos.rebase(samples_seen)
        log.info("resumed from checkpoint %s at step %d", chosen, self.pos.step)

    def newest_name(self) -> str | None:
        """The newest valid checkpoint as rank 0 sees it, agreed by every rank."""
        chosen = None
        if self.env.is_main:
            found = checkpoint.newest_valid(self.root)
            chosen = found.path.name if found else None
        return distributed.broadcast_object(chosen)

    def load(self, chosen: str) -> int:
        """Load checkpoint `chosen` (a directory name) on every rank; returns its data position."""
        local = self.root / chosen
        have = (local / checkpoint.MARKER).exists()
        everyone = distributed.all_gather_object(have)
        if all(everyone):
            payload = checkpoint.read_payload(local)
        else:
            payload = checkpoint.read_payload(local) if self.env.is_main else None
            payload = distributed.broadcast_object(payload)
            if self.env.is_main:
                log.info("sent checkpoint %s to ranks without shared storage", chosen)
        try:
            weights, state, meta = checkpoint.decode_payload(payload)
        except CheckpointError as exc:
            raise CheckpointError(f"{chosen}: {exc}") from None
        if meta.get("model_fingerprint") != self.cfg.model_fingerprint():
            raise CheckpointError(
                f"checkpoint {chosen} was written with a different model shape or data.seq_len than this config "
                "(fix: resume with the original config, or start fresh with a new --run-name)"
            )
        p = self.parts
        checkpoint.load_weights(p.model, {k: v.to(self.rt.param_dtype) for k, v in weights.items()})
        p.model.to(self.rt.device)
        p.optimizer.load_state_dict(state["optimizer"])
        p.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            p.scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        if len(rngs) == self.layout.world:
            set_rng_state(rngs[self.env.rank])
        elif self.env.is_main:
            log.warning("world size changed (%d -> %d): RNG streams re-seeded", len(rngs), self.layout.world)
        self.pos.step = int(meta["step"])
        self.pos.saved_step = self.pos.step
        self.pos.tokens_seen = int(meta.get("tokens_seen", 0))
        self.pos.rollbacks = int(meta.get("rollbacks", 0))
        per_step = self.layout.per_step
        if int(meta.get("effective_batch", per_step)) != per_step and self.env.is_main:
            log.warning("effective batch changed (%s -> %d) since the checkpoint", meta.get("effective_batch"), per_step)
        return int(meta["samples_seen"])

    # ---- save ---------------------------------------------------------------------------
    def _weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.parts.model.parameters())

    def save(self) -> Path | None:
        """One checkpoint of the current step, written by rank 0; None when the weights are not finite."""
        rngs = distributed.all_gather_object(rng_state())
        path = None
        pos, p = self.pos, self.parts
        if not all(distributed.all_gather_object(self._weights_finite())):
            if self.env.is_main:
                log.error("weights are not finite at step %d: checkpoint NOT written (the previous ones are kept)", pos.step)
            return None
        if self.env.is_main:
            meta = {
                "eval_loss": pos.last_eval,
                "rollbacks": pos.rollbacks,
                "step": pos.step,
                "samples_seen": pos.samples_seen(self.layout.per_step),
                "tokens_seen": pos.tokens_seen,
                "effective_batch": self.layout.per_step,
                "world_size": self.layout.world,
                "model_fingerprint": self.cfg.model_fingerprint(),
                "n_params": p.n_params,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            state = {
                "optimizer": p.optimizer.state_dict(),
                "scheduler": p.scheduler.state_dict(),
                "scaler": p.scaler.state_dict() if p.scaler.is_enabled() else {},
                "rng": rngs,
            }
            t0 = time.perf_counter()
            error: str | None = None
            try:
                path = checkpoint.save(
                    self.root, pos.step, p.model, state, meta, p.data.tokenizer_dir, self.cfg.to_yaml(), self.cfg.train.keep_last
                )
                log.info("checkpoint %s written in %.2fs", path, time.perf_counter() - t0)
            except CheckpointError as exc:
                error = str(exc)
            # Every rank learns that the save failed, so all stop together instead of hanging.
            error = distributed.broadcast_object(error)
        else:
            error = distributed.broadcast_object(None)
        if error:
            raise CheckpointError(error)
        distributed.barrier()
        pos.saved_step = pos.step
        return path

    # ---- rollback -----------------------------------------------------------------------
    def rollback(self, bad_steps: int) -> None:
        """Back to the newest good checkpoint, past the data that went bad, with a lower LR."""
        t, pos = self.cfg.train, self.pos
        if pos.rollbacks >= t.nan_max_rollbacks:
            raise TrainingError(
                f"the loss stayed non-finite after {pos.rollbacks} rollbacks (step {pos.step}) "
                "(fix: lower train.lr, raise train.warmup_steps or train.grad_clip, or check the data)"
            )
        chosen = self.newest_name()
        if chosen is None:
            raise TrainingError(
                f"{bad_steps} non-finite steps in a row at step {pos.step} and no checkpoint to roll back to "
                "(fix: lower train.lr or raise train.warmup_steps; set train.checkpoint_every to have one)"
            )
        position = pos.samples_seen(self.layout.per_step)
        rollbacks = pos.rollbacks + 1
        self.load(chosen)
        pos.rollbacks = rollbacks
        pos.rebase(position)
        scale_learning_rate(self.parts.optimizer, self.parts.scheduler, t, pos.step, self.layout.max_steps)
        if self.env.is_main:
            log.warning(
                "%d non-finite steps in a row: rolled back to %s (step %d), skipping the data that went bad, "
                "learning rate x%g (rollback %d of at most %d)",
                bad_steps,
                chosen,
                pos.step,
                t.nan_lr_scale,
                pos.rollbacks,
                t.nan_max_rollbacks,
            )
