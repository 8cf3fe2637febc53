"""Next-token cross-entropy from the last hidden states, without the batch's full fp32 logits.

The plain route computes logits for every token (batch x seq x vocab), upcasts them to fp32 and
keeps them for the backward pass: 3.3 GB at 16 x 1024 tokens and a 50K vocabulary. The chunked
route computes the logits of a slice of tokens at a time, takes their loss and, right away,
their gradients with respect to the hidden states and the output matrix; only those gradients
are kept. Peak memory is one chunk's logits. The FLOPs are the same three matmuls.
"""

from __future__ import annotations

from typing import Any

import torch

# A chunk's fp32 logits are at most this large (chunk rows = budget / (4 bytes x vocab)).
CHUNK_BYTES = 256 * 2**20


def chunk_rows(vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    return max(1, budget_bytes // (4 * vocab))


def _chunk(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, n: int, acc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: (its summed loss, d(mean loss)/d(hidden rows), its part of d(mean loss)/d(weight)).
    Written for torch.compile: the logsumexp, softmax, one-hot subtraction and scaling fuse into the
    matmuls' neighbours instead of five passes over the chunk's logits in memory."""
    logits = (h @ w.t()).to(acc_dtype)
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, t.unsqueeze(1)).squeeze(1)).sum()
    # d(mean loss)/d(logits) = (softmax - one_hot) / n.
    # In place over the logits: eagerly, one chunk-sized buffer (compiled, the graph fuses it anyway).
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, t.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
    g = probs.div_(n).to(h.dtype)
    return loss, g @ w, (g.t() @ h).to(acc_dtype)


_compiled_chunk: Any = None


def _chunk_fn(compiled: bool) -> Any:
    global _compiled_chunk
    if not compiled:
        return _chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk, fullgraph=True)
    return _compiled_chunk


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, compute_dtype: torch.dtype, compiled: bool
    ) -> torch.Tensor:
        n = hidden.shape[0]
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden)
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        total = torch.zeros((), dtype=grad_weight.dtype, device=hidden.device)
        chunk = _chunk_fn(compiled)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            loss, g_h, g_w = chunk(hidden[start:end].to(compute_dtype), w, targets[start:end], n, acc_dtype)
            total += loss
            grad_hidden[start:end] = g_h.to(hidden.dtype)
            grad_weight += g_w
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (total / n).to(torch.float32 if hidden.dtype != torch.float64 else torch.float64)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out.to(grad_hidden.dtype), grad_weight * grad_out.to(grad_weight.dtype), None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
    rows: int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`; hidden (N, d), weight (V, d), targets (N,).
    `compiled`: each chunk's arithmetic runs as one compiled graph (two shapes: the full chunks and the last)."""
    dtype = compute_dtype or hidden.dtype
    rows = rows or chunk_rows(weight.shape[0])
    # Inside autocast the matmuls would be cast again per chunk; this function casts once itself.
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, rows, dtype, compiled)  # type: ignore[no-any-return]
        return _loss_only(hidden, weight, targets, rows, dtype)


def _loss_only(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Evaluation: the same loss, chunked, without the gradients."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    w = weight.to(dtype)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        logits = (hidden[start : start + rows].to(dtype) @ w.t()).to(acc)
        t = targets[start : start + rows]
        total += (torch.logsumexp(logits, dim=-1) - logits.gather(1, t.unsqueeze(1)).squeeze(1)).sum()
    return total / hidden.shape[0]
