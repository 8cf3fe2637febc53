"""The training loop: `Trainer.run()` is the outline of a run; the parts live beside it.

process/runtime.py (device, precision, process group), parts/build.py (data, model, optimizer),
checkpoint/checkpointer.py (save, resume, rollback), loop/step.py (one optimizer step), loop/evaluation.py
(eval loss, samples), loop/health.py (monitor and GPU breaker), strategies/ (DDP, FSDP, ZeRO, DiLoCo).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.config import RunConfig
from aura_hpc.ops.gpu_health import is_gpu_error
from aura_hpc.train.checkpoint import files as checkpoint
from aura_hpc.train.checkpoint.checkpointer import Checkpointer
from aura_hpc.train.instruments.seam import Instruments
from aura_hpc.train.loop import endings
from aura_hpc.train.loop.batches import Batches
from aura_hpc.train.loop.data_feed import DataFeed, DataUnavailable
from aura_hpc.train.loop.evaluation import Sampler, evaluate
from aura_hpc.train.loop.health import HealthWatch
from aura_hpc.train.loop.metrics import Interval, MetricsWriter
from aura_hpc.train.loop.screening import LeaveOut, screen_nodes
from aura_hpc.train.loop.step import StepOutcome, Stepper, StepResult
from aura_hpc.train.loop.stragglers import StragglerWatch, straggler_action
from aura_hpc.train.parts.build import build, compiled, describe, lan_advice
from aura_hpc.train.parts.state import Position
from aura_hpc.train.process import progress as progress_page
from aura_hpc.train.process import runtime
from aura_hpc.train.process.dist_env import DistEnv
from aura_hpc.train.process.stop import StopRequest
from aura_hpc.train.process.time_ledger import LAUNCH_ENV
from aura_hpc.train.strategies.base import OuterLoop, capability, sharding

log = logging.getLogger("aura_hpc")
# The same command run again, or another started under a finished run's name (the quick start's `tiny`).
NOTHING_TO_DO = "nothing to do: the run is already at step %d of %d (fix: --set train.max_steps=N to train on, or a new --run-name)"

ROLLED_BACK = -1  # _settle's answer after a rollback: the loop goes on from the restored step


class Trainer:
    def __init__(self, cfg: RunConfig, env: DistEnv, why_not_leave_out: LeaveOut | None = None) -> None:
        self.cfg, self.env = cfg, env
        self.why_not_leave_out = why_not_leave_out  # Slurm: why a node the screen names cannot be left out (slurm/exclude.py)
        self.run_dir = cfg.run_dir
        self.pos = Position()
        self.health = HealthWatch(cfg, env)
        self.page = progress_page.current()  # where the launcher's hang watchdog sees this rank
        self.metrics: MetricsWriter | None = None

    def run(self) -> int:
        """Set up, resume, train to the end step (or a stop), finish; returns the exit status."""
        self.rt = runtime.start(self.cfg, self.env)
        self.instruments = Instruments(self.run_dir, self.env.rank)
        self.page.on_enter.append(self.instruments.entering)
        with self.instruments.whole_run(self.cfg.train.compile, self.rt.device):
            slow = self.instruments.screen_slowness(self.env.restart_count)  # before the model: a node left out costs no build
            screened = screen_nodes(self.cfg, self.env, self.rt.device, self.why_not_leave_out, slow)
            return self._run() if screened is None else screened

    def _run(self) -> int:
        cfg, env = self.cfg, self.env
        self.memory_base = runtime.host_memory_peak()  # what the process held before the model existed
        self.parts, self.layout, wrapped = build(cfg, env, self.rt)
        self.wrapped = wrapped
        self.ckpt = Checkpointer(cfg, env, self.rt, self.parts, self.layout, self.pos, wrapped)
        self.ckpt.resume()
        self.feed = DataFeed(self.parts.data, self.parts.order, patience_s=_patience(cfg))
        try:
            self.feed.setup(cfg.train.eval_sequences or cfg.train.eval_batches * cfg.train.batch_size)
        except DataUnavailable as exc:
            return endings.data_unavailable(self, exc)
        batches = Batches(self.parts, self.layout, env.rank, self.rt.device, self.feed)
        stepper = Stepper(cfg.train, env.rank, self.layout.world, self.rt, self.parts, wrapped, batches)
        self.clock = stepper.clock
        self.sample = Sampler(self.parts, cfg.train, self.rt, env.is_main, sharding(wrapped))
        if self.pos.step < self.layout.end_step:
            stepper.warm_up()
        if env.is_main:
            for line in describe(cfg, self.parts, self.layout, self.rt, self.pos.step, str(self.run_dir)):
                log.info("%s", line)
        lan_advice(cfg, self.parts.data.vocab_size, self.rt.device, env)
        collectives.barrier()
        self._open_outputs()
        stop = StopRequest()
        stop.install()
        self.health.start(self._resources_to_tensorboard)
        with self.instruments.around_steps(wrapped.module, wrapped.model, compiled(self.parts.model), runtime.rng_kept):
            try:
                status = self._train(stepper, batches, stop)
                if (outer := capability(wrapped, OuterLoop)) is not None:
                    outer.drain()  # a portion of a DiLoCo meeting still crossing: no collective in flight as the group goes
            except DataUnavailable as exc:
                status = endings.data_unavailable(self, exc)
            finally:
                self.feed.close()
        if status is not None:
            return status
        return self._finish()

    # ---- the loop -----------------------------------------------------------------------
    def _open_outputs(self) -> None:
        """Rank 0's progress bar (on a terminal), metrics.jsonl and TensorBoard."""
        from aura_hpc.console import ProgressAwareHandler, TrainProgress

        env, end = self.env, self.layout.end_step
        self.progress = TrainProgress(end, self.pos.step, enabled=env.is_main and self.pos.step < end)
        hosts = collectives.gather_json(env.hostname) if self.layout.world > 1 else []
        self.stragglers = StragglerWatch(hosts, straggler_action(self.cfg, self.env)) if env.is_main and hosts else None
        if env.is_main:
            self.metrics = MetricsWriter(
                self.run_dir, self.pos.step, self.cfg, _mfu_scale(self.cfg, self.parts.n_params, self.layout.world, self.rt.device)
            )
            for h in log.handlers:
                if isinstance(h, ProgressAwareHandler):
                    h.progress = self.progress
            if self.pos.step >= end:
                log.info(NOTHING_TO_DO, self.pos.step, end)

    def _train(self, stepper: Stepper, batches: Batches, stop: StopRequest) -> int | None:
        """Steps until the end step; an exit status when the run stops early (signal, GPU fault).

        A step's report is read one step late, once the next step is queued, except at the
        steps that log, evaluate, sample or checkpoint (and the first): those wait for it.
        """
        pos, lay = self.pos, self.layout
        self.interval = Interval()
        self.save_due = False  # train.checkpoint_every_s: agreed at the last logged step
        self.bad_in_a_row = 0
        self.loop_start = time.perf_counter()
        pending: StepOutcome | None = None
        first = True
        while pos.step < lay.end_step:
            quiet = not first and not self._due(pos.step + 1)
            # A GPU's asynchronous fault (an Xid) surfaces where the host next waits for it: reading a
            # report, most often, or in an evaluation or a checkpoint; anywhere in the loop it is the GPU's.
            try:
                with self.instruments.step(pos.step + 1, quiet):
                    outcome = stepper.step(pos, stop, self.health.fault_seen)
                    pos.step += 1
                    pos.tokens_seen += lay.tokens_per_step
                    batches.prefetch(pos)
                    self.page.step_done(pos.step)
                due = first or self._due(pos.step)
                reports = [pending] if pending is not None else []
                pending = None if due else outcome
                if due:
                    reports.append(outcome)
                results = [self.instruments.read(r) for r in reports]
                status = self._settle(results, stop)
                if status == ROLLED_BACK:
                    pending = None
                    continue
                if status is not None:
                    return status
                if first:
                    first = False
                    self._first_step_done()
                    self.instruments.first_step_done()
                if due:
                    self._after_step(results[-1])
            except RuntimeError as exc:
                if not is_gpu_error(exc):
                    raise
                return self.health.gpu_error(exc, self.rt.device, self.pos.step)
        return None

    def _due(self, step: int) -> bool:
        """Steps whose report the loop must have before it goes on."""
        t = self.cfg.train
        every = (t.log_every, t.eval_every, t.checkpoint_every, t.sample_every)
        return step == self.layout.end_step or any(n and step % n == 0 for n in every)

    def _first_step_done(self) -> None:
        if self.env.is_main:
            _note_first_step(self.pos.step, self.loop_start)
        self.interval.restart_clock()

    def _settle(self, results: list[StepResult], stop: StopRequest) -> int | None:
        """Act on step reports, oldest first: skipped updates, rollback, stop, GPU fault."""
        t = self.cfg.train
        for r in results:
            if r.gpu_fault:
                self.progress.stop()
                return self._open_circuit()
            if r.bad_ranks:
                self.bad_in_a_row += 1
                if self.env.is_main:
                    log.warning(
                        "non-finite loss or gradient on rank(s) %s at step %d: update skipped (%d in a row)",
                        r.bad_ranks,
                        r.step,
                        self.bad_in_a_row,
                    )
                if self.bad_in_a_row >= t.nan_rollback_after:
                    with self.page.section("checkpoint"):
                        self.ckpt.rollback(self.bad_in_a_row)
                    if self.metrics is not None:
                        self.metrics.rolled_back(self.pos.step)  # the steps after it are redone
                    self.bad_in_a_row = 0
                    self.interval.reset()
                    return ROLLED_BACK
            else:
                self.bad_in_a_row = 0
                self.interval.add(r.loss, self.layout.tokens_per_step)
            if r.stop:
                self.progress.stop()
                with self.page.section("checkpoint"):
                    return endings.stop_on_signal(self, stop)
        return None

    def _after_step(self, r: StepResult) -> None:
        """Logging, evaluation, samples and checkpoints due at this step.

        A skipped (non-finite) step still gets its checkpoint: its weights are the last good ones.
        """
        t, pos = self.cfg.train, self.pos
        at_end = pos.step == self.layout.end_step
        do_eval = bool(t.eval_every) and (pos.step % t.eval_every == 0 or at_end)
        logged = not r.bad_ranks and self.interval.steps > 0 and (pos.step % t.log_every == 0 or do_eval or at_end)
        with self.page.section("evaluation" if do_eval else "step"):
            if logged:
                self._log_row(r, do_eval)
            else:
                if do_eval:  # a skipped update leaves the last good weights: still evaluated on schedule
                    self._eval_row(bool(r.bad_ranks))
                self.progress.update(pos.step)
        if t.sample_every and pos.step % t.sample_every == 0 and not at_end:
            with self.page.section("evaluation"):
                text = self.sample(pos.step)
            if text is not None:
                log.info("sample at step %d: %s", pos.step, text.replace("\n", " "))
                if self.metrics is not None:
                    self.metrics.text("sample", text, pos.step)
        if (t.checkpoint_every and pos.step % t.checkpoint_every == 0) or at_end or self.save_due:
            with self.page.section("checkpoint"):
                self.ckpt.save(last=at_end)
            self.save_due = False
        pos.last_eval = None
        self.clock.pause()
        if logged:
            self.interval.reset()
        else:
            self.interval.restart_clock()

    def _log_row(self, r: StepResult, do_eval: bool) -> None:
        pos, world, iv = self.pos, self.layout.world, self.interval
        elapsed = time.perf_counter() - iv.start  # before evaluating: eval time is not training speed
        busy = [0.0] * world  # every rank's time before its gradient exchanges, summed into place in one all-reduce
        busy[self.env.rank] = self.clock.take()
        every_s = self.cfg.train.checkpoint_every_s  # rank 0's clock decides for all: every rank saves at the same step
        late = self.env.is_main and every_s > 0 and time.perf_counter() - self.ckpt.saved_at >= every_s
        summed = collectives.reduce_values([iv.loss / iv.steps, float(late), *busy])
        self.save_due = summed[1] > 0
        mean_loss = summed[0] / world
        eval_loss = evaluate(self.parts, self.cfg.train, self.env.rank, world, self.rt) if do_eval else None
        if eval_loss is not None:
            pos.last_eval = eval_loss
        row: dict[str, Any] = {
            "step": pos.step,
            "loss": round(mean_loss, 6),
            "lr": trained_lr(self.parts.scheduler, pos.step),
            # None, not 0, when only an attempt's first step (warm-up, compilation) is in the interval.
            "tokens_per_s": round(iv.tokens / elapsed, 1) if iv.tokens and elapsed > 0 else None,
            "step_time_s": round(elapsed / iv.timed_steps, 5) if iv.timed_steps else None,
            "grad_norm": round(float(r.grad_norm), 6),
            "tokens": pos.tokens_seen,
            "elapsed_s": round(time.perf_counter() - self.loop_start, 4),
        }
        if eval_loss is not None:
            row["eval_loss"] = round(eval_loss, 6)
        if self.stragglers is not None:
            row.update(self.stragglers.interval(summed[2:], pos.step))
        if self.env.is_main and self.metrics is not None:
            self.metrics.write(row)
            _log_step(row, self.layout.end_step, mean_loss, eval_loss)
        self.progress.update(pos.step, f"loss {mean_loss:.3f}")

    def _eval_row(self, skipped: bool) -> None:
        pos = self.pos
        pos.last_eval = evaluate(self.parts, self.cfg.train, self.env.rank, self.layout.world, self.rt)
        if pos.last_eval is not None and self.env.is_main and self.metrics is not None:  # None: no validation sequence
            self.metrics.write({"step": pos.step, "eval_loss": round(pos.last_eval, 6), "update_skipped": skipped})
            log.info("step %d/%d eval_loss %.4f%s", pos.step, self.layout.end_step, pos.last_eval, " (update skipped)" if skipped else "")

    def _resources_to_tensorboard(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.resources(row, self.pos.step)

    # ---- endings ------------------------------------------------------------------------
    def _finish(self) -> int:
        """After the last step: a final checkpoint if needed, the sample, summary.json, a last barrier."""
        env, pos = self.env, self.pos
        self.page.enter("checkpoint")  # the final save, sample and barrier: the most generous section
        self.progress.stop()
        self.health.stop()
        # Decided from state every rank shares: on a LAN job without shared storage the
        # other nodes' checkpoint directories are empty, and a filesystem check would make
        # only some ranks enter the (collective) save.
        if pos.step > 0 and pos.saved_step != pos.step:
            self.ckpt.save(last=True)  # the last save was refused (weights not finite): try once more
        self.ckpt.wait()
        final_ckpt = checkpoint.list_complete(self.ckpt.root)
        if (last_sample := self.sample(pos.step, hold_others=False)) is not None:
            log.info("sample: %s", last_sample.replace("\n", " "))
            if self.metrics is not None:
                self.metrics.text("sample", last_sample, pos.step)
                self.metrics.close()
            summary = {
                "run_dir": str(self.run_dir),
                "step": pos.step,
                "max_steps": self.layout.max_steps,
                "finished": pos.step >= self.layout.max_steps,
                "checkpoint": str(final_ckpt[0].path) if final_ckpt else None,
                "metrics": str(self.run_dir / "metrics.jsonl"),
                "sample": last_sample,
                "n_params": self.parts.n_params,
                "world_size": self.layout.world,
                "backend": self.rt.backend,
                "strategy": self.wrapped.name,
                "peak_memory_gib": round(runtime.peak_memory(self.rt.device, self.memory_base) / 2**30, 3),
                **self.instruments.summary(),
                "launch": os.environ.get(LAUNCH_ENV) or None,  # the one that wrote it, for `status` (a copy's file times are new)
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        try:
            collectives.barrier()
        except Exception as exc:
            # Every rank got here after the last (collective) checkpoint, so nothing is lost: a peer
            # that exited first and closed its connections must not turn a finished run into a failure.
            log.warning("a peer left before the final barrier (%s); the run had already finished and saved", str(exc).splitlines()[0][:160])
        if env.is_main:
            if pos.step < self.layout.max_steps:
                log.info("stopped at step %d of %d (train.stop_at); re-run the same command to continue", pos.step, self.layout.max_steps)
            peak = runtime.peak_memory(self.rt.device, self.memory_base) / 2**30
            log.info("all %d ranks finished at step %d (peak memory of rank 0: %.2f GiB)", self.layout.world, pos.step, peak)
        return 0

    def _open_circuit(self) -> int:
        return self.health.open_circuit(self.ckpt, self.pos.step)


def _mfu_scale(cfg: RunConfig, n_params: int, world: int, device: Any) -> float | None:
    """tokens/s (all ranks) times this is the model FLOPs utilisation, where the GPU's peak is known."""
    if device.type != "cuda":
        return None
    import torch

    from aura_hpc.ops.reference_loop import flops_per_token, peak_for

    peak = peak_for(torch.cuda.get_device_name(device))
    if not peak:
        return None
    return flops_per_token(n_params, cfg.model.n_layer, cfg.model.n_embd, cfg.data.seq_len) / (peak * 1e12 * world)


def _log_step(row: dict[str, Any], end: int, mean_loss: float, eval_loss: float | None) -> None:
    speed = row["tokens_per_s"]
    log.info(
        "step %d/%d loss %.4f%s lr %.3e %s",
        row["step"],
        end,
        mean_loss,
        f" eval_loss {eval_loss:.4f}" if eval_loss is not None else "",
        row["lr"],
        f"tokens/s {speed:,.0f} step_time {row['step_time_s']:.3f}s"
        if speed is not None
        else "(tokens/s from the next row: this one holds only the attempt's first step, warm-up included)",
    )


def _note_first_step(step: int, loop_start: float) -> None:
    """Lets operators (and bench_faults.py) see how long a restart took to train again."""
    log.info(
        "first step of this attempt done: step %d at unix time %.3f (%.1fs including compilation and warm-up, not counted in tokens/s)",
        step,
        time.time(),
        time.perf_counter() - loop_start,
    )


def _patience(cfg: RunConfig) -> float:
    from aura_hpc.data.storage import window_patience_s

    return window_patience_s(cfg.data.read_tries, cfg.data.read_timeout_s, cfg.data.shuffle_window)


def trained_lr(scheduler: Any, step: int) -> float:
    """The rate step `step` trained with; the scheduler already holds the next update's."""
    return float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](max(step - 1, 0)))
