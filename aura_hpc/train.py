"""The one worker entry point: `python -m aura_hpc.train RUN_DIR/config.yaml`.

Every launcher starts it the same way (`local` through torch's elastic agent, `submit` under
Slurm); it reads rank and world size from the environment through DistEnv alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aura_hpc import checkpoint, distributed, faults
from aura_hpc.config import RunConfig, load_run_file, max_steps_for
from aura_hpc.data.packed import GlobalOrder, PackedTokens, batch_start
from aura_hpc.dist_env import DistEnv
from aura_hpc.errors import EXIT_GPU_FAULT, EXIT_RESUMABLE, AuraError, CheckpointError, ConfigError, DataError, TrainingError
from aura_hpc.gpu_health import Fault, HealthRules, NoGpus, Thresholds, is_gpu_error, open_reader
from aura_hpc.malloc_tuning import pin_thresholds
from aura_hpc.model import build_model, count_parameters, lm_loss
from aura_hpc.parallel import Wrapped, wrap
from aura_hpc.resources import BackgroundMonitor, Sampler
from aura_hpc.stop import StopRequest

log = logging.getLogger("aura_hpc")


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of train.lr for the update that follows `step` completed updates."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


class Trainer:
    def __init__(self, cfg: RunConfig, env: DistEnv) -> None:
        self.monitor: BackgroundMonitor | None = None
        self.cfg = cfg
        self.env = env
        self.run_dir = cfg.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"

    # ---- set-up -------------------------------------------------------------------------
    def _setup_runtime(self) -> None:
        cfg, env = self.cfg, self.env
        threads = cfg.train.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        # Only when it changes something: a redundant set_num_threads still costs ~1.5 ms of
        # system time per step afterwards (measured on the 2-core CPU machine, 2 threads).
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        if cfg.dist.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("dist.backend is nccl but this machine has no CUDA GPU (fix: --backend gloo or auto)")
        self.device = distributed.pick_device(env, cfg.dist.backend)
        malloc = "default"
        if self.device.type == "cpu" and cfg.train.tune_malloc and pin_thresholds():
            malloc = "pinned"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.backend = "none"
        if env.launcher != "none" or env.world_size > 1:
            self.backend = distributed.init_process_group(env, cfg.dist.backend, self.device, cfg.dist.init_timeout_s, cfg.dist.timeout_s)
        log.info(
            "start rank=%d local_rank=%d world_size=%d node_rank=%d host=%s backend=%s device=%s restart=%d malloc=%s",
            env.rank,
            env.local_rank,
            env.world_size,
            env.node_rank,
            env.hostname,
            self.backend,
            _device_name(self.device),
            env.restart_count,
            malloc,
        )

    def _precision(self) -> tuple[torch.dtype, torch.dtype | None]:
        """(parameter dtype, autocast dtype or None)."""
        p = self.cfg.train.precision
        cuda = self.device.type == "cuda"
        if p == "fp64":
            return torch.float64, None
        if p == "fp32":
            return torch.float32, None
        if p == "bf16" or (p == "auto" and cuda and torch.cuda.is_bf16_supported()):
            return torch.float32, torch.bfloat16
        if p == "fp16":
            if not cuda:
                raise ConfigError("train.precision fp16 needs a CUDA GPU (fix: --set train.precision=auto)")
            return torch.float32, torch.float16
        return torch.float32, None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _check_same_everywhere(self) -> None:
        """Nodes prepared their data and wrote their config separately: they must agree."""
        mine = (
            self.data.manifest.get("data_sha256"),
            self.cfg.model_fingerprint(),
            json.dumps(self.cfg.train.__dict__, sort_keys=True, default=str),
        )
        every = distributed.all_gather_object(mine)
        for r, theirs in enumerate(every):
            if theirs[0] != mine[0]:
                raise DataError(
                    f"rank {r} has different prepared data than rank {self.env.rank} "
                    "(fix: use the same data.path contents on every node, e.g. copy the prepared directory)"
                )
            if theirs[1:] != mine[1:]:
                raise ConfigError(
                    f"rank {r} runs a different config than rank {self.env.rank} (fix: pass the same --config/--set on every node)"
                )

    def _build(self) -> None:
        cfg, env = self.cfg, self.env
        t = cfg.train
        seed = t.seed
        torch.manual_seed(seed)
        random.seed(seed)
        if not cfg.data.path:
            raise DataError("data.path is empty (fix: --set data.path=DIR from `python -m aura_hpc prepare`)")
        self.data = PackedTokens(cfg.data.path, cfg.data.seq_len)
        if cfg.model.vocab_size and cfg.model.vocab_size != self.data.vocab_size:
            raise ConfigError(
                f"model.vocab_size {cfg.model.vocab_size} does not match the data's tokenizer "
                f"({self.data.vocab_size}) (fix: --set model.vocab_size=0 to take it from the data)"
            )
        self._check_same_everywhere()
        self.param_dtype, self.autocast_dtype = self._precision()
        model = build_model(cfg.model, self.data.vocab_size, self.data.eos_id)
        model.to(device=self.device, dtype=self.param_dtype)
        self.model = model
        self.n_params = count_parameters(model)

        self.world = env.world_size
        self.per_step = t.batch_size * self.world * t.grad_accum
        self.tokens_per_step = self.per_step * cfg.data.seq_len
        self.max_steps = max_steps_for(cfg, self.world)
        self.end_step = min(t.stop_at, self.max_steps) if t.stop_at else self.max_steps
        n_train = self.data.num_sequences("train")
        if n_train < self.per_step:
            msg = (
                f"the prepared data has {n_train} training sequences of {cfg.data.seq_len} tokens, fewer than one "
                f"effective batch of {self.per_step} (= {t.batch_size} per device x {self.world} processes x "
                f"{t.grad_accum} accumulation)"
            )
            if not t.allow_oversubscription:
                raise DataError(
                    msg + " (fix: more data, a smaller train.batch_size/data.seq_len, fewer processes, or "
                    "--set train.allow_oversubscription=true to repeat the data)"
                )
            if env.is_main:
                log.warning("%s; train.allow_oversubscription=true: repeating the data to fill each batch", msg)
        self.order = GlobalOrder(max(n_train, 1), seed)

        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if t.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=t.lr)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), foreach=True)
        horizon = self.max_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, t.warmup_steps, horizon, t.schedule, t.min_lr_ratio)
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.autocast_dtype == torch.float16)

    # ---- resume -------------------------------------------------------------------------
    def _resume(self) -> None:
        """Every rank resumes from the newest valid checkpoint that rank 0 sees.

        Ranks that cannot read it themselves (LAN machines without shared storage) receive it
        from rank 0 over the process group.
        """
        self.step = 0
        self.samples_base, self.step_base = 0, 0
        self.tokens_seen = 0
        self.rollbacks = 0
        self.saved_step = -1
        self.last_eval: float | None = None
        chosen = self._newest_checkpoint_name()
        if chosen is None:
            if self.env.is_main:
                log.info("no checkpoint in %s: starting from step 0", self.ckpt_root)
            return
        self._load_checkpoint(chosen)
        self.samples_base, self.step_base = self._samples_seen_at_ckpt, self.step
        log.info("resumed from checkpoint %s at step %d", chosen, self.step)

    def _newest_checkpoint_name(self) -> str | None:
        """The newest valid checkpoint as rank 0 sees it, agreed by every rank."""
        chosen = None
        if self.env.is_main:
            found = checkpoint.newest_valid(self.ckpt_root)
            chosen = found.path.name if found else None
        return distributed.broadcast_object(chosen)

    def _load_checkpoint(self, chosen: str) -> None:
        """Load checkpoint `chosen` (a directory name) on every rank."""
        local = self.ckpt_root / chosen
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
        checkpoint.load_weights(self.model, {k: v.to(self.param_dtype) for k, v in weights.items()})
        self.model.to(self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        if len(rngs) == self.world:
            _set_rng_state(rngs[self.env.rank])
        elif self.env.is_main:
            log.warning("world size changed (%d -> %d): RNG streams re-seeded", len(rngs), self.world)
        self.step = int(meta["step"])
        self.saved_step = self.step
        self._samples_seen_at_ckpt = int(meta["samples_seen"])
        self.tokens_seen = int(meta.get("tokens_seen", 0))
        self.rollbacks = int(meta.get("rollbacks", 0))
        if int(meta.get("effective_batch", self.per_step)) != self.per_step and self.env.is_main:
            log.warning("effective batch changed (%s -> %d) since the checkpoint", meta.get("effective_batch"), self.per_step)

    # ---- the loop -----------------------------------------------------------------------
    def _batch(self, micro: int) -> torch.Tensor:
        t = self.cfg.train
        start = self.samples_base + (self.step - self.step_base) * self.per_step
        start += batch_start(0, micro, self.env.rank, self.world, t.batch_size, t.grad_accum)
        idx = self.order.indices(start, t.batch_size)
        x = torch.from_numpy(self.data.sequences("train", idx))
        return x.to(self.device, non_blocking=True)

    def _train_step(self, wrapped: Wrapped, stop: StopRequest) -> tuple[float, float, bool, list[int], bool]:
        """One optimizer step; returns (loss, grad norm, stop agreed, ranks with a non-finite loss/grad, GPU fault agreed).

        Whether to stop and whether the step is usable is decided by all ranks together in one
        all-reduce (under DDP the gradients' own), so a NaN or a signal on one rank never leaves
        the others waiting.
        """
        t = self.cfg.train
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        poison = faults.poison_loss(self.env.rank, self.step + 1)
        riding = False
        flags = torch.zeros(2 + self.world, dtype=torch.float64, device=self.device)
        for micro in range(t.grad_accum):
            batch = self._batch(micro)
            last = micro == t.grad_accum - 1
            with wrapped.accumulating(sync=last), self._autocast():
                loss = lm_loss(wrapped.module, batch) / t.grad_accum
                if poison:
                    loss = loss * float("nan")
            total += loss.detach().to(torch.float64)
            if last:
                # [stop requested, GPU breaker open, non-finite loss on rank 0..N-1], built on the
                # device without a sync and summed over ranks with the gradients (or below).
                flags[0] = 1.0 if stop.requested else 0.0
                flags[1] = 1.0 if self.monitor is not None and self.monitor.fault is not None else 0.0
                flags[2 + self.env.rank] = (~torch.isfinite(total)).to(torch.float64)
                riding = wrapped.send_flags(flags)
            self.scaler.scale(loss).backward()
        if riding:
            flags = wrapped.received_flags()
        elif distributed.active() and self.world > 1:
            torch.distributed.all_reduce(flags)
        self.scaler.unscale_(self.optimizer)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        loss_value, norm_value = float(total), float(grad_norm)
        flags_list = flags.tolist()
        # Only the rank whose loss went bad is named: a NaN loss on one rank poisons every rank's
        # gradients through DDP, so the gradients cannot say where it started.
        bad_ranks = [r for r in range(self.world) if flags_list[2 + r] > 0]
        if not bad_ranks and not math.isfinite(norm_value) and not self.scaler.is_enabled():
            # After the all-reduce every rank holds the same gradients, so every rank sees this
            # alike. fp16's GradScaler skips inf-gradient steps itself; only a bad loss counts there.
            bad_ranks = list(range(self.world))
        if bad_ranks:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler.is_enabled():
                self.scaler.update()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_value, norm_value, flags_list[0] > 0, bad_ranks, flags_list[1] > 0

    @torch.no_grad()
    def evaluate(self) -> float | None:
        t = self.cfg.train
        n_val = self.data.num_sequences("val")
        if n_val == 0:
            return None
        n = min(n_val, t.eval_batches * t.batch_size * self.world)
        mine = list(range(self.env.rank, n, self.world))
        self.model.eval()
        loss_sum, count = 0.0, 0
        for i in range(0, len(mine), t.batch_size):
            idx = mine[i : i + t.batch_size]
            x = torch.from_numpy(self.data.sequences("val", idx)).to(self.device)
            with self._autocast():
                loss_sum += float(lm_loss(self.model, x)) * len(idx)
            count += len(idx)
        self.model.train()
        total, cnt = distributed.all_reduce_sum([loss_sum, float(count)], self.device)
        return total / cnt if cnt else None

    @torch.no_grad()
    def sample(self) -> str:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.data.tokenizer_dir))
        t = self.cfg.train
        ids = tok(t.sample_prompt, return_tensors="pt").input_ids.to(self.device)
        self.model.eval()
        # Sampling must not disturb the training RNG stream (resume would diverge).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(t.seed + self.step)
            with self._autocast():
                out = self.model.generate(
                    ids,
                    max_new_tokens=t.sample_tokens,
                    do_sample=True,
                    top_k=40,
                    temperature=0.8,
                    pad_token_id=self.data.eos_id,
                    attention_mask=torch.ones_like(ids),
                )
        self.model.train()
        return str(tok.decode(out[0], skip_special_tokens=True))

    def _weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def save(self) -> Path | None:
        rngs = distributed.all_gather_object(_rng_state())
        path = None
        if not all(distributed.all_gather_object(self._weights_finite())):
            if self.env.is_main:
                log.error("weights are not finite at step %d: checkpoint NOT written (the previous ones are kept)", self.step)
            return None
        if self.env.is_main:
            meta = {
                "eval_loss": self.last_eval,
                "rollbacks": self.rollbacks,
                "step": self.step,
                "samples_seen": self.samples_base + (self.step - self.step_base) * self.per_step,
                "tokens_seen": self.tokens_seen,
                "effective_batch": self.per_step,
                "world_size": self.world,
                "model_fingerprint": self.cfg.model_fingerprint(),
                "n_params": self.n_params,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                "rng": rngs,
            }
            t0 = time.perf_counter()
            error: str | None = None
            try:
                path = checkpoint.save(
                    self.ckpt_root,
                    self.step,
                    self.model,
                    state,
                    meta,
                    self.data.tokenizer_dir,
                    self.cfg.to_yaml(),
                    self.cfg.train.keep_last,
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
        self.saved_step = self.step
        return path

    def _rollback(self, bad_steps: int) -> None:
        """Back to the newest good checkpoint, past the data that went bad, with a lower LR."""
        t = self.cfg.train
        if self.rollbacks >= t.nan_max_rollbacks:
            raise TrainingError(
                f"the loss stayed non-finite after {self.rollbacks} rollbacks (step {self.step}) "
                "(fix: lower train.lr, raise train.warmup_steps or train.grad_clip, or check the data)"
            )
        chosen = self._newest_checkpoint_name()
        if chosen is None:
            raise TrainingError(
                f"{bad_steps} non-finite steps in a row at step {self.step} and no checkpoint to roll back to "
                "(fix: lower train.lr or raise train.warmup_steps; set train.checkpoint_every to have one)"
            )
        position = self.samples_base + (self.step - self.step_base) * self.per_step
        rollbacks = self.rollbacks + 1
        self._load_checkpoint(chosen)
        self.rollbacks = rollbacks
        self.samples_base, self.step_base = position, self.step
        self.scheduler.base_lrs = [lr * t.nan_lr_scale for lr in self.scheduler.base_lrs]
        factor = lr_factor(self.step, t.warmup_steps, self.max_steps, t.schedule, t.min_lr_ratio)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor
        if self.env.is_main:
            log.warning(
                "%d non-finite steps in a row: rolled back to %s (step %d), skipping the data that went bad, "
                "learning rate x%g (rollback %d of at most %d)",
                bad_steps,
                chosen,
                self.step,
                t.nan_lr_scale,
                self.rollbacks,
                t.nan_max_rollbacks,
            )

    def _start_monitor(self, metrics: Any) -> BackgroundMonitor | None:
        """Resource sampling and the GPU breaker, on local rank 0 of each node only."""
        h = self.cfg.health
        if self.env.local_rank != 0:
            return None
        reader = open_reader(h.nvml_replay)
        breaker = h.breaker and not isinstance(reader, NoGpus)
        if h.monitor_interval_s <= 0 and not breaker:
            return None
        interval = h.monitor_interval_s if h.monitor_interval_s > 0 else h.breaker_interval_s
        if breaker and h.monitor_interval_s > 0:
            interval = min(interval, h.breaker_interval_s)
        out = self.run_dir / "resources" / f"node{self.env.node_rank}.jsonl" if h.monitor_interval_s > 0 else None
        rules = None
        if breaker:
            reasons = tuple(r.strip() for r in h.throttle_reasons.split(",") if r.strip())
            rules = HealthRules(Thresholds(h.temp_margin_c, reasons, h.throttle_samples))

        def to_tensorboard(row: dict[str, Any]) -> None:
            if metrics is not None and h.monitor_interval_s > 0:
                metrics.resources(row, self.step)

        sampler = Sampler(reader, self.run_dir)
        return BackgroundMonitor(sampler, interval, out, rules, to_tensorboard).start()

    def _report_gpu_fault(self, fault: Fault) -> None:
        h = self.cfg.health
        url = h.webhook_url
        if url.startswith("env:"):
            url = os.environ.get(url[4:], "")
        if not url:
            return
        from aura_hpc import webhook

        event = {
            "event": "gpu.fault",
            "host": socket.gethostname(),
            "gpu_index": fault.gpu_index,
            "reason": fault.reason,
            "readings": fault.readings,
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
            "node_rank": self.env.node_rank,
            "run_dir": str(self.run_dir),
            "step": self.step,
        }
        webhook.deliver(url, h.webhook_type, event, h.webhook_timeout_s, h.webhook_retries)

    def _open_circuit(self) -> int:
        """All ranks agreed that a GPU is faulty: checkpoint if it still answers, alert, exit EXIT_GPU_FAULT."""
        fault = self.monitor.fault if self.monitor is not None else None
        if fault is not None:
            log.error("GPU circuit breaker OPEN on %s: %s", socket.gethostname(), fault.describe())
            self._report_gpu_fault(fault)
        try:
            path = self.save()
            saved = f"checkpoint {path.name} written" if path else "checkpoint not written"
        except Exception as exc:  # the GPU may no longer answer: nothing more to save
            saved = f"checkpoint failed ({str(exc).splitlines()[0][:120]})"
        if self.env.is_main:
            log.error(
                "stopped at step %d by the GPU circuit breaker: %s; exiting with status %d so the node can be drained "
                "(Slurm: scontrol update nodename=<node> state=drain reason=gpu-fault); resume elsewhere with the same command",
                self.step,
                saved,
                EXIT_GPU_FAULT,
            )
        if self.monitor is not None:
            self.monitor.stop()
        return EXIT_GPU_FAULT

    def _stop_on_signal(self, stop: StopRequest) -> int:
        path = self.save()
        if self.env.is_main:
            what = f"checkpoint {path.name} written" if path else "no checkpoint written (weights not finite)"
            log.warning(
                "stop requested (%s) at step %d: %s; exiting with status %d (resumable: re-run the same command, or Slurm requeues)",
                stop.signal_name or "signal on another rank",
                self.step,
                what,
                EXIT_RESUMABLE,
            )
        distributed.barrier()
        return EXIT_RESUMABLE

    def _print_plan(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        lines = [
            f"run directory: {self.run_dir}",
            f"model: GPT-2 {cfg.model.n_layer} layers x {cfg.model.n_embd} wide, {cfg.model.n_head} heads, "
            f"{self.n_params:,} parameters ({self.n_params / 1e6:.1f}M), vocab {self.data.vocab_size}",
            f"batch: {t.batch_size} per device x {self.world} processes x {t.grad_accum} accumulation = "
            f"effective batch {self.per_step} sequences = {self.tokens_per_step:,} tokens per step",
            f"data: {self.data.num_sequences('train'):,} train / {self.data.num_sequences('val'):,} val sequences "
            f"of {cfg.data.seq_len} tokens from {cfg.data.path}",
            f"steps: {self.step} -> {self.end_step} (schedule horizon {self.max_steps}), lr {t.lr:g} "
            f"{t.schedule} with {t.warmup_steps} warmup, precision {t.precision} "
            f"(params {str(self.param_dtype).removeprefix('torch.')}, autocast "
            f"{str(self.autocast_dtype).removeprefix('torch.') if self.autocast_dtype else 'off'})",
        ]
        for line in lines:
            log.info("%s", line)

    def run(self) -> int:
        self._setup_runtime()
        self._build()
        self._resume()
        env, t = self.env, self.cfg.train
        wrapped = wrap(self.model, self.cfg.dist.strategy, self.device, self.world)
        if env.is_main:
            self._print_plan()
        distributed.barrier()

        from aura_hpc.console import ProgressAwareHandler, TrainProgress

        metrics = None
        progress = TrainProgress(self.end_step, self.step, enabled=env.is_main and self.step < self.end_step)
        if env.is_main:
            from aura_hpc.metrics import MetricsWriter

            metrics = MetricsWriter(self.run_dir, self.step)
            for h in log.handlers:
                if isinstance(h, ProgressAwareHandler):
                    h.progress = progress
        if self.step >= self.end_step and env.is_main:
            log.info("nothing to do: the run is already at step %d of %d", self.step, self.end_step)
        interval_time, interval_tokens, interval_loss, interval_steps = 0.0, 0, 0.0, 0
        last_sample = ""
        loop_start = time.perf_counter()
        stop = StopRequest()
        stop.install()
        bad_in_a_row = 0
        first_step = True
        self.monitor = self._start_monitor(metrics)
        while self.step < self.end_step:
            t0 = time.perf_counter()
            try:
                loss, grad_norm, stop_agreed, bad_ranks, gpu_fault = self._train_step(wrapped, stop)
            except RuntimeError as exc:
                if not is_gpu_error(exc):
                    raise
                # Xid-style failure: the GPU state is unusable, so no checkpoint and no collective.
                fault = Fault(self.device.index or 0, f"CUDA error in the training loop: {str(exc).splitlines()[0][:200]}", {})
                self._report_gpu_fault(fault)
                log.error("%s; exiting with status %d (drain this node)", fault.describe(), EXIT_GPU_FAULT)
                return EXIT_GPU_FAULT
            if gpu_fault:
                progress.stop()
                return self._open_circuit()
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            if first_step and env.is_main:
                # Lets operators (and bench_faults.py) see how long a restart took to train again.
                log.info("first step of this attempt done: step %d at unix time %.3f", self.step, time.time())
            first_step = False
            faults.after_step(self.env.rank, self.step, self.run_dir)
            interval_time += time.perf_counter() - t0
            if bad_ranks:
                bad_in_a_row += 1
                if env.is_main:
                    log.warning(
                        "non-finite loss or gradient on rank(s) %s at step %d: update skipped (%d in a row)",
                        bad_ranks,
                        self.step,
                        bad_in_a_row,
                    )
                if bad_in_a_row >= t.nan_rollback_after:
                    self._rollback(bad_in_a_row)
                    bad_in_a_row = 0
                    interval_time, interval_tokens, interval_loss, interval_steps = 0.0, 0, 0.0, 0
                    continue
            else:
                bad_in_a_row = 0
            if stop_agreed:
                progress.stop()
                if metrics is not None:
                    metrics.close()
                return self._stop_on_signal(stop)
            if bad_ranks:
                continue
            interval_tokens += self.tokens_per_step
            interval_loss += loss
            interval_steps += 1
            at_end = self.step == self.end_step
            do_eval = bool(t.eval_every) and (self.step % t.eval_every == 0 or at_end)
            if self.step % t.log_every == 0 or do_eval or at_end:
                mean_loss = distributed.all_reduce_sum([interval_loss / interval_steps], self.device)[0] / self.world
                eval_loss = self.evaluate() if do_eval else None
                if eval_loss is not None:
                    self.last_eval = eval_loss
                row: dict[str, Any] = {
                    "step": self.step,
                    "loss": round(mean_loss, 6),
                    "lr": self.scheduler.get_last_lr()[0],
                    "tokens_per_s": round(interval_tokens / interval_time, 1) if interval_time else 0.0,
                    "step_time_s": round(interval_time / interval_steps, 5),
                    "grad_norm": round(float(grad_norm), 6),
                    "tokens": self.tokens_seen,
                    "elapsed_s": round(time.perf_counter() - loop_start, 4),
                }
                if eval_loss is not None:
                    row["eval_loss"] = round(eval_loss, 6)
                if env.is_main and metrics is not None:
                    metrics.write(row)
                    log.info(
                        "step %d/%d loss %.4f%s lr %.3e tokens/s %s step_time %.3fs",
                        self.step,
                        self.end_step,
                        mean_loss,
                        f" eval_loss {eval_loss:.4f}" if eval_loss is not None else "",
                        row["lr"],
                        f"{row['tokens_per_s']:,.0f}",
                        row["step_time_s"],
                    )
                progress.update(self.step, f"loss {mean_loss:.3f}")
                interval_time, interval_tokens, interval_loss, interval_steps = 0.0, 0, 0.0, 0
            else:
                progress.update(self.step)
            if env.is_main and t.sample_every and self.step % t.sample_every == 0 and not at_end:
                last_sample = self.sample()
                log.info("sample at step %d: %s", self.step, last_sample.replace("\n", " "))
                if metrics is not None:
                    metrics.text("sample", last_sample, self.step)
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or at_end:
                self.save()
            self.last_eval = None
        progress.stop()
        if self.monitor is not None:
            self.monitor.stop()
        # Decided from state every rank shares: on a LAN job without shared storage the
        # other nodes' checkpoint directories are empty, and a filesystem check would make
        # only some ranks enter the (collective) save.
        if self.step > 0 and self.saved_step != self.step:
            self.save()  # the last step was skipped (non-finite) and so was its checkpoint
        final_ckpt = checkpoint.list_complete(self.ckpt_root)
        if env.is_main:
            last_sample = self.sample()
            log.info("sample: %s", last_sample.replace("\n", " "))
            if metrics is not None:
                metrics.text("sample", last_sample, self.step)
                metrics.close()
            summary = {
                "run_dir": str(self.run_dir),
                "step": self.step,
                "max_steps": self.max_steps,
                "finished": self.step >= self.max_steps,
                "checkpoint": str(final_ckpt[0].path) if final_ckpt else None,
                "metrics": str(self.run_dir / "metrics.jsonl"),
                "sample": last_sample,
                "n_params": self.n_params,
                "world_size": self.world,
                "backend": self.backend,
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        try:
            distributed.barrier()
        except Exception as exc:
            # Every rank got here after the last (collective) checkpoint, so nothing is lost: a peer
            # that exited first and closed its connections must not turn a finished run into a failure.
            log.warning("a peer left before the final barrier (%s); the run had already finished and saved", str(exc).splitlines()[0][:160])
        if env.is_main:
            if self.step < self.max_steps:
                log.info("stopped at step %d of %d (train.stop_at); re-run the same command to continue", self.step, self.max_steps)
            log.info("all %d ranks finished at step %d", self.world, self.step)
        return 0


@contextlib.contextmanager
def _process_group_cleanup() -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aura_hpc.train", description=__doc__)
    parser.add_argument("config", help="a resolved run config (RUN_DIR/config.yaml)")
    args = parser.parse_args(argv)
    env = DistEnv.from_environ()
    from aura_hpc import worker_log
    from aura_hpc.console import ProgressAwareHandler

    try:
        cfg = load_run_file(args.config)
    except AuraError as exc:
        worker_log.setup(None, env.rank)
        log.error("%s", exc)
        return exc.exit_code
    # Library progress bars (tqdm) and download chatter do not belong in per-rank log files.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    stream = ProgressAwareHandler(sys.stdout) if env.is_main else None
    worker_log.setup(cfg.run_dir / "logs", env.rank, stream)
    with _process_group_cleanup():
        try:
            return Trainer(cfg, env).run()
        except AuraError as exc:
            log.error("%s", exc)
            return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
