"""The GPT-2 model, built from config and trained from scratch. Knows nothing of distribution."""

from __future__ import annotations

from typing import Any

import torch

from aura_hpc.config import ModelConfig


def build_model(cfg: ModelConfig, vocab_size: int, eos_id: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=cfg.n_positions,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    hf_cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(hf_cfg)


def count_parameters(model: torch.nn.Module) -> int:
    # Tied input/output embeddings are one tensor; parameters() already yields it once.
    return sum(p.numel() for p in model.parameters())


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) token batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
