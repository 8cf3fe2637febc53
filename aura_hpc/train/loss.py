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


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        n = hidden.shape[0]
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden)
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        total = torch.zeros((), dtype=grad_weight.dtype, device=hidden.device)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            h = hidden[start:end].to(compute_dtype)
            t = targets[start:end]
            logits = (h @ w.t()).to(grad_weight.dtype)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t.unsqueeze(1)).squeeze(1)).sum()
            # d(mean loss)/d(logits) = (softmax - one_hot) / n, computed in place over the logits.
            probs = logits.sub_(lse.unsqueeze(1)).exp_()
            probs.scatter_add_(1, t.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
            g = probs.div_(n).to(compute_dtype)
            grad_hidden[start:end] = (g @ w).to(hidden.dtype)
            grad_weight += (g.t() @ h).to(grad_weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (total / n).to(torch.float32 if hidden.dtype != torch.float64 else torch.float64)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out.to(grad_hidden.dtype), grad_weight * grad_out.to(grad_weight.dtype), None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compute_dtype: torch.dtype | None = None, rows: int = 0
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`; hidden (N, d), weight (V, d), targets (N,)."""
    dtype = compute_dtype or hidden.dtype
    rows = rows or chunk_rows(weight.shape[0])
    # Inside autocast the matmuls would be cast again per chunk; this function casts once itself.
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, rows, dtype)  # type: ignore[no-any-return]
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
