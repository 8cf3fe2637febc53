"""Saving, resuming and rolling back a run, agreed by every rank (the files themselves: checkpoint/files.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from aura_hpc.comm import collectives, tensor_tree
from aura_hpc.config import RunConfig
from aura_hpc.errors import CheckpointError, CheckpointWriteError, TrainingError
from aura_hpc.train.checkpoint import background, resume_checks
from aura_hpc.train.checkpoint import diloco_files as replica_files
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.checkpoint.host_mirror import HostMirror
from aura_hpc.train.checkpoint.writer import SHARDS, Commit, check_one_folder, dcp_errors, save_sharded
from aura_hpc.train.parts.schedule import apply_settings, scale_learning_rate
from aura_hpc.train.parts.state import Layout, Parts, Position
from aura_hpc.train.process.dist_env import DistEnv
from aura_hpc.train.process.runtime import Runtime, rng_state, set_rng_state
from aura_hpc.train.strategies import Wrapped
from aura_hpc.train.strategies.base import OuterLoop, ShardedCheckpoints, capability, sharding

log = logging.getLogger("aura_hpc")


class Checkpointer:
    def __init__(self, cfg: RunConfig, env: DistEnv, rt: Runtime, parts: Parts, layout: Layout, pos: Position, wrapped: Wrapped) -> None:
        self.cfg, self.env, self.rt = cfg, env, rt
        self.parts, self.layout, self.pos, self.wrapped = parts, layout, pos, wrapped
        self.root = cfg.run_dir / "checkpoints"
        self.writer: Future[str | None] | None = None  # rank 0's commit of the newest save: its error or None
        self.shards: Future[Any] | None = None  # this rank's background shard write, until the next wait()
        self._waits = _wait_group(layout.world)  # made now, while the store is there (a stop's save may come without it)
        self.mirror = HostMirror()  # rank 0's host copies of what it saves, reused from save to save
        self.saved_at = time.perf_counter()  # the last save began (train.checkpoint_every_s counts from it)

    # ---- resume -------------------------------------------------------------------------
    def resume(self) -> None:
        """Every rank resumes from the newest valid checkpoint that rank 0 sees.

        Ranks that cannot read it themselves (LAN machines without shared storage) receive it
        from rank 0 over the process group.
        """
        if sharding(self.wrapped) is not None:
            check_one_folder(self.root, self.env, self.cfg.dist.strategy)
        chosen = self.newest_name()
        if chosen is None:
            if self.env.is_main:
                log.info("no checkpoint in %s: starting from step 0", self.root)
            return
        samples_seen = self.load(chosen)
        self.pos.rebase(samples_seen)
        log.info("resumed from checkpoint %s at step %d", chosen, self.pos.step)

    def newest_name(self) -> str | None:
        """The newest valid checkpoint, agreed by every rank. Rank 0 lists the complete ones; where
        every rank sees the files (shared storage), the ranks check each checkpoint together (presence, size, hash), each
        file once (rank 0 alone would hash all of it while the others wait: ~50 GB for gpt2-3b);
        the writer's own checksums in COMPLETE.json are what they are compared with."""
        env = self.env
        names = collectives.broadcast_json(_listing(self.root) if env.is_main else None)
        if isinstance(names, str):
            raise CheckpointError(names)
        newest = max((int(n[5:]) for n in names if checkpoint.is_step_dir_name(n)), default=None)
        resume_checks.newest_elsewhere(self.root, newest, env.is_main)
        for name in names:
            if not checkpoint.is_step_dir_name(name):  # names come from rank 0: only a step folder's name is looked up
                raise CheckpointError(
                    f"rank 0 named a checkpoint {str(name)[:40]!r} that is not a step folder (fix: the same aura_hpc on every node)"
                )
            local = self.root / name
            shared = all(_seen_alike(local, env.is_main))
            share = (env.rank, self.layout.world) if shared else (0, 1)
            mine = checkpoint.verify(local, share) if shared or env.is_main else None
            problems = [p for p in collectives.gather_json(mine) if p]
            if not problems:
                return str(name)
            checkpoint.raise_if_not_read(problems, str(name))  # every rank holds the same list: all stop together
            if env.is_main:
                checkpoint.set_aside(checkpoint.Checkpoint(local, int(name.split("_")[1])), self.root, problems[0])
            collectives.barrier()
        if names:
            # Every checkpoint was damaged: starting from step 0 in silence would throw the run away.
            raise CheckpointError(
                f"every checkpoint in {self.root} is damaged ({len(names)} moved aside as corrupt-step_*): nothing to resume from "
                "(fix: re-run the same command to start again from step 0, or restore a checkpoint from a copy first)"
            )
        return None

    def load(self, chosen: str) -> int:
        """Load checkpoint `chosen` (a directory name) on every rank; returns its data position."""
        local = self.root / chosen
        everyone = _seen_alike(local, self.env.is_main)
        p = self.parts
        try:
            if (sharded := sharding(self.wrapped)) is not None:
                meta, state = self._load_sharded(sharded, chosen, local, everyone)
            elif all(everyone):
                # Straight from (shared) storage, memory-mapped: no rank holds a private copy.
                meta = checkpoint.read_meta(local)
                self._check_fingerprint(chosen, meta)
                self._check_layout(chosen, local, meta)
                checkpoint.load_weights_from(local, p.model)
                state = checkpoint.read_trainer_state(local, mapped=self.rt.device.type != "cpu")
            else:
                weights, state, meta = self._receive(local, chosen)
                self._check_fingerprint(chosen, meta)
                checkpoint.load_weights(p.model, {k: v.to(self.rt.param_dtype) for k, v in weights.items()})
        except CheckpointError as exc:
            raise CheckpointError(str(exc) if str(exc).startswith(f"checkpoint {chosen} ") else f"{chosen}: {exc}") from None
        if "optimizer" in state:  # sharded checkpoints keep it with the model shards
            p.optimizer.load_state_dict(state["optimizer"])
            checkpoint.own_cpu_tensors(p.optimizer)
        replica_files.load_all(self.wrapped, self.parts.optimizer, self.root, chosen, meta, state, self.env.rank, self.layout.world)
        p.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            p.scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        if len(rngs) == self.layout.world:
            set_rng_state(rngs[self.env.rank], self.rt.device)
        elif self.env.is_main:
            log.warning("world size changed (%d -> %d): RNG streams re-seeded", len(rngs), self.layout.world)
        learned = (meta.get("data_order") or {}).get("piece_sequences")
        same_data = resume_checks.same_data(chosen, meta, p.data.manifest.get("data_sha256"), self.env.is_main)  # said before use
        if same_data and learned:
            p.data.learn_counts(learned)
            p.order.refresh()
        _restore_position(self.pos, meta)
        apply_settings(p.optimizer, p.scheduler, self.cfg.train, meta.get("train_lr"), self.pos.rollbacks)
        per_step = self.layout.per_step
        if int(meta.get("effective_batch", per_step)) != per_step and self.env.is_main:
            log.warning("effective batch changed (%s -> %d) since the checkpoint", meta.get("effective_batch"), per_step)
        return int(meta["samples_seen"])

    def _load_sharded(
        self, sharded: ShardedCheckpoints, chosen: str, local: Path, everyone: list[bool]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        missing = [r for r, have in enumerate(everyone) if not have]
        if missing:
            raise CheckpointError(
                f"checkpoint {chosen} is sharded and rank(s) {missing} cannot see {self.root}: every rank reads and writes its "
                "own shard (fix: put output_dir on storage all nodes share, e.g. NFS, or --set dist.strategy=ddp)"
            )
        meta = checkpoint.read_meta(local)
        self._check_fingerprint(chosen, meta)
        self._check_layout(chosen, local, meta)
        resume_checks.same_precision(chosen, meta, self.wrapped.name, self.rt.autocast_dtype == torch.bfloat16)
        written_on = int(meta.get("world_size", self.layout.world))
        if not sharded.reshards and written_on != self.layout.world:
            raise CheckpointError(
                f"checkpoint {chosen} holds DeepSpeed ZeRO partitions for {written_on} ranks and this run has {self.layout.world}: "
                f"ZeRO checkpoints resume at the world size they were written at (fix: resume on {written_on} processes, or convert "
                "it with DeepSpeed's ds_to_universal; fsdp checkpoints reshard to any world size)"
            )
        sharded.load_sharded(local / SHARDS, self.parts.optimizer)
        return meta, checkpoint.read_trainer_state(local, mapped=self.rt.device.type != "cpu")

    def _check_layout(self, chosen: str, local: Path, meta: dict[str, Any]) -> None:
        """A sharded checkpoint resumes only under the strategy that wrote it, and a full one only under ddp."""
        sharded = (local / SHARDS).is_dir()
        resume_checks.same_kind(chosen, meta, "strategy", self.wrapped.name if sharded else None)
        if sharded != (sharding(self.wrapped) is not None):
            was = "a sharded strategy" if sharded else "ddp"
            raise CheckpointError(
                f"checkpoint {chosen} was written under {was} and this run uses dist.strategy={self.cfg.dist.strategy}: "
                "the optimizer state is laid out differently (fix: resume with the strategy the run started with, or a new --run-name)"
            )

    def _check_fingerprint(self, chosen: str, meta: dict[str, Any]) -> None:
        if meta.get("model_fingerprint") != self.cfg.model_fingerprint():
            raise CheckpointError(
                f"checkpoint {chosen} was written with a different model shape or data.seq_len than this config "
                "(fix: resume with the original config, or start fresh with a new --run-name)"
            )
        resume_checks.same_settings(chosen, meta, self.cfg)

    # ---- save ---------------------------------------------------------------------------
    def _receive(self, local: Path, chosen: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """Checkpoint `chosen` from rank 0, for ranks that cannot read it themselves (LAN machines without
        shared storage): the weights as safetensors, the trainer state as JSON and tensors (nothing
        received is unpickled), meta.json as it is."""
        parts = _payload_parts(local) if self.env.is_main else [None] * 4
        got = [collectives.broadcast_bytes(part) for part in parts]
        if self.env.is_main:
            log.info("sent checkpoint %s to ranks without shared storage", chosen)
        return _decode_payload(got)

    def save(self, last: bool = False) -> Path | None:
        """A checkpoint of the current step, written by rank 0; None when the weights are not finite.

        With train.async_checkpoint, rank 0 copies the state to host memory and a background
        thread writes it: training pauses only for the copy. A write that fails is reported,
        to every rank, at the next save or `wait()`. Under sharded strategies only the `last`
        (the run's end) gathers the full weights into model/ (checkpoint/writer.py).
        """
        rngs = [tensor_tree.from_json(r) for r in collectives.gather_json(tensor_tree.to_json(rng_state(self.rt.device)))]
        pos, p = self.pos, self.parts
        if not _weights_finite(self.wrapped):
            if self.env.is_main:
                log.error("weights are not finite at step %d: checkpoint NOT written (the previous ones are kept)", pos.step)
            return None
        self.wait()  # one write at a time; and the previous one's outcome, for every rank
        self.saved_at = time.perf_counter()
        path = self.root / checkpoint.step_dir_name(pos.step)
        if (sharded := sharding(self.wrapped)) is not None:
            behind = self.cfg.train.async_checkpoint and sharded.background_shards
            shard_args = (self.root, pos.step, p, self.env, self.cfg.to_yaml(), self.cfg.train.keep_last)
            meta = self._meta() if self.env.is_main else {}
            self.writer, self.shards = save_sharded(sharded, shard_args, meta, rngs, full_weights=last, in_background=behind)
            if not behind:
                self.wait()
            pos.saved_step = pos.step
            return path
        replicas = replica_files.save_all(self.wrapped, self.parts.optimizer, self.root, pos.step, self.env.rank, self.cfg.train.keep_last)
        if self.env.is_main:
            t0 = time.perf_counter()
            meta = self._meta()
            if replicas is not None:
                meta["replica_files"] = replicas
            outer_loop = capability(self.wrapped, OuterLoop)
            outer = outer_loop.outer_state() if outer_loop is not None else None
            state = self.mirror.copy(
                {
                    "optimizer": p.optimizer.state_dict(),
                    "scheduler": p.scheduler.state_dict(),
                    "scaler": p.scaler.state_dict() if p.scaler.is_enabled() else {},
                    "rng": rngs,
                    **({"outer": outer} if outer is not None else {}),
                },
                "state",
            )
            weights = self.mirror.copy(checkpoint.unique_weights(p.model), "model")
            self.mirror.ready()
            snap = checkpoint.ModelSnapshot(weights, *checkpoint.model_configs(p.model))
            paused = time.perf_counter() - t0
            args = (self.root, pos.step, snap, state, meta, p.data.tokenizer_dir, self.cfg.to_yaml(), self.cfg.train.keep_last)
            commit = Commit(args, t0, paused)
            self.writer = background.submit(commit) if self.cfg.train.async_checkpoint else background.run_here(commit)
        if not self.cfg.train.async_checkpoint:
            self.wait()
        pos.saved_step = pos.step
        return path

    def _meta(self) -> dict[str, Any]:
        pos = self.pos
        return {
            "eval_loss": pos.last_eval,
            "rollbacks": pos.rollbacks,
            "step": pos.step,
            "samples_seen": pos.samples_seen(self.layout.per_step),
            "tokens_seen": pos.tokens_seen,
            "effective_batch": self.layout.per_step,
            "world_size": self.layout.world,
            "max_steps": self.layout.max_steps,
            "max_tokens": self.cfg.train.max_tokens,  # the budget max_steps was set for (train/parts/build.py)
            "model_fingerprint": self.cfg.model_fingerprint(),
            "n_params": self.parts.n_params,
            "strategy": self.wrapped.name,
            "optimizer": self.cfg.train.optimizer,
            **resume_checks.order_settings(self.cfg),
            "bf16": self.rt.autocast_dtype == torch.bfloat16,  # DeepSpeed's file names depend on it (resume_checks.same_precision)
            "data_sha256": self.parts.data.manifest.get("data_sha256"),  # the data samples_seen counts along
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # A stream's piece sizes learned so far: a resumed run finds its position without encoding the past again.
            **({"data_order": order} if (order := self.parts.order.state()) is not None else {}),
        }

    def wait(self) -> None:
        """Wait for the checkpoint being written; every rank calls this at the same point."""
        error = None
        if self.shards is not None:  # rank 0's writer reports a failure of any rank's background shards
            with contextlib.suppress(Exception, *dcp_errors()):
                self.shards.result()
            self.shards = None
        if self.env.is_main and self.writer is not None:
            error, self.writer = self.writer.result(), None
        error = collectives.broadcast_json(error, group=self._waits)  # all learn that the save failed: all stop together
        if error:
            raise CheckpointWriteError(error)

    # ---- rollback -----------------------------------------------------------------------
    def rollback(self, bad_steps: int) -> None:
        """Back to the newest good checkpoint, past the data that went bad, with a lower LR."""
        t, pos = self.cfg.train, self.pos
        with _only_said(CheckpointWriteError, pos.rollbacks >= t.nan_max_rollbacks):
            self.wait()  # the save in flight ends first, on every rank, whatever follows (an error exit lost it)
        if pos.rollbacks >= t.nan_max_rollbacks:
            raise TrainingError(
                f"the loss stayed non-finite after {pos.rollbacks} rollbacks (step {pos.step}) "
                "(fix: lower train.lr, raise train.warmup_steps, clip harder (a lower train.grad_clip, above 0), or check the data)"
            )
        if sharding(self.wrapped) is not None:
            check_one_folder(self.root, self.env, self.cfg.dist.strategy)
        chosen = self.newest_name()
        if chosen is None:
            raise TrainingError(
                f"{bad_steps} non-finite steps in a row at step {pos.step} and no checkpoint to roll back to "
                "(fix: lower train.lr or raise train.warmup_steps; set train.checkpoint_every to have one)"
            )
        position = pos.samples_seen(self.layout.per_step)
        rollbacks = pos.rollbacks + 1
        self.load(chosen)
        # The checkpoint's learning rates carry the rollbacks made before it was written; a second
        # rollback to the same checkpoint must compound (x0.25 at a 0.5 scale), not repeat x0.5.
        pending = rollbacks - pos.rollbacks
        pos.rollbacks = rollbacks
        pos.rebase(position)
        scale_learning_rate(self.parts.optimizer, self.parts.scheduler, t, pos.step, self.layout.max_steps, pending)
        if self.env.is_main:
            log.warning(
                "%d non-finite steps in a row: rolled back to %s (step %d), skipping the data that went bad, "
                "learning rate x%g of the schedule's (rollback %d of at most %d)",
                bad_steps,
                chosen,
                pos.step,
                t.nan_lr_scale**pos.rollbacks,
                pos.rollbacks,
                t.nan_max_rollbacks,
            )
        # The rollback kept at once (its step written again): the data skipped, the lowered LR and the rollback count
        # lived only in memory, and a crash before the next save resumed into the data that diverged, at the old LR.
        self.save()


def _weights_finite(wrapped: Wrapped) -> bool:
    """Whether every rank's weights are finite: each checks what it holds (a shard under sharded
    strategies), on the device; one all-reduce, one host read."""
    held = [t for t in wrapped.local_weights() if t.numel()]
    bad = torch.zeros(1, dtype=torch.float32, device=collectives.world().device)
    if held:
        finite = torch.stack([torch.isfinite(t).all().to(bad.device) for t in held]).all()
        bad.copy_((~finite).to(torch.float32).view(1))
    collectives.all_reduce(bad, op="max")
    return bool(bad.item() == 0)


def _payload_parts(ckpt: Path) -> list[bytes]:
    """What a resuming rank without shared storage needs, as bytes rank 0 sends: the weights
    (safetensors), the trainer state as JSON plus its tensors (safetensors), meta.json."""
    skeleton, tensors = tensor_tree.to_bytes(checkpoint.read_trainer_state(ckpt))
    return [(ckpt / "model" / "model.safetensors").read_bytes(), skeleton, tensors, (ckpt / "meta.json").read_bytes()]


def _decode_payload(parts: list[bytes]) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The reverse of payload_parts, on a rank that received them: data only, nothing unpickled."""
    from safetensors.torch import load as load_safetensors

    try:
        weights = load_safetensors(parts[0])
        state = tensor_tree.from_bytes(parts[1], parts[2])
        meta = json.loads(parts[3])
        if not isinstance(state, dict) or not isinstance(meta, dict):
            raise ValueError("not a checkpoint's state")
    except Exception as exc:  # any decoding failure means the same thing to the user
        raise checkpoint.unreadable(exc) from None
    return weights, state, meta


def _seen_alike(local: Path, is_main: bool) -> list[bool]:
    """Which ranks see rank 0's checkpoint `local`: its commit marker, byte for byte. A folder of the same name
    on a node that shares no storage with rank 0 (a run of that name before) was taken for shared storage:
    that rank resumed from its own old checkpoint, another position and optimizer state, unsaid."""
    import hashlib

    mine: str | None = None
    for attempt in range(MARKER_READS):
        try:
            mine = hashlib.sha256((local / checkpoint.MARKER).read_bytes()).hexdigest()
            break
        except (FileNotFoundError, NotADirectoryError):
            break  # not there: storage rank 0 does not share
        except OSError as exc:  # there, unreadable (ESTALE, EIO): not "unshared", whose answer is the whole checkpoint sent
            mine = f"error: {exc}"
            if attempt + 1 < MARKER_READS:
                time.sleep(MARKER_RETRY_S * (attempt + 1))
    theirs = collectives.broadcast_json(mine if is_main else None)
    said = collectives.gather_json("error" if mine and mine.startswith("error: ") else "same" if mine and mine == theirs else "other")
    if failed := [r for r, a in enumerate(said) if a == "error"]:
        raise CheckpointError(
            f"checkpoint {local.name}: rank(s) {failed} could not read its commit marker"
            + (f" ({mine.removeprefix('error: ')})" if mine and mine.startswith("error: ") else "")
            + " (fix: the shared file system on that node (an NFS error?); the checkpoint is kept, re-run the same command)"
        )
    return [a == "same" for a in said]


def _wait_group(world: int) -> Any:
    """The group the ranks learn a save's outcome on: a host group, which waits 30 min at least (the world's, NCCL's,
    timed out at dist.timeout_s while rank 0 wrote a big model). Not the rendezvous store: under `local` it lives in the
    launcher, and a launcher killed left the stop's own checkpoint no store to wait on. Collective: every rank makes its
    Checkpointer at the same point."""
    return collectives.new_group("checkpoint-wait", host_only=True) if collectives.active() and world > 1 else None


MARKER_READS = 3  # a read of the commit marker that fails, tried again (an NFS hiccup)
MARKER_RETRY_S = 1.0


def _restore_position(pos: Position, meta: dict[str, Any]) -> None:
    pos.step = pos.saved_step = int(meta["step"])
    pos.tokens_seen = int(meta.get("tokens_seen", 0))
    pos.rollbacks = int(meta.get("rollbacks", 0))


@contextlib.contextmanager
def _only_said(kind: type[Exception], said: bool) -> Iterator[None]:
    """`kind` raised inside is logged instead where `said` (at the rollback limit a failed save in flight is said, and
    the run's verdict stays the divergence: exit 3, not restarted, where the write's error made it exit 1)."""
    try:
        yield
    except kind as exc:
        if not said:
            raise
        log.error("%s", exc)


def _listing(root: Path) -> list[str] | str:
    """Rank 0's list of the complete checkpoints, or the line that says why it cannot list them: said on every rank,
    not a traceback on rank 0 while the others wait for its list."""
    try:
        checkpoint.restore_set_aside(root)
        checkpoint.note_interrupted(root)
        return [c.path.name for c in checkpoint.list_complete(root)]
    except OSError as exc:
        return (
            f"cannot read the checkpoints in {root} ({exc.strerror or exc}) (fix: check that its filesystem is "
            f"mounted and readable here (`ls {root}`), then re-run the same command to resume)"
        )
