"""The routers' mixture of distributions computed in cache-sized chunks (inference) equals the plain differentiable
expression (training) and the textbook one, ``log sum_j w_j softmax(z_j)``, to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scale_cl.tuner.routing import mixing
from scale_cl.tuner.routing.mixing import log_normalisers, mixture_log_probs


def textbook(logits: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``log sum_j w_j softmax(z_j)``, as the routers wrote it before (per-expert log_softmax, one logsumexp)."""
    log_p = torch.stack([F.log_softmax(z.float(), dim=-1) for z in logits])
    return torch.logsumexp(weights.log()[..., None] + log_p, dim=0)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 3 positions at the tests' vocabulary of 50: several chunks per call, the last one partial."""
    monkeypatch.setattr(mixing, "CPU_CHUNK_ELEMENTS", 150)


@pytest.mark.parametrize("experts", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_mixture_is_the_textbook_one_and_the_differentiable_one(experts, dtype):
    torch.manual_seed(experts)
    logits = [(torch.randn(2, 5, 50) * 6).to(dtype) for _ in range(experts)]
    weights = torch.softmax(torch.randn(experts, 2, 5) * 4, dim=0)
    norms = [log_normalisers(z) for z in logits]
    shifts = [w.log() - n for w, n in zip(weights, norms, strict=True)]
    with torch.no_grad():
        chunked = mixture_log_probs(logits, shifts)
    expected = textbook(logits, weights)
    torch.testing.assert_close(chunked, expected, rtol=0, atol=2e-5)
    assert torch.allclose(chunked.exp().sum(-1), torch.ones(2, 5), atol=5e-6)  # a distribution at every position

    wanted = [z.float().requires_grad_() for z in logits]
    grad_norms = [log_normalisers(z) for z in wanted]
    assert all(n.requires_grad for n in grad_norms)
    differentiable = mixture_log_probs(wanted, [w.log() - n for w, n in zip(weights, grad_norms, strict=True)])
    assert differentiable.requires_grad
    torch.testing.assert_close(differentiable.detach(), chunked, rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.stack(norms), torch.stack(grad_norms).detach(), rtol=0, atol=1e-6)


def test_the_gradient_is_the_textbook_mixtures():
    torch.manual_seed(0)
    z = [torch.randn(2, 4, 50, requires_grad=True) for _ in range(2)]
    weights = torch.softmax(torch.randn(2, 2, 4), dim=0)
    target = torch.randint(0, 50, (2, 4, 1))
    norms = [log_normalisers(t) for t in z]
    ours = mixture_log_probs(z, [w.log() - n for w, n in zip(weights, norms, strict=True)]).gather(-1, target).sum()
    theirs = textbook(z, weights).gather(-1, target).sum()
    ours_grad = torch.autograd.grad(ours, z)
    theirs_grad = torch.autograd.grad(theirs, z)
    for a, b in zip(ours_grad, theirs_grad, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_entries_every_expert_rules_out_stay_minus_infinity_not_nan():
    z = torch.randn(1, 4, 50)
    z[..., 7] = float("-inf")
    logits = [z, z.clone()]
    norms = [log_normalisers(t) for t in logits]
    half = torch.tensor(0.5).log()
    with torch.no_grad():
        mixed = mixture_log_probs(logits, [half - n for n in norms])
    assert torch.isneginf(mixed[..., 7]).all()
    assert torch.isfinite(mixed[..., :7]).all() and torch.isfinite(mixed[..., 8:]).all()
    torch.testing.assert_close(mixed[..., :7], F.log_softmax(z, dim=-1)[..., :7], rtol=0, atol=2e-6)
