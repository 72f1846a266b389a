"""The routers' mixture of distributions computed in cache-sized chunks (inference) equals the plain differentiable
expression (training) and the textbook one, ``log sum_j w_j softmax(z_j)``, to fp32 rounding; given as increments
(nested experts: ``z_0``, ``z_1 - z_0``, ...) it equals the same mixture of the summed experts.

To fp32 rounding: each fp32 result lies as close to the textbook expression's float64 value on the same inputs as the
textbook expression in fp32 does (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

from itertools import accumulate, pairwise

import pytest
import torch
import torch.nn.functional as F

from scale_cl.tuner.routing import mixing
from scale_cl.tuner.routing.mixing import log_normalisers, mixture_log_probs
from scale_cl.tuner.routing.posterior import posterior_mix
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def textbook(logits: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``log sum_j w_j softmax(z_j)``, as the routers wrote it before (per-expert log_softmax, one logsumexp): in fp32
    for lower precisions, in float64 for float64 logits (the exact values)."""
    dtype = torch.promote_types(logits[0].dtype, torch.float32)
    log_p = torch.stack([F.log_softmax(z.to(dtype), dim=-1) for z in logits])
    return torch.logsumexp(weights.to(dtype).log()[..., None] + log_p, dim=0)


def as_increments(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """``z_0``, then each expert's difference from the one before (what a grown model's head stages add)."""
    return [logits[0], *(later - earlier for earlier, later in pairwise(logits))]


def summed(given: list[torch.Tensor], increments: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The experts ``given`` stand for, in ``dtype``: their running sums where they are increments."""
    experts = [z.to(dtype) for z in given]
    return list(accumulate(experts)) if increments else experts


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
    weights = torch.softmax(torch.randn(experts, 2, 5) * 4, dim=0)
    norms = log_normalisers(given, increments)
    assert norms.shape == (experts, 2, 5)
    shifts = list(weights.log() - norms)
    with torch.no_grad():
        chunked = mixture_log_probs(given, shifts, increments)
    # the textbook mixture of the experts the inputs stand for (the increments summed): fp32, and float64 (exact)
    stock, exact = (
        textbook(summed(given, increments), weights),
        textbook(summed(given, increments, torch.float64), weights),
    )
    assert_exact_to_rounding(chunked, exact, stock=stock, what="chunked")
    # the normalisers: each expert's logsumexp, in fp32 and in float64
    stock_norms = torch.stack([torch.logsumexp(z, -1) for z in summed(given, increments)])
    exact_norms = torch.stack([torch.logsumexp(z, -1) for z in summed(given, increments, torch.float64)])
    assert_exact_to_rounding(norms, exact_norms, stock=stock_norms, what="chunked normalisers")
    # A distribution at every position. The mixture adds each expert's shift log w_j - norm_j, rounded at the
    # normaliser's size (up to ~20 here), to its logits, so every log-probability moves by up to two half-ulps of that
    # size, the ones carrying the mass included (the textbook's log_softmax rounds those at their own size, ~1; here
    # the total lies ~8x farther from 1 than the textbook's): the floor is 4 eps of the largest normaliser, not of 1.
    ones = torch.ones(2, 5, dtype=torch.float64)
    floor = 4 * exact_norms.abs().max().item()
    total = chunked.exp().sum(-1)
    assert_exact_to_rounding(total, ones, stock=stock.exp().sum(-1), ulps=floor, what="total probability")

    wanted = [z.float().requires_grad_() for z in given]
    grad_norms = log_normalisers(wanted, increments)
    assert grad_norms.requires_grad
    differentiable = mixture_log_probs(wanted, list(weights.log() - grad_norms), increments)
    assert differentiable.requires_grad
    assert_exact_to_rounding(differentiable.detach(), exact, stock=stock, what="differentiable")
    assert_exact_to_rounding(grad_norms.detach(), exact_norms, stock=stock_norms, what="differentiable normalisers")


def test_a_mixture_with_one_expert_s_weight_off_by_one_percent_is_outside_the_rounding_bound():
    """Mutation: the chunked mixture with one expert's shift ``log w_j - norm_j`` off by 0.01 (its weight 1% heavier,
    as a shift from a stale or misaligned normaliser would give) against the textbook mixture: farther from the
    float64 reference than rounding allows."""
    torch.manual_seed(2)
    logits = [torch.randn(2, 5, 50) * 6 for _ in range(2)]
    weights = torch.softmax(torch.randn(2, 2, 5) * 4, dim=0)
    shifts = list(weights.log() - log_normalisers(logits))
    shifts[1] = shifts[1] + 0.01
    with torch.no_grad():
        mutated = mixture_log_probs(logits, shifts)
    exact = textbook([z.double() for z in logits], weights)
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_exact_to_rounding(mutated, exact, stock=textbook(logits, weights), what="one weight 1% heavier")


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
    z64 = [t.detach().double().requires_grad_() for t in z]
    exact = textbook(z64, weights).gather(-1, target).sum()
    ours_grad = torch.autograd.grad(ours, z)
    theirs_grad = torch.autograd.grad(theirs, z)
    exact_grad = torch.autograd.grad(exact, z64)
    for index, (a, b, e) in enumerate(zip(ours_grad, theirs_grad, exact_grad, strict=True)):
        assert_exact_to_rounding(a, e, stock=b, what=f"expert {index}'s gradient")


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
    finite = torch.arange(50) != 7
    stock, exact = F.log_softmax(z, dim=-1), F.log_softmax(z.double(), dim=-1)
    assert_exact_to_rounding(mixed[..., finite], exact[..., finite], stock=stock[..., finite], what="one expert twice")


def test_a_weight_of_zero_drops_its_expert_and_the_other_reads_as_itself():
    """``w = 0`` (shift ``-inf``) on either side: the mixture is the other expert's log-probabilities, no NaN."""
    torch.manual_seed(3)
    z, d = torch.randn(1, 4, 50), torch.randn(1, 4, 50)
    norms = log_normalisers([z, d], True)
    zero, one = torch.full((1, 4), float("-inf")), torch.zeros(1, 4)
    with torch.no_grad():
        only_base = mixture_log_probs([z, d], [one - norms[0], zero - norms[1]], True)
        only_new = mixture_log_probs([z, d], [zero - norms[0], one - norms[1]], True)
    exact_base, exact_new = F.log_softmax(z.double(), -1), F.log_softmax(z.double() + d.double(), -1)
    assert_exact_to_rounding(only_base, exact_base, stock=F.log_softmax(z, -1), what="the base alone")
    assert_exact_to_rounding(only_new, exact_new, stock=F.log_softmax(z + d, -1), what="the new expert alone")


def test_the_routers_read_increments_as_the_summed_experts():
    """The mixing routers given each expert's increment (never summing it as a whole tensor) return what they return
    for the summed logits, with two experts (SCALE-Preserve's one path) and three (a grown model): the mixture, the
    weights and the memory a generation step hands on; as close to the float64 values (of the increments summed) as
    the routers given the summed fp32 logits."""
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(2, 7, 50, generator=gen) * 3 for _ in range(3)]
    ids = torch.randint(0, 50, (2, 7), generator=gen)
    settings = {"prior": 0.3, "decay": 0.9, "eos_ids": (5,)}
    for experts in (logits[:2], logits):
        given = as_increments(experts)
        with torch.no_grad():
            whole = posterior_mix(experts, ids, **settings)
            exact = posterior_mix(summed(given, True, torch.float64), ids, **settings)
            parts = posterior_mix(given, ids, **settings, increments=True)
        for ours, stock, reference, what in zip(parts[:2], whole[:2], exact[:2], ("mixture", "weights"), strict=True):
            assert_exact_to_rounding(ours, reference, stock=stock, what=what)
        for field in ("ratio", "last_log_probs"):
            ours, stock, reference = (getattr(out[2], field) for out in (parts, whole, exact))
            assert_exact_to_rounding(ours, reference, stock=stock, what=f"memory's {field}")


@pytest.mark.parametrize("increments", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_statistics_are_the_normalisers_and_both_confidences(dtype, increments):
    """`expert_statistics` (what the confidence and calibrated routers read, in one pass) equals `log_normalisers`
    and each `expert_confidence` measure as exactly as those equal float64; a ruled-out entry (-inf) adds nothing."""
    torch.manual_seed(5)
    logits = [(torch.randn(2, 5, 50) * 6).to(dtype) for _ in range(3)]
    logits[-1][0, 2, 7] = float("-inf")  # the last: an increment after it would be +inf
    given = as_increments(logits) if increments else logits
    norms, measures = mixing.expert_statistics(given, increments)
    stock_norms = log_normalisers(given, increments)
    exact_given = [z.double() for z in given]
    exact_norms = log_normalisers(exact_given, increments)
    assert_exact_to_rounding(norms, exact_norms, stock=stock_norms, what="one-pass normalisers")
    for kind in mixing.CONFIDENCES:
        stock = mixing.expert_confidence(given, stock_norms, kind, increments)
        exact = mixing.expert_confidence(exact_given, exact_norms, kind, increments)
        assert torch.isfinite(measures[kind]).all(), kind
        assert_exact_to_rounding(measures[kind], exact, stock=stock, what=f"one-pass {kind}")
