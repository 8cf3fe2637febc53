"""Building a run from its config: data, the agreement of every rank, model, optimizer, layout."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import RunConfig, embedding_rows, max_steps_for, per_machine, recorded_horizon
from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.packed import PackedTokens
from aura_hpc.errors import ConfigError, DataError
from aura_hpc.train.model.language_model import (
    LanguageModelLoss,
    build_model,
    compile_blocks,
    count_parameters,
    enable_activation_checkpointing,
    uses_chunked_loss,
)
from aura_hpc.train.model.meta_init import build_on_meta
from aura_hpc.train.parts.schedule import make_optimizer, make_scheduler
from aura_hpc.train.parts.state import Layout, Parts
from aura_hpc.train.process.dist_env import DistEnv
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.strategies import Wrapped, wrap
from aura_hpc.train.strategies.base import OuterLoop, capability

log = logging.getLogger("aura_hpc")


def build(cfg: RunConfig, env: DistEnv, rt: Runtime) -> tuple[Parts, Layout, Wrapped]:
    """Data, model spread over the ranks by the strategy, then the optimizer over what the strategy made."""
    t = cfg.train
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    data = open_data(cfg, env.local_rank, env.local_world_size)
    check_same_everywhere(cfg, env, data)
    model, loss_model, init = model_and_loss(cfg, rt, data, cfg.dist.strategy, env.world_size)
    cuda = rt.device.type == "cuda"

    world = env.world_size
    max_steps = _horizon(cfg, world, env)
    end_step = min(t.stop_at, max_steps) if t.stop_at else max_steps
    layout = Layout(t.batch_size, t.grad_accum, world, cfg.data.seq_len, max_steps, end_step)
    n_train = data.num_sequences("train")
    if n_train < layout.per_step and not cfg.data.stream:  # a stream's size is known only once it is read
        msg = (
            f"the prepared data has {n_train} training sequences of {cfg.data.seq_len} tokens, fewer than one "
            f"effective batch of {layout.per_step} (= {t.batch_size} per device x {world} process{'es' if world != 1 else ''} x "
            f"{t.grad_accum} accumulation)"
        )
        if not t.allow_oversubscription:
            raise DataError(
                msg + " (fix: more data, a smaller train.batch_size/data.seq_len, fewer processes, or "
                "--set train.allow_oversubscription=true to repeat the data)"
            )
        if env.is_main:
            log.warning("%s; train.allow_oversubscription=true: repeating the data to fill each batch", msg)
    n_params = count_parameters(model)  # before the strategy: ZeRO-3 leaves each rank empty parameters
    fused = t.fused_optimizer == "true" or (t.fused_optimizer == "auto" and cuda)
    materialize = None if init is None else (lambda m: init.materialize(m, rt.param_dtype))
    wrapped, optimizer = wrap(loss_model, model, cfg, rt, world, lambda m: make_optimizer(m, t, fused=fused), env, materialize)
    if (outer := capability(wrapped, OuterLoop)) is not None:
        outer.last_step = max_steps
    seed_dropout(t.seed, env.rank)
    parts = Parts(
        data=data,
        order=_order(data, cfg),
        model=model,
        loss_model=loss_model,
        n_params=n_params,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, t, max_steps),
        scaler=torch.amp.GradScaler("cuda", enabled=rt.autocast_dtype == torch.float16),
    )
    return parts, layout, wrapped


def open_data(cfg: RunConfig, local_rank: int = 0, local_world: int = 1) -> Any:
    """The run's tokens: a prepared directory (PackedTokens) or, with data.stream, text encoded as it is read."""
    data: Any
    if cfg.data.stream:
        from aura_hpc.data.stream import StreamTokens

        data = StreamTokens(cfg.data, cfg.data.seq_len, local_rank, local_world)
    elif not cfg.data.path:
        raise DataError("data.path is empty (fix: --set data.path=DIR from `python -m aura_hpc prepare`)")
    else:
        from aura_hpc.data.cache import for_data

        data = PackedTokens(cfg.data.path, cfg.data.seq_len, cache=for_data(cfg.data))
    if cfg.model.vocab_size and cfg.model.vocab_size != data.vocab_size:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} does not match the data's tokenizer "
            f"({data.vocab_size}) (fix: --set model.vocab_size=0 to take it from the data)"
        )
    return data


def model_and_loss(cfg: RunConfig, rt: Runtime, data: Any, strategy: str, world: int) -> tuple[torch.nn.Module, LanguageModelLoss, Any]:
    """Our GPT-2 for this data, the loss around it, and the record that initialises it once sharded (or
    None): what `local` (every strategy, DiLoCo's replicas included) and the parameter server's copies
    are made of. `strategy` "ps" is the parameter server's: a whole model on every process."""
    t = cfg.train
    rows = embedding_rows(cfg.model, data.vocab_size)
    model, init = _build_model(lambda: build_model(cfg.model, rows, data.eos_id, data.vocab_size), cfg, strategy, rt, world)
    cuda = rt.device.type == "cuda"
    if t.activation_checkpointing:
        enable_activation_checkpointing(model)
    loss_model = LanguageModelLoss(model, chunked=uses_chunked_loss(t.loss, t.precision, cuda), compute_dtype=rt.autocast_dtype)
    # "auto" leaves out ZeRO (DeepSpeed wraps the module its own way) and the parameter server, whose
    # copies swap their weights in place every round; "true" compiles both.
    if t.compile == "true" or (t.compile == "auto" and cuda and not strategy.startswith("zero") and strategy != "ps"):
        compile_blocks(model)
        loss_model.compiled = True
    return model, loss_model, init


def _build_model(
    factory: Callable[[], torch.nn.Module], cfg: RunConfig, strategy: str, rt: Runtime, world: int
) -> tuple[torch.nn.Module, Any]:
    """The model, and the record that initialises it once sharded (fsdp), or None. Sharded strategies
    never hold the whole fp32 model on every rank: FSDP builds it on the meta device and initialises
    it shard by shard (train/model/meta_init.py); ZeRO-3 builds it partitioned (DeepSpeed's zero.Init) and
    initialises it a parameter at a time (strategies/zero.py). Both give a host build's exact weights."""
    if strategy == "fsdp":
        on_meta = build_on_meta(factory)
        if on_meta is not None:
            on_meta[0].to(dtype=rt.param_dtype)
            return on_meta
    if strategy == "zero3":
        from aura_hpc.train.strategies.zero import build_partitioned

        partitioned = build_partitioned(factory, cfg, rt, world)
        if partitioned is not None:
            return partitioned, None
    model = factory()
    model.to(device=rt.device, dtype=rt.param_dtype)
    return model, None


def _order(data: Any, cfg: RunConfig) -> GlobalOrder:
    if cfg.data.stream:
        from aura_hpc.data.stream import StreamOrder

        return StreamOrder(data, cfg.train.seed, cfg.data.shuffle_window)
    return GlobalOrder(data.counts("train"), cfg.train.seed, cfg.data.shuffle_window)


def _horizon(cfg: RunConfig, world: int, env: DistEnv) -> int:
    """The schedule's horizon in steps. With train.max_tokens it is fixed when the run first starts
    (recorded in every checkpoint): resuming at another world size keeps the learning-rate schedule
    instead of stretching or squeezing it, and says how the token total changes."""
    horizon = max_steps_for(cfg, world)
    if cfg.train.max_tokens <= 0:
        return horizon
    # LAN nodes without shared storage have no checkpoints: rank 0's answer counts.
    recorded = recorded_horizon(cfg) if env.is_main else 0
    recorded = int(collectives.broadcast_json(recorded))
    if recorded and recorded != horizon:
        if env.is_main:
            per_step = cfg.train.batch_size * cfg.train.grad_accum * world * cfg.data.seq_len
            log.warning(
                "train.max_tokens: keeping this run's schedule horizon of %d steps (set when it started, at another world "
                "size); a step is now %d tokens, so the total will differ from train.max_tokens=%d",
                recorded,
                per_step,
                cfg.train.max_tokens,
            )
        return recorded
    return horizon


def seed_dropout(seed: int, rank: int) -> None:
    """Each rank its own random stream from here on, so dropout masks differ across ranks (with one
    seed everywhere, every rank would drop the same units of its batch). The initial weights were
    drawn before, from train.seed alone, the same on every rank. Rank 0 keeps the stream it has,
    so a single-process run is unchanged."""
    if rank:
        torch.manual_seed(seed + 1_000_003 * rank)


def _shared_settings(cfg: RunConfig) -> dict[str, str]:
    """What every rank must hold alike (config/per_machine.py), as text that compares exactly."""
    settings = per_machine.shared(cfg, ("model", "train", "dist"), per_machine.PER_MACHINE) | per_machine.shared_data(cfg)
    if cfg.dist.deepspeed_config:  # what it holds, not where: one path on two laptops can hold two configs (a hang in ZeRO)
        from aura_hpc.config.deepspeed import load_user_config

        settings["dist.deepspeed_config"] = _without_paths(load_user_config(cfg.dist.deepspeed_config))
    return {"model.fingerprint": cfg.model_fingerprint(), **{k: json.dumps(v, default=str, sort_keys=True) for k, v in settings.items()}}


def _without_paths(ds: object) -> object:
    """A DeepSpeed config less what each machine may place itself (offload's nvme_path, a monitor's output_path)."""
    if isinstance(ds, dict):
        return {k: _without_paths(v) for k, v in ds.items() if not str(k).endswith("path")}
    return [_without_paths(v) for v in ds] if isinstance(ds, list) else ds


def check_same_everywhere(cfg: RunConfig, env: DistEnv, data: PackedTokens) -> None:
    """Nodes prepared their data and wrote their config separately: they must agree, before any
    collective that depends on the config (the first one is this gather)."""
    mine = [data.manifest.get("data_sha256"), _shared_settings(cfg)]
    every = collectives.gather_json(mine)
    for r, theirs in enumerate(every):
        if theirs[0] != mine[0] and cfg.data.stream:  # the stream's key: its files' contents, the tokenizer, the split
            raise DataError(
                f"rank {r} streams other data than rank {env.rank} (other text files or dataset files, another tokenizer) "
                "(fix: the same data.path or data.dataset contents and the same data.tokenizer on every node, e.g. copy them)"
            )
        if theirs[0] != mine[0]:
            raise DataError(
                f"rank {r} has different prepared data than rank {env.rank} "
                "(fix: use the same data.path contents on every node, e.g. copy the prepared directory)"
            )
        differ = sorted(k for k in set(mine[1]) | set(theirs[1]) if mine[1].get(k) != theirs[1].get(k))
        if differ:
            key = next((k for k in differ if k != "model.fingerprint"), differ[0])
            if key == "dist.deepspeed_config":
                raise ConfigError(
                    f"rank {r} runs a different config than rank {env.rank}: the DeepSpeed JSON of dist.deepspeed_config holds "
                    "other settings there (fix: the same JSON on every node, e.g. copy it)"
                )
            raise ConfigError(
                f"rank {r} runs a different config than rank {env.rank}: {key} is {theirs[1].get(key)} there and "
                f"{mine[1].get(key)} here (fix: pass the same --config/--set on every node)"
            )


def data_line(cfg: RunConfig, data: Any) -> str:
    """What the run reads; a validation split without one sequence is said (eval_loss was simply never logged)."""
    n_val = data.num_sequences("val")
    line = f"data: {data.num_sequences('train'):,} train / {n_val:,} val sequences of {cfg.data.seq_len} tokens from "
    line += cfg.data.dataset if cfg.data.stream and cfg.data.dataset else cfg.data.path
    if n_val == 0:
        fix = (
            "a larger data.val_fraction or data.shuffle_window: a stream's validation comes from the pieces of its first window"
            if cfg.data.stream
            else "prepare the data again with a larger --val-fraction"
        )
        line += f"; no validation sequence, so no eval_loss (fix: {fix})"
    return line


def describe(cfg: RunConfig, parts: Parts, layout: Layout, rt: Runtime, start_step: int, run_dir: str) -> list[str]:
    """The lines rank 0 prints before the first step: model, batch arithmetic, data, schedule."""
    t, data = cfg.train, parts.data
    return [
        f"run directory: {run_dir}",
        f"model: GPT-2 {cfg.model.n_layer} layers x {cfg.model.n_embd} wide, {cfg.model.n_head} heads, "
        f"{parts.n_params:,} parameters ({parts.n_params / 1e6:.1f}M), vocab {data.vocab_size}"
        + (f" (embedding padded to {cfg.model.padded_vocab_size})" if cfg.model.padded_vocab_size > data.vocab_size else ""),
        f"batch: {t.batch_size} per device x {layout.world} process{'es' if layout.world != 1 else ''} x {t.grad_accum} accumulation = "
        f"effective batch {layout.per_step} sequences = {layout.tokens_per_step:,} tokens per step",
        data_line(cfg, data),
        f"steps: {start_step} -> {layout.end_step} (schedule horizon {layout.max_steps}), lr {t.lr:g} "
        f"{t.schedule} with {min(t.warmup_steps, layout.max_steps)} warmup, precision {t.precision} "
        f"(params {str(rt.param_dtype).removeprefix('torch.')}, autocast "
        f"{str(rt.autocast_dtype).removeprefix('torch.') if rt.autocast_dtype else 'off'})",
        f"strategy: {strategy_line(cfg)}",
        f"compute: torch.compile {'on (per block)' if compiled(parts.model) else 'off'}, loss "
        f"{'chunked' if getattr(parts.loss_model, 'chunked', False) else 'full logits'}, activation checkpointing "
        f"{'on' if t.activation_checkpointing else 'off'}, optimizer {type(parts.optimizer).__name__}"
        f"{' (fused)' if getattr(parts.optimizer, '_step_supports_amp_scaling', False) else ''}",
    ]


def lan_advice(cfg: RunConfig, vocab: int, device: torch.device, env: DistEnv) -> None:
    """`local` across LAN machines: the link measured (a small all-reduce) and, on rank 0, one line
    saying whether this strategy suits it (ops/link_advice.py)."""
    nodes = env.nnodes
    if nodes < 2 or not collectives.active():
        return
    from aura_hpc.ops import link_advice

    link = link_advice.measure_link(nodes, probe_mb=0.25)
    if env.is_main:
        opts = link_advice.options(cfg, vocab, link, link_advice.compute_seconds(cfg, vocab, device))
        log.info("%s", link_advice.advice(opts, link))


def strategy_line(cfg: RunConfig) -> str:
    d = cfg.dist
    if d.strategy == "diloco":
        wire = f"deltas in {d.diloco_wire}" + (f", each meeting crossing during {d.diloco_overlap} steps" if d.diloco_overlap else "")
        return (
            f"diloco (replicas meet every {d.sync_every} steps, outer Nesterov SGD lr {d.outer_lr:g} momentum {d.outer_momentum:g}, {wire})"
        )
    if d.strategy == "ddp":
        return "ddp" + (
            f" (gradients compressed: {d.compress}" + (f", rank {d.powersgd_rank})" if d.compress == "powersgd" else ")")
            if d.compress != "none"
            else ""
        )
    zero = {"zero1": "optimizer state", "zero2": "optimizer state and gradients"}
    sharded = zero.get(d.strategy, "parameters, gradients and optimizer state")
    return f"{d.strategy} ({sharded} sharded)"


def compiled(model: torch.nn.Module) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
