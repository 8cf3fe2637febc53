"""Our GPT-2: the model the trainer trains, with GPT2LMHeadModel's state-dict names and numerics.

Written for the GPU contract (docs/speed.md), in the style of nanoGPT's and torchtitan's models: no KV
cache, no padding check, no attention mask (SDPA with is_causal=True), nothing that reads a value
back to the host, and one code path per block so `torch.compile(fullgraph=True)` compiles each
block once and every other block reuses that graph. It knows nothing of distribution.

The parameters keep transformers' names and layouts (its Conv1D stores weights as (in, out) and
computes x @ W + b; so do we), so a checkpoint's model/ folder is what GPT2LMHeadModel saves and
loads: `hf_config()` writes its config.json, `import_weights()` takes its safetensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LAYER_NORM_EPS = 1e-5  # transformers' GPT2Config.layer_norm_epsilon
INIT_STD = 0.02  # GPT2Config.initializer_range


@dataclass
class GPTConfig:
    vocab_size: int  # embedding rows (model.padded_vocab_size when set)
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    dropout: float = 0.0
    eos_id: int = 0
    tie_word_embeddings: bool = True  # the output matrix is the token embedding (GPT-2)
    tokens: int = 0  # the tokenizer's vocabulary when vocab_size is padded past it (0: every row is a token)


class Conv1D(nn.Module):
    """transformers' GPT-2 projection: weight (in, out), y = x @ W + b."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.weight.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)  # q, k and v in one matmul
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=LAYER_NORM_EPS)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=LAYER_NORM_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=LAYER_NORM_EPS)


class GPT(nn.Module):
    """forward(idx) -> logits; hidden(idx) -> the last hidden states (for a chunked loss)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # one tensor, saved once (untied, the export said so and transformers drew it at random)
            self.lm_head.weight = self.transformer.wte.weight
        self.checkpoint_blocks = False  # recompute each block's activations in the backward pass
        self.init_weights()

    def init_weights(self) -> None:
        """transformers' GPT-2 initialisation: N(0, 0.02), and N(0, 0.02/sqrt(2 n_layer)) for the
        projections that write into the residual stream; biases zero, layer norms one."""
        proj_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, proj_std)
            elif name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, INIT_STD)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(idx))

    @torch.no_grad()
    def sample(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int = 40,
        allowed: int | None = None,
        generator: torch.Generator | None = None,
        one_width: bool | None = None,
    ) -> torch.Tensor:
        """`idx` followed by `new_tokens` sampled ones (top-k, temperature); rows at or past `allowed`
        (padded embedding rows with no token behind them) are never sampled.

        one_width (default: on a GPU): every forward at one width, the context padded on the right (causal
        attention keeps the padding out of the positions read). A sequence one token longer at each step is a
        new shape each time: on an H200 the 40 tokens of a tiny model's last sample took ~4 s where a
        fixed-shape evaluation took milliseconds (by torch's source, not measured: torch >= 2.10 prefers
        cuDNN's attention on Hopper, which plans per shape). On a CPU there is no such cost, and the padding would be work for nothing."""
        if idx.shape[1] == 0:
            raise ValueError("a sample needs a prompt of one token at least")
        n = self.config.n_positions
        width = min(n, idx.shape[1] + new_tokens) if (idx.is_cuda if one_width is None else one_width) else 0
        for _ in range(new_tokens):
            context = idx[:, -n:]
            t = context.shape[1]
            padded = F.pad(context, (0, width - t)) if t < width else context
            logits = self.lm_head(self.hidden(padded)[:, t - 1, :]).float() / temperature
            if allowed is not None and allowed < logits.shape[-1]:
                logits[:, allowed:] = -float("inf")
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
        return idx


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """The config.json transformers' GPT2LMHeadModel.from_pretrained reads for this model."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": INIT_STD,
        "scale_attn_weights": True,
        "use_cache": True,
        "bos_token_id": cfg.eos_id,
        "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.eos_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def generation_config(cfg: GPTConfig) -> dict[str, Any]:
    """generation_config.json. Padded embedding rows have no token behind them: transformers' generate() and
    pipeline() read `suppress_tokens` from here (without it they sampled ids the tokenizer decodes to nothing)."""
    config: dict[str, Any] = {"bos_token_id": cfg.eos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.eos_id}
    if 0 < cfg.tokens < cfg.vocab_size:
        config["suppress_tokens"] = list(range(cfg.tokens, cfg.vocab_size))
    return config


def import_weights(model: GPT, weights: dict[str, torch.Tensor]) -> None:
    """GPT2LMHeadModel's weights into ours (the same names and layouts; its `attn.bias` mask buffers,
    which older releases saved, are not weights)."""
    ours = model.state_dict()
    skipped: Callable[[str], bool] = lambda k: k.endswith((".attn.bias", ".attn.masked_bias"))  # noqa: E731
    given = {k: v for k, v in weights.items() if not skipped(k)}
    missing = sorted(set(ours) - set(given) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    unexpected = sorted(set(given) - set(ours))
    # copy_ broadcasts: a (1, n) tensor would fill every row of an (m, n) weight without a word.
    shapes = sorted(k for k in given if k in ours and tuple(given[k].shape) != tuple(ours[k].shape))
    if missing or unexpected or shapes:
        raise KeyError(
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"other shapes {[(k, tuple(given[k].shape), tuple(ours[k].shape)) for k in shapes[:3]]}"
        )
    with torch.no_grad():
        for name, value in given.items():
            ours[name].copy_(value)
