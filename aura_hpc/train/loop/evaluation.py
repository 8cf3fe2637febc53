"""Validation loss over all ranks, and text samples from the model being trained."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch

from aura_hpc.comm import collectives
from aura_hpc.config import TrainConfig
from aura_hpc.data.packed import eval_set
from aura_hpc.train.parts.state import Parts
from aura_hpc.train.process.runtime import Runtime
from aura_hpc.train.strategies.base import ShardedCheckpoints


@torch.no_grad()
def evaluate(parts: Parts, t: TrainConfig, rank: int, world: int, rt: Runtime) -> float | None:
    """Mean loss over a fixed set of validation sequences (N spread evenly over the split: data/packed.py's
    eval_set), split over the ranks; None without a validation split. The set does not depend on the world
    size or the accumulation, so the same weights report the same eval_loss under any layout.

    Every rank runs the same number of forwards: under fsdp and zero3 each forward gathers the
    parameters from every rank, so a rank with one batch fewer would leave the others waiting in
    it. A rank short of sequences runs its last batch again (or the first sequence), counted zero."""
    data, model = parts.data, parts.loss_model
    n_val = data.num_sequences("val")
    if n_val == 0:
        return None
    picked = eval_set(n_val, t.eval_sequences or t.eval_batches * t.batch_size)
    n = len(picked)
    mine = picked[rank::world]
    forwards = math.ceil(math.ceil(n / world) / t.batch_size)  # the most any rank needs
    model.eval()
    loss_sum, count = 0.0, 0
    # Eagerly: evaluation mode and a short last batch would each be one more compiled graph of every
    # block (a recompilation the training loop must never see); it is a small share of the time.
    with _eager():
        for i in range(forwards):
            idx = mine[i * t.batch_size : (i + 1) * t.batch_size]
            weight = len(idx)
            if not idx:  # only to keep in step with the ranks that still have sequences
                idx = mine[-t.batch_size :] or [0]
            x = torch.from_numpy(data.sequences("val", idx)).to(rt.device)
            with rt.autocast():
                loss = float(model(x))
            if weight:
                loss_sum += loss * weight
                count += weight
    model.train()
    total, cnt = collectives.reduce_values([loss_sum, float(count)])
    return total / cnt if cnt else None


def _eager() -> contextlib.AbstractContextManager[Any]:
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@torch.no_grad()
def sample(parts: Parts, t: TrainConfig, step: int, rt: Runtime, model: Any = None) -> str:
    """A short continuation of train.sample_prompt (rank 0 only), from `model` or the live one."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(parts.data.tokenizer_dir / "tokenizer.json"))
    live = model is None
    model = parts.model if live else model
    device = rt.device if live else torch.device("cpu")
    ids = torch.tensor([tok.encode(t.sample_prompt, add_special_tokens=False).ids], device=device)
    model.eval()
    # Its own generator: the training RNG streams (resume would diverge) and every GPU's generator
    # (torch.manual_seed would reseed them all, the one training on this rank too) stay as they are.
    # Compiled blocks run eagerly here: eval mode and a sample's lengths would each be one more compilation.
    generator = torch.Generator(device=device)
    generator.manual_seed(t.seed + step)
    with _eager(), rt.autocast() if live else contextlib.nullcontext():
        out = model.sample(ids, t.sample_tokens, temperature=0.8, top_k=40, allowed=parts.data.vocab_size, generator=generator)
    model.train()
    # The sample ends with its document: past an end-of-text token the model starts another, unrelated one.
    prompt, new = ids[0].tolist(), out[0, ids.shape[1] :].tolist()
    if parts.data.eos_id in new:
        new = new[: new.index(parts.data.eos_id)]
    return str(tok.decode(prompt + new, skip_special_tokens=True))


def host_model(like: Any, weights: dict[str, torch.Tensor], cached: Any = None) -> Any:
    """A plain fp32 copy of the model in host memory holding `weights` (samples under sharded strategies)."""
    if cached is None:
        # Its initial weights are overwritten at once: drawn from the training's CPU stream, they moved it (a
        # restarted run, whose first sample builds the copy again, no longer resumed bit for bit with dropout on CPUs).
        with torch.random.fork_rng(devices=[]):
            cached = type(like)(copy.deepcopy(like.config)).to(torch.float32)
    missing, unexpected = cached.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()}, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # saved once, as the token embedding
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"the gathered weights do not fit the model: missing {sorted(set(missing) - tied)[:4]}, unexpected {unexpected[:4]}"
        )
    return cached


class Sampler:
    """Samples on rank 0. Under sharded strategies every rank takes part in gathering the weights, and
    rank 0 keeps one host copy of the model for them from sample to sample."""

    def __init__(self, parts: Parts, t: TrainConfig, rt: Runtime, is_main: bool, sharded: ShardedCheckpoints | None) -> None:
        self.parts, self.t, self.rt, self.is_main, self.sharded = parts, t, rt, is_main, sharded
        self._host: Any = None

    def __call__(self, step: int, hold_others: bool = True) -> str | None:
        """Rank 0's sample; `hold_others`: the other ranks wait for it here (the run's last sample: in the final
        barrier, which a peer that already left does not fail)."""
        text = None
        if self.sharded is not None:
            weights = self.sharded.full_weights()  # collective
            if self.is_main:
                self._host = host_model(self.parts.model, weights, self._host)
                text = sample(self.parts, self.t, step, self.rt, self._host)
        elif self.is_main:
            text = sample(self.parts, self.t, step, self.rt)
        # Rank 0 samples alone (a sharded model's from a CPU copy: minutes for a big one); the others wait here, in
        # the sample's section and time, not in the next step's: another node's watchdog took that wait for a hang.
        if hold_others:
            collectives.barrier()
        return text
