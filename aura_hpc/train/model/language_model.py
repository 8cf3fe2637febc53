"""The GPT-2 model (ours, train/model/gpt.py), built from config and trained from scratch, and the loss
the loop trains on. Knows nothing of distribution: strategies/ wraps `LanguageModelLoss` (the
module whose forward is the training loss); checkpoints save the model inside it in transformers'
GPT-2 layout, which `generate` loads with transformers itself (`load_pretrained`).
"""

from __future__ import annotations

from typing import Any

import torch

from aura_hpc.config import ModelConfig
from aura_hpc.train.model.gpt import GPT, GPTConfig
from aura_hpc.train.model.loss import chunked_cross_entropy


def build_model(cfg: ModelConfig, vocab_size: int, eos_id: int, tokens: int = 0) -> GPT:
    """Our GPT-2 (train/model/gpt.py): GPT2LMHeadModel's names and numerics, none of its per-step host work.
    `vocab_size` embedding rows, of which the tokenizer's `tokens` are tokens (the rest is padding)."""
    return GPT(GPTConfig(vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.dropout, eos_id, tokens=tokens))


def load_pretrained(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """A saved model folder, on every transformers release we support (`dtype=` replaced `torch_dtype=` in 4.56)."""
    import transformers
    from transformers import GPT2LMHeadModel

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return GPT2LMHeadModel.from_pretrained(path, **{key: dtype})


def padding_suppressed(model: Any, tokenizer_vocab: int) -> dict[str, Any]:
    """generate() arguments that keep padded embedding rows (no token behind them) out of samples."""
    rows = int(model.config.vocab_size)
    return {"suppress_tokens": list(range(tokenizer_vocab, rows))} if rows > tokenizer_vocab else {}


def count_parameters(model: torch.nn.Module) -> int:
    # Tied input/output embeddings are one tensor; parameters() already yields it once. A ZeRO-3
    # parameter is empty outside its gathers: DeepSpeed keeps its size as ds_numel.
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def uses_chunked_loss(loss: str, precision: str, gpu: bool) -> bool:
    """train.loss: chunked on GPUs by default, never under fp16 (its gradients would be formed before loss scaling)."""
    return loss == "chunked" or (loss == "auto" and gpu and precision != "fp16")


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) token batch, through the full logits."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    # At least fp32 for the softmax (bf16 logits lose the loss), and fp64 stays fp64.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class LanguageModelLoss(torch.nn.Module):
    """forward(batch) = the training loss of a (B, T+1) token batch; what the strategies wrap.

    `chunked` computes the loss from the last hidden states a slice of tokens at a time
    (train/model/loss.py) instead of materialising the whole batch's fp32 logits.
    """

    def __init__(self, lm: GPT, chunked: bool, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.lm = lm
        self.chunked = chunked
        self.compute_dtype = compute_dtype
        self.compiled = False  # set with the blocks' compilation: the chunked loss compiles too

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if not self.chunked:
            return lm_loss(self.lm, batch)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        hidden = self.lm.hidden(inputs)
        return chunked_cross_entropy(
            hidden.reshape(-1, hidden.size(-1)), self.lm.lm_head.weight, targets.reshape(-1), self.compute_dtype, compiled=self.compiled
        )


def enable_activation_checkpointing(lm: GPT) -> None:
    """Recompute each block's activations in the backward pass (non-reentrant: works with DDP and compile)."""
    lm.checkpoint_blocks = True


def compile_blocks(lm: GPT) -> int:
    """torch.compile each transformer block in place, whole (fullgraph: a graph break is an error); returns how many.

    Per block, as torchtitan does: each block's backward still ends on its own, so DDP's
    bucketed all-reduce overlaps the rest of the backward pass, and FSDP2 can shard per block.
    The blocks share one code path, so the first compilation serves them all (dynamo guards on
    the code, the parameters are inputs). State-dict keys do not change (Module.compile keeps the module).
    """
    blocks = list(lm.transformer.h)
    for block in blocks:
        block.compile(fullgraph=True)
    return len(blocks)
