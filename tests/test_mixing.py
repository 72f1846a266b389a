"""The routers' mixture of distributions computed in cache-sized chunks (inference) equals the plain differentiable
expression (training) and the textbook one, ``log sum_j w_j softmax(z_j)``, to fp32 rounding; given as increments
(nested experts: ``z_0``, ``z_1 - z_0``, ...) it equals the same mixture of the summed experts."""

from __future__ import annotations

from itertools import accumulate, pairwise

import pytest
import torch
import torch.nn.functional as F

from scale_cl.tuner.routing import mixing
from scale_cl.tuner.routing.mixing import log_normalisers, mixture_log_probs
from scale_cl.tuner.routing.posterior import posterior_mix


def textbook(logits: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``log sum_j w_j softmax(z_j)``, as the routers wrote it before (per-expert log_softmax, one logsumexp)."""
    log_p = torch.stack([F.log_softmax(z.float(), dim=-1) for z in logits])
    return torch.logsumexp(weights.log()[..., None] + log_p, dim=0)


def as_increments(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """``z_0``, then each expert's difference from the one before (what a grown model's head stages add)."""
    return [logits[0], *(later - earlier for earlier, later in pairwise(logits))]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 3 positions at the tests' vocabulary of 50: several chunks per call, the last one partial."""
    monkeypatch.setattr(mixing, "CPU_CHUNK_ELEMENTS", 150)


@pytest.mark.parametrize("increments", [False, True])
@pytest.mark.parametrize("experts", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_mixture_is_the_textbook_one_and_the_differentiable_one(experts, dtype, increments):
    torch.manual_seed(experts)
    logits = [(torch.randn(2, 5, 50) * 6).to(dtype) for _ in range(experts)]
    given = as_increments(logits) if increments else logits
    summed = list(accumulate(z.float() for z in given))  # the experts as the increments give them
    weights = torch.softmax(torch.randn(experts, 2, 5) * 4, dim=0)
    norms = log_normalisers(given, increments)
    assert norms.shape == (experts, 2, 5)
    shifts = list(weights.log() - norms)
    with torch.no_grad():
        chunked = mixture_log_probs(given, shifts, increments)
    expected = textbook(summed if increments else logits, weights)
    torch.testing.assert_close(chunked, expected, rtol=0, atol=2e-5)
    assert torch.allclose(chunked.exp().sum(-1), torch.ones(2, 5), atol=5e-6)  # a distribution at every position

    wanted = [z.float().requires_grad_() for z in given]
    grad_norms = log_normalisers(wanted, increments)
    assert grad_norms.requires_grad
    differentiable = mixture_log_probs(wanted, list(weights.log() - grad_norms), increments)
    assert differentiable.requires_grad
    torch.testing.assert_close(differentiable.detach(), chunked, rtol=0, atol=2e-5)
    torch.testing.assert_close(norms, grad_norms.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("increments", [False, True])
def test_the_gradient_is_the_textbook_mixtures(increments):
    torch.manual_seed(0)
    z = [torch.randn(2, 4, 50, requires_grad=True) for _ in range(2)]
    given = [z[0], z[1] - z[0]] if increments else z
    weights = torch.softmax(torch.randn(2, 2, 4), dim=0)
    target = torch.randint(0, 50, (2, 4, 1))
    norms = log_normalisers(given, increments)
    ours = mixture_log_probs(given, list(weights.log() - norms), increments).gather(-1, target).sum()
    theirs = textbook(z, weights).gather(-1, target).sum()
    ours_grad = torch.autograd.grad(ours, z)
    theirs_grad = torch.autograd.grad(theirs, z)
    for a, b in zip(ours_grad, theirs_grad, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("increments", [False, True])
def test_entries_every_expert_rules_out_stay_minus_infinity_not_nan(increments):
    z = torch.randn(1, 4, 50)
    z[..., 7] = float("-inf")
    logits = [z, torch.zeros_like(z)] if increments else [z, z.clone()]  # the same expert twice
    norms = log_normalisers(logits, increments)
    half = torch.tensor(0.5).log()
    with torch.no_grad():
        mixed = mixture_log_probs(logits, list(half - norms), increments)
    assert torch.isneginf(mixed[..., 7]).all()
    assert torch.isfinite(mixed[..., :7]).all() and torch.isfinite(mixed[..., 8:]).all()
    torch.testing.assert_close(mixed[..., :7], F.log_softmax(z, dim=-1)[..., :7], rtol=0, atol=2e-6)


def test_a_weight_of_zero_drops_its_expert_and_the_other_reads_as_itself():
    """``w = 0`` (shift ``-inf``) on either side: the mixture is the other expert's log-probabilities, no NaN."""
    torch.manual_seed(3)
    z, d = torch.randn(1, 4, 50), torch.randn(1, 4, 50)
    norms = log_normalisers([z, d], True)
    zero, one = torch.full((1, 4), float("-inf")), torch.zeros(1, 4)
    with torch.no_grad():
        only_base = mixture_log_probs([z, d], [one - norms[0], zero - norms[1]], True)
        only_new = mixture_log_probs([z, d], [zero - norms[0], one - norms[1]], True)
    torch.testing.assert_close(only_base, F.log_softmax(z, -1), rtol=0, atol=2e-6)
    torch.testing.assert_close(only_new, F.log_softmax(z + d, -1), rtol=0, atol=2e-6)


def test_the_routers_read_increments_as_the_summed_experts():
    """The mixing routers given each expert's increment (never summing it as a whole tensor) return what they return
    for the summed logits, with two experts (SCALE-Preserve's one path) and three (a grown model): the mixture, the
    weights and the memory a generation step hands on."""
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(2, 7, 50, generator=gen) * 3 for _ in range(3)]
    ids = torch.randint(0, 50, (2, 7), generator=gen)
    settings = {"prior": 0.3, "decay": 0.9, "eos_ids": (5,)}
    for experts in (logits[:2], logits):
        with torch.no_grad():
            whole = posterior_mix(experts, ids, **settings)
            parts = posterior_mix(as_increments(experts), ids, **settings, increments=True)
        for ours, expected in zip(parts[:2], whole[:2], strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=2e-5)
        torch.testing.assert_close(parts[2].ratio, whole[2].ratio, rtol=0, atol=1e-5)
        torch.testing.assert_close(parts[2].last_log_probs, whole[2].last_log_probs, rtol=0, atol=1e-5)
