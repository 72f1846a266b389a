"""The likelihood router: p = w p_base + (1 - w) p_new, w = sigmoid(prior + r) from the document's running
log-likelihood ratio; the posterior mixture of `scale_cl.tuner.routing.posterior` with two experts and its prefix.

Every fp32 result equal to a reference in exact arithmetic lies as close to the reference's float64 value as the
reference computed in fp32 does (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import set_method
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.routing.posterior import ExpertMemory, posterior_mix, running_ratio
from tests.conftest import VOCAB, make_model, randomize_new_weights, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

EOS = 2


def likelihood_mix(base, new, ids, **settings):
    """The likelihood router's mixture of two experts: (logits, the base's weight w, the memory)."""
    logits, weights, memory = posterior_mix([base, new], ids, **settings)
    return logits, weights[0], memory


def test_the_running_ratio_decays_and_resets_at_document_starts():
    evidence = torch.tensor([[1.0, 2.0, -1.0, 4.0, 1.0]])
    starts = torch.tensor([[False, False, True, False, False]])
    got = running_ratio(evidence, starts, decay=0.5, initial=torch.tensor([2.0]))
    assert got.tolist() == [[2.0, 3.0, 0.0, 4.0, 3.0]]


@pytest.mark.parametrize("length", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("decay", [0.5, 0.95, 1.0])
def test_the_chunked_ratio_is_the_recurrence_across_chunk_boundaries(length, decay):
    """Computed 64 positions at a time; equal to the recurrence step by step, with documents that start inside a
    chunk, at its first position and nowhere in it, and a carried ratio."""
    gen = torch.Generator().manual_seed(length)
    evidence = torch.randn(3, length, generator=gen)
    starts = torch.rand(3, length, generator=gen) < 0.03
    starts[1] = False  # one row is one document throughout
    if length > 64:
        starts[2, 64] = True  # a document starting exactly at a chunk's first position
    initial = torch.randn(3, generator=gen)

    def recurrence(evidence, initial):
        expected, ratio = torch.empty_like(evidence), initial
        for t in range(length):
            ratio = torch.where(starts[:, t], 0.0, decay * ratio + evidence[:, t])
            expected[:, t] = ratio
        return expected

    got, exact = running_ratio(evidence, starts, decay, initial), recurrence(evidence.double(), initial.double())
    assert_exact_to_rounding(got, exact, stock=recurrence(evidence, initial), what="running ratio")


def written_out(base: torch.Tensor, new: torch.Tensor, ids: torch.Tensor, prior: float, decay: float):
    """The likelihood router position by position, in the logits' dtype: (the mixture's log-probabilities, w)."""
    lb, ln = base.log_softmax(-1), new.log_softmax(-1)
    logits, weights = torch.empty_like(base), torch.empty(ids.shape, dtype=base.dtype)
    for row in range(ids.shape[0]):
        ratio = torch.zeros((), dtype=base.dtype)
        for t in range(ids.shape[1]):
            evidence = 0.0 if t == 0 else lb[row, t - 1, ids[row, t]] - ln[row, t - 1, ids[row, t]]
            ratio = torch.zeros_like(ratio) if ids[row, t] == EOS else decay * ratio + evidence
            w = weights[row, t] = torch.sigmoid(prior + ratio)
            logits[row, t] = torch.log(w * lb[row, t].exp() + (1 - w) * ln[row, t].exp())
    return logits, weights


def test_the_mixture_is_the_posterior_weighted_sum_and_never_reads_the_token_it_predicts():
    gen = torch.Generator().manual_seed(0)
    base, new = torch.randn(2, 6, 9, generator=gen), torch.randn(2, 6, 9, generator=gen)
    ids = torch.randint(3, 9, (2, 6), generator=gen)
    ids[1, 3] = EOS
    logits, weight, memory = likelihood_mix(base, new, ids, prior=0.5, decay=0.8, eos_ids=(EOS,))
    stock, stock_w = written_out(base, new, ids, 0.5, 0.8)
    exact, exact_w = written_out(base.double(), new.double(), ids, 0.5, 0.8)
    assert_exact_to_rounding(logits, exact, stock=stock, what="mixture")
    assert_exact_to_rounding(weight, exact_w, stock=stock_w, what="base weight")
    # a fresh document: w is sigmoid(prior) to pytest.approx's 1e-6 (relative), an ulp or two of w's rounding, where
    # a ratio carried over the EOS would move it by ~1e-1
    assert float(weight[1, 3]) == pytest.approx(float(torch.sigmoid(torch.tensor(0.5))))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 9
    again = likelihood_mix(base, new, changed, prior=0.5, decay=0.8, eos_ids=(EOS,))[0]
    torch.testing.assert_close(again[:, :-1], logits[:, :-1], atol=0, rtol=0)  # w_t reads tokens up to x_t only
    assert memory.ratio.shape == (2, 2) and memory.last_log_probs.shape == (2, 2, 9)  # per expert


def test_a_call_that_continues_reads_its_first_evidence_from_the_memory():
    gen = torch.Generator().manual_seed(1)
    base, new = torch.randn(1, 8, 9, generator=gen), torch.randn(1, 8, 9, generator=gen)
    ids = torch.randint(3, 9, (1, 8), generator=gen)
    whole, w_whole, _ = likelihood_mix(base, new, ids, prior=0.0, decay=0.9, eos_ids=(EOS,))
    exact, w_exact, _ = likelihood_mix(base.double(), new.double(), ids, prior=0.0, decay=0.9, eos_ids=(EOS,))
    first, _, memory = likelihood_mix(base[:, :5], new[:, :5], ids[:, :5], prior=0.0, decay=0.9, eos_ids=(EOS,))
    rest, w_rest, _ = likelihood_mix(
        base[:, 5:], new[:, 5:], ids[:, 5:], prior=0.0, decay=0.9, eos_ids=(EOS,), memory=memory
    )
    # the two calls as close to the whole call's float64 values as the whole call in fp32
    assert_exact_to_rounding(torch.cat((first, rest), 1), exact, stock=whole, what="mixture")
    assert_exact_to_rounding(w_rest, w_exact[:, 5:], stock=w_whole[:, 5:], what="base weight")


def _route_model(arch: str = "llama-gqa2-tied"):
    base = make_model(arch, seed=0)
    model = upscaled_copy(base, "route", ffn_up=16, preserve_layers=1, w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=4, w12_scale=0.3)
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    return base, set_live_settings(model, router="likelihood", router_prior=0.3, router_decay=0.9).eval()


def two_model_references(base, model, ids):
    """The likelihood router's mixture (and w) of ``base`` and ``model``'s adapt path, run apart: in fp32 (the stock
    computation) and on float64 copies (the exact values)."""
    adapt = set_method(copy.deepcopy(model), "adapt")
    out = []
    for experts in ((base, adapt), (copy.deepcopy(base).double(), copy.deepcopy(adapt).double())):
        with torch.no_grad():
            logits = [expert(input_ids=ids).logits for expert in experts]
        out.append(likelihood_mix(*logits, ids, prior=0.3, decay=0.9, eos_ids=(EOS,))[:2])
    assert (logits[1] - logits[0]).abs().max() > 1e-2, "the two paths differ, so the mixture is not trivial"
    return out


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
def test_route_mixes_the_base_model_and_the_adapt_path(arch):
    base, model = _route_model(arch)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    ids[0, 4] = EOS
    with torch.no_grad():
        got = model(input_ids=ids).logits
        share = model(input_ids=ids)["route_preserve_share"]
    (stock, stock_w), (exact, exact_w) = two_model_references(base, model, ids)
    assert_exact_to_rounding(got, exact, stock=stock, what="mixture")
    # the base path's share is the mean w
    assert_exact_to_rounding(share, exact_w.mean(), stock=stock_w.mean(), what="preserve share")


def test_route_with_the_decay_slightly_off_is_outside_the_rounding_bound():
    """Mutation: route read with the running ratio's decay 0.91 where the reference mixes with 0.9 (a ratio that
    forgets 10% slower): farther from the float64 reference than rounding allows."""
    base, model = _route_model()
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    (stock, _), (exact, _) = two_model_references(base, model, ids)
    set_live_settings(model, router_decay=0.91)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_exact_to_rounding(got, exact, stock=stock, what="decay 0.91 against 0.9")


def test_generate_with_a_kv_cache_equals_recomputing_the_whole_sequence():
    _, model = _route_model()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        logits = model(input_ids=out).logits
    assert torch.equal(logits[:, ids.shape[1] - 1 : -1].argmax(-1), out[:, ids.shape[1] :])
    with torch.no_grad():
        no_cache = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, use_cache=False
        )
    assert torch.equal(out, no_cache)


def test_training_reaches_the_new_path_only():
    _, model = _route_model()
    model.train()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    model(input_ids=ids, labels=ids).loss.backward()
    head = model.get_output_embeddings()
    assert head.weight_up.grad is not None and head.weight_up.grad.abs().sum() > 0
    assert head.weight.grad is None, "the base's head stays frozen"


def test_an_unknown_router_is_refused():
    _, model = _route_model()
    with pytest.raises(ValueError, match=r"ScaleConfig\.router must be one of"):
        set_live_settings(model, router="softmax")


def test_left_padded_generation_equals_each_row_alone_and_beam_search_runs():
    _, model = _route_model()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 2, 4]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        for row, pad in enumerate([0, 2, 4]):
            alone = model.generate(ids[row : row + 1, pad:], max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(out[row, 7:], alone[0, 7 - pad :]), row
    reorders = []
    reorder = ExpertMemory.reorder
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ExpertMemory, "reorder", lambda self, index: (reorders.append(1), reorder(self, index))[1])
        with torch.no_grad():
            beams = model.generate(
                ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0
            )
    assert beams.shape == (3, 11) and reorders, "beam search reorders the router's memory with the cache"


def test_auroc_is_the_share_of_pairs_ranked_right_with_ties_half():
    from scale_cl.eval.route_separation import auroc

    gen = torch.Generator().manual_seed(8)
    pos = torch.randint(0, 5, (40,), generator=gen).float()  # few values: many ties
    neg = torch.randint(0, 5, (30,), generator=gen).float() - 0.5 * torch.randint(0, 2, (30,), generator=gen)
    pairs = (pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()
    # float64 means of 0, 1/2 and 1 over 1,200 pairs: each sum is exact, each mean one rounding (~1e-16)
    assert auroc(pos, neg) == pytest.approx(float(pairs.mean()), abs=1e-12)
    assert auroc([2.0, 3.0], [0.0, 1.0]) == 1.0 and auroc([0.0], [1.0]) == 0.0
    with pytest.raises(ValueError, match="both classes"):
        auroc([], [1.0])


def test_the_base_weight_read_where_each_left_padded_prompt_ends_equals_the_prompt_alone():
    from scale_cl.eval.first_token import QAExample, first_token_accuracy
    from scale_cl.eval.route_separation import collect_base_weights

    _, model = _route_model()
    gen = torch.Generator().manual_seed(9)
    prompts = [tuple(torch.randint(3, VOCAB, (n,), generator=gen).tolist()) for n in (7, 4, 2)]
    with collect_base_weights(model) as batched:
        first_token_accuracy(model, [QAExample(p, 5, "a") for p in prompts], pad_token_id=0, batch_size=8)
    assert len(batched) == 1 and batched[0].shape == (3,)
    alone, exact = [], []
    double = copy.deepcopy(model).double()
    for prompt in prompts:
        for reading, into in ((model, alone), (double, exact)):
            with torch.no_grad():
                reading(input_ids=torch.tensor([prompt]))
            into.append(reading.scale_route.last.base_weight[0, -1])
    # batched as close to each prompt's float64 weight as the prompt read alone in fp32
    assert_exact_to_rounding(batched[0], torch.stack(exact), stock=torch.stack(alone), what="base weight")
    assert float(batched[0].min()) > 0 and float(batched[0].max()) < 1
    # read by Eq. 5 the weight is its decision (1: the preserve path); a model that does not route has none
    with collect_base_weights(set_live_settings(model, router="cosine")) as decisions:
        first_token_accuracy(model, [QAExample(p, 5, "a") for p in prompts], pad_token_id=0, batch_size=8)
    assert set(decisions[0].tolist()) <= {0.0, 1.0}
    with (
        pytest.raises(ValueError, match="read with a mixing router"),
        collect_base_weights(set_method(model, "adapt")),
    ):
        pass


def _extended(method: str, router: str):
    """An upscaled model with 4 new tokens (trainable rows of E and W_out, moved from their start), read by
    ``router``; with the base it was made from."""
    from scale_cl.tuner.vocab import grow_embeddings, new_row_parameters

    base = make_model("llama-gqa2-tied", seed=0).eval()
    model = upscaled_copy(base, method, preserve_layers=1, w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=4, w12_scale=0.3)
    grow_embeddings(model, 4)
    with torch.no_grad():
        for param in new_row_parameters(model):
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    return base, set_live_settings(model.eval(), router=router, router_prior=0.3, router_decay=0.9)


@pytest.mark.parametrize("router", ["likelihood", "confidence"])
@pytest.mark.parametrize("method", ["preserve", "route"])
def test_with_new_tokens_the_base_expert_is_the_base_and_the_mixture_its_two_model_control(method, router):
    """The base model has no row for an extended vocabulary's new tokens, so the base expert gives them no mass (as
    the two-model control gives a base that lacks them), however the new rows trained: the router's mixture equals
    the control of the base and the model's own path (SCALE-Preserve's ``Z + alpha Z_up``, Route's adapt path)."""
    from scale_cl.eval.mixture import ModelMixture

    base, model = _extended(method, router)
    own = set_method(copy.deepcopy(model), "adapt" if method == "route" else "preserve")
    own = set_live_settings(own, router="cosine")  # one path, unrouted: Z + alpha Z_up over every row
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))  # tokens the base reads
    settings = {"prior": 0.3, "decay": 0.9, "router": router, "temperature": 1 / 3}
    control = ModelMixture([base, own], **settings)
    exact_control = ModelMixture([copy.deepcopy(base).double(), copy.deepcopy(own).double()], **settings)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        expected = control(input_ids=ids).logits
        exact = exact_control(input_ids=ids).logits
        own_logits = own(input_ids=ids).logits
    assert got.shape[-1] == VOCAB + 4
    assert own_logits[..., VOCAB:].softmax(-1).sum() > 0 and own_logits.softmax(-1)[..., VOCAB:].sum(-1).min() > 1e-3
    assert_exact_to_rounding(got, exact, stock=expected, what="mixture against the control")


def test_the_base_expert_puts_no_mass_on_new_tokens_and_a_new_token_read_rules_the_base_out():
    """With the base's prior at its bound (w = sigmoid(20), 1 in fp32) the mixture is the base expert alone, with no
    probability on the new tokens; once the document holds a new token (one the base cannot produce) the posterior
    gives it to the model's own path."""
    _, model = _extended("preserve", "likelihood")
    set_live_settings(model, router_prior=20.0)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(8))
    ids[:, 5] = VOCAB + 1  # a new token in the input
    with torch.no_grad():
        probs = model(input_ids=ids).logits.float().softmax(-1)
    weight = model.scale_route.last.base_weight
    assert float(weight[:, :5].min()) == 1.0 and float(probs[:, :5, VOCAB:].sum(-1).max()) < 1e-6
    assert float(weight[:, 5:].max()) < 1e-6, "after a token only the new path produces, the document is not the base's"


@pytest.mark.parametrize("method", ["preserve", "route"])
def test_a_call_reading_its_last_positions_mixes_those_alone_and_equals_the_whole_call(method):
    """``logits_to_keep`` (``generate()``'s prefill): the router still reads every position's evidence, and mixes the
    kept positions alone; their logits and the memory handed on are the whole call's, bitwise."""
    _, model = _route_model()
    if method == "preserve":
        model = set_live_settings(set_method(model, "preserve"), router="likelihood")
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    ids[1, 3] = EOS
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        memory = model.scale_route.memory
        for keep in (1, 3):
            kept = model(input_ids=ids, logits_to_keep=keep).logits
            assert kept.shape == (2, keep, whole.shape[-1])
            assert torch.equal(kept, whole[:, -keep:])
            assert torch.equal(model.scale_route.memory.ratio, memory.ratio)
            assert torch.equal(model.scale_route.memory.last_log_probs, memory.last_log_probs)
        # a router reading no tokens gets the kept positions from the model itself: every one it is given is mixed
        model = set_live_settings(model, router="confidence")
        assert model(input_ids=ids, logits_to_keep=3).logits.shape == (2, 3, whole.shape[-1])
        assert model(input_ids=ids).logits.shape == whole.shape
