"""The chunked cross-entropy gives the plain loss and gradients, for any chunking."""

from __future__ import annotations

import pytest
import torch

from aura_hpc.train.model.loss import chunked_cross_entropy


def _plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()
    return torch.nn.functional.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets)


@pytest.mark.parametrize(("dtype", "rows", "tol"), [(torch.float64, 7, 1e-12), (torch.float64, 1000, 1e-12), (torch.float32, 13, 2e-5)])
def test_loss_and_gradients_match_the_plain_route(dtype: torch.dtype, rows: int, tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    n, d, v = 50, 16, 97
    h1 = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    w1 = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    ref = _plain(h1, w1, t)
    ref.backward()
    got = chunked_cross_entropy(h2, w2, t, rows=rows)
    (got * 1.0).backward()
    assert abs(got.item() - ref.item()) <= tol * max(1.0, abs(ref.item()))
    assert torch.allclose(h2.grad, h1.grad, atol=tol, rtol=tol)  # type: ignore[arg-type]
    assert torch.allclose(w2.grad, w1.grad, atol=tol, rtol=tol)  # type: ignore[arg-type]


def test_a_scaled_loss_scales_the_gradients() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (8,), generator=g)
    (chunked_cross_entropy(h, w, t, rows=3) * 0.25).backward()
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (_plain(h_ref, w_ref, t) * 0.25).backward()
    assert torch.allclose(h.grad, h_ref.grad) and torch.allclose(w.grad, w_ref.grad)  # type: ignore[arg-type]


def test_bf16_compute_stays_close_to_fp32() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(64, 32, generator=g)
    w = torch.randn(300, 32, generator=g) * 0.1
    t = torch.randint(0, 300, (64,), generator=g)
    ref = _plain(h, w, t)
    got = chunked_cross_entropy(h, w, t, compute_dtype=torch.bfloat16, rows=16)
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) < 0.02


def test_without_gradients_the_loss_is_the_same() -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(40, 8, generator=g, dtype=torch.float64)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64)
    t = torch.randint(0, 50, (40,), generator=g)
    with torch.no_grad():
        got = chunked_cross_entropy(h, w, t, rows=9)
    assert abs(got.item() - _plain(h, w, t).item()) < 1e-12


def test_each_rank_draws_its_own_dropout_masks() -> None:
    import torch

    from aura_hpc.train.parts.build import seed_dropout

    masks = []
    for rank in (0, 1, 2):
        torch.manual_seed(1234)  # what every rank does before building the model
        seed_dropout(1234, rank)
        masks.append(torch.nn.functional.dropout(torch.ones(256), 0.5, training=True))
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    torch.manual_seed(1234)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(256), 0.5, training=True), masks[0]), "rank 0's stream is unchanged"
