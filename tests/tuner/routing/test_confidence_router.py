"""The confidence routers: the experts weighed by each one's confidence at the position (``confidence``),
or by that and the prefix posterior (``hybrid``); causal, normalised, reset at EOS, equal across ``generate()``'s
calls, in SCALE-Route's two paths, SCALE-Preserve's one path and a grown model's nested experts, and equal to the
two-model control (`ModelMixture`) of the same experts run apart.

Every fp32 result equal to a reference in exact arithmetic lies as close to the reference's float64 value as the
reference computed in fp32 does (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from scale_cl import ScaleConfig, load, set_method, upscale
from scale_cl.eval.mixture import ModelMixture
from scale_cl.eval.route_separation import collect_base_weights, mixes_experts
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.routing.mixing import expert_confidence, log_normalisers
from scale_cl.tuner.routing.posterior import posterior_mix
from tests.conftest import VOCAB, make_model, randomize_new_weights, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding, weight_floor

pytestmark = pytest.mark.exactness

EOS = 2
PRIOR, DECAY, TEMPERATURE = 0.3, 0.9, 0.5


def _confidence(log_p: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.special.xlogy(log_p.exp(), log_p.exp()).sum(-1) if kind == "entropy" else log_p.amax(-1)


@pytest.mark.parametrize("kind", ["entropy", "top"])
@pytest.mark.parametrize("increments", [False, True])
def test_an_expert_s_confidence_is_its_negative_entropy_or_its_log_top_probability(kind, increments):
    """Computed a chunk of positions at a time (here many chunks: SmolLM2's vocabulary size) and from increments,
    equal to the plain expression; an entry ruled out (``-inf``) adds nothing, not NaN."""
    gen = torch.Generator().manual_seed(0)
    experts = [torch.randn(2, 5, 49_152, generator=gen) * 3 for _ in range(3)]
    experts[0][0, 0, :100] = float("-inf")
    norms = log_normalisers(experts, increments)
    got = expert_confidence(experts, norms, kind, increments)

    def plain(experts):
        whole = list(torch.stack(experts).cumsum(0)) if increments else experts
        return torch.stack([_confidence(z.log_softmax(-1), kind) for z in whole])

    assert_exact_to_rounding(got, plain([z.double() for z in experts]), stock=plain(experts), what=kind)
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="one of \\('entropy', 'top'\\)"):
        expert_confidence(experts, norms, "margin")


@pytest.mark.parametrize("kind", ["entropy", "top"])
def test_the_confidence_router_weighs_each_position_by_the_experts_confidence_alone(kind):
    """``w_t = softmax_j(prior_j + c_j,t / T)``: no token is read (ids None), the mixture is normalised, and a
    position's weight depends on that position's distributions only."""
    gen = torch.Generator().manual_seed(1)
    experts = [torch.randn(2, 6, 9, generator=gen) * 2 for _ in range(2)]
    logits, weights, memory = posterior_mix(
        experts, None, prior=PRIOR, decay=DECAY, eos_ids=(EOS,), confidence=kind, temperature=TEMPERATURE, prefix=False
    )

    def plain(experts):  # (the mixture, the weights) written out, in the experts' dtype
        log_p = torch.stack([z.log_softmax(-1) for z in experts])
        score = _confidence(log_p, kind) / TEMPERATURE + torch.tensor([PRIOR, 0.0], dtype=log_p.dtype)[:, None, None]
        w = score.softmax(0)
        return torch.log((w[..., None] * log_p.exp()).sum(0)), w

    (stock, stock_w), (exact, exact_w) = plain(experts), plain([z.double() for z in experts])
    assert_exact_to_rounding(weights, exact_w, stock=stock_w, what="weights")
    assert_exact_to_rounding(logits, exact, stock=stock, what="mixture")
    # normalised: the total probability as near 1 as the written-out mixture's
    ones = torch.ones(2, 6, dtype=torch.float64)
    assert_exact_to_rounding(logits.exp().sum(-1), ones, stock=stock.exp().sum(-1), what="total probability")
    assert memory is None
    changed = [z.clone() for z in experts]
    changed[1][:, 3:] = torch.randn(2, 3, 9, generator=gen)
    again = posterior_mix(changed, None, prior=PRIOR, decay=DECAY, eos_ids=(EOS,), confidence=kind, prefix=False)[1]
    first = posterior_mix(experts, None, prior=PRIOR, decay=DECAY, eos_ids=(EOS,), confidence=kind, prefix=False)[1]
    torch.testing.assert_close(again[:, :, :3], first[:, :, :3], atol=0, rtol=0)  # position t reads position t


def test_the_hybrid_is_the_prefix_posterior_with_the_confidence_added_and_resets_at_eos():
    """``w_t = softmax_j(prior_j + r_j,t + c_j,t / T)`` with the likelihood router's ``r`` (reset at EOS); without
    the confidence it is the likelihood router exactly; it never reads the token it predicts."""
    gen = torch.Generator().manual_seed(2)
    base, new = torch.randn(2, 7, 9, generator=gen), torch.randn(2, 7, 9, generator=gen)
    ids = torch.randint(3, 9, (2, 7), generator=gen)
    ids[1, 3] = EOS
    settings = {"prior": PRIOR, "decay": DECAY, "eos_ids": (EOS,)}
    logits, weights, _ = posterior_mix([base, new], ids, **settings, confidence="entropy", temperature=TEMPERATURE)

    def written_out(base, new):  # position by position, in the logits' dtype: (the mixture, the base's weight)
        lb, ln = base.log_softmax(-1), new.log_softmax(-1)
        mixed, w_base = torch.empty_like(base), torch.empty(ids.shape, dtype=base.dtype)
        for row in range(2):
            ratio = torch.zeros((), dtype=base.dtype)
            for t in range(7):
                evidence = 0.0 if t == 0 else lb[row, t - 1, ids[row, t]] - ln[row, t - 1, ids[row, t]]
                ratio = torch.zeros_like(ratio) if ids[row, t] == EOS else DECAY * ratio + evidence
                confidence = _confidence(torch.stack((lb[row, t], ln[row, t])), "entropy") / TEMPERATURE
                w = w_base[row, t] = torch.sigmoid(PRIOR + ratio + confidence[0] - confidence[1])
                mixed[row, t] = torch.log(w * lb[row, t].exp() + (1 - w) * ln[row, t].exp())
        return mixed, w_base

    (stock, stock_w), (exact, exact_w) = written_out(base, new), written_out(base.double(), new.double())
    assert_exact_to_rounding(weights[0], exact_w, stock=stock_w, what="base weight")
    assert_exact_to_rounding(logits, exact, stock=stock, what="mixture")
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 9
    again = posterior_mix([base, new], changed, **settings, confidence="entropy", temperature=TEMPERATURE)[0]
    torch.testing.assert_close(again[:, :-1], logits[:, :-1], atol=0, rtol=0)


def test_a_hybrid_call_that_continues_reads_its_first_evidence_from_the_memory():
    gen = torch.Generator().manual_seed(3)
    experts = [torch.randn(1, 8, 9, generator=gen) for _ in range(3)]
    ids = torch.randint(3, 9, (1, 8), generator=gen)
    settings = {"prior": 0.0, "decay": 0.9, "eos_ids": (EOS,), "confidence": "top", "increments": True}
    whole, w_whole, _ = posterior_mix(experts, ids, **settings)
    exact, w_exact, _ = posterior_mix([z.double() for z in experts], ids, **settings)
    first, _, memory = posterior_mix([z[:, :5] for z in experts], ids[:, :5], **settings)
    rest, w_rest, _ = posterior_mix([z[:, 5:] for z in experts], ids[:, 5:], **settings, memory=memory)
    # the two calls as close to the whole call's float64 values as the whole call in fp32
    assert_exact_to_rounding(torch.cat((first, rest), 1), exact, stock=whole, what="mixture")
    assert_exact_to_rounding(w_rest, w_exact[:, :, 5:], stock=w_whole[:, :, 5:], what="weights")


def _route_model(router: str, arch: str = "llama-gqa2-tied"):
    base = make_model(arch, seed=0)
    model = upscaled_copy(base, "route", ffn_up=16, preserve_layers=1, w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=4, w12_scale=0.3)
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    settings = {"router_prior": PRIOR, "router_decay": DECAY, "router_temperature": TEMPERATURE}
    return base, set_live_settings(model, router=router, **settings).eval()


def _preserve_model(router: str):
    base = make_model("llama-gqa4-untied", seed=0).eval()
    model = upscaled_copy(base, "preserve", w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=2, w12_scale=0.3, head_scale=0.5)
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    trained = copy.deepcopy(model).eval()  # the model as it trained: no router
    settings = {"router_prior": PRIOR, "router_decay": DECAY, "router_temperature": TEMPERATURE}
    return base, trained, set_live_settings(model, router=router, **settings).eval()


def controls(models, router: str) -> tuple[ModelMixture, ModelMixture]:
    """The control of ``models`` read by ``router`` (the stock computation) and that of their float64 copies."""
    copies = [copy.deepcopy(m).double() for m in models]
    return tuple(ModelMixture(ms, PRIOR, DECAY, router=router, temperature=TEMPERATURE) for ms in (models, copies))


def assert_as_the_control(got, model, control, exact, ids, mask) -> None:
    """``model``'s mixture ``got`` and its weights as close to the float64 control's as the fp32 control's are."""
    with torch.no_grad():
        stock = control(input_ids=ids, attention_mask=mask).logits
        exact_logits = exact(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_exact_to_rounding(got[real], exact_logits[real], stock=stock[real], what="mixture")
    # the scores: the prior, the running ratio (hybrid) and the confidence over T, at most log V / T (entropy or top)
    confidence = math.log(got.shape[-1]) / TEMPERATURE
    prefix = control.router == "hybrid"
    floor = weight_floor(exact_logits, ids, real, PRIOR, DECAY, prefix=prefix, confidence=confidence)
    weights, stock_w, exact_w = model.scale_route.last.weights, control.last_weights, exact.last_weights
    assert_exact_to_rounding(weights[:, real], exact_w[:, real], stock=stock_w[:, real], ulps=floor, what="weights")


@pytest.mark.parametrize("router", ["confidence", "hybrid"])
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
def test_route_is_read_as_the_mixture_of_the_base_model_and_the_adapt_path(router, arch):
    """The tiny models' distributions are near uniform (their entropies differ by ~0.01-0.3, the adapt path's the
    surer): a low temperature makes the confidence speak, and a prior that centres the decision lets both paths
    weigh in somewhere."""
    base, model = _route_model(router, arch)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    ids[0, 4] = EOS
    models = [base, set_method(copy.deepcopy(model), "adapt")]
    with torch.no_grad():
        experts = [m(input_ids=ids).logits for m in models]
        exact_experts = [copy.deepcopy(m).double()(input_ids=ids).logits for m in models]
        entropy = expert_confidence(experts, log_normalisers(experts), "entropy")
        settings = {"prior": float((entropy[1] - entropy[0]).median()) / 0.01, "decay": DECAY, "eos_ids": (EOS,)}
        set_live_settings(model, router_temperature=0.01, router_prior=settings["prior"])
        got = model(input_ids=ids).logits
        share = model(input_ids=ids)["route_preserve_share"]
    settings.update(confidence="entropy", temperature=0.01, prefix=router == "hybrid")
    stock, weights, _ = posterior_mix(experts, ids, **settings)  # the two paths run apart and mixed: fp32
    exact, exact_weights, _ = posterior_mix(exact_experts, ids, **settings)  # and float64
    assert_exact_to_rounding(got, exact, stock=stock, what="mixture")
    assert float(weights[0].max() - weights[0].min()) > 0.2, "the weight moves: a mixture, not one constant"
    # the base path's share is the mean w
    assert_exact_to_rounding(share, exact_weights[0].mean(), stock=weights[0].mean(), what="preserve share")


@pytest.mark.parametrize("router", ["confidence", "hybrid"])
def test_preserve_in_one_pass_equals_the_control_of_the_base_and_itself(router):
    """SCALE-Preserve's ``Z`` is the base's logits exactly: read with the router in one pass it is the two-model
    control of the base model and itself as trained (two forward passes), weights and all."""
    base, trained, model = _preserve_model(router)
    ids, mask = token_batch()
    control, exact = controls([base, trained], router)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert_as_the_control(got, model, control, exact, ids, mask)
    assert mixes_experts(model) and mixes_experts(control)


def test_preserve_read_with_the_temperature_slightly_off_is_outside_the_rounding_bound():
    """Mutation: SCALE-Preserve read by the hybrid router at temperature 0.505 where its control mixes at 0.5 (the
    confidence's scale off by 1%): farther from the float64 control than rounding allows."""
    base, trained, model = _preserve_model("hybrid")
    ids, mask = token_batch()
    control, exact = controls([base, trained], "hybrid")
    set_live_settings(model, router_temperature=0.505)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_as_the_control(got, model, control, exact, ids, mask)


@pytest.mark.parametrize("router", ["confidence", "hybrid"])
def test_a_grown_model_is_read_as_its_nested_experts(router):
    """A SCALE-Preserve model grown twice: the routers mix its three nested experts (the base, the model after the
    first stage, itself), as the control of the three models run apart does."""
    base = make_model("llama-gqa2-tied").eval()
    model = upscaled_copy(base, "preserve", w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=2, w12_scale=0.3, head_scale=0.3)
    models = [base, copy.deepcopy(model).eval()]
    config = ScaleConfig(hidden_up=32, ffn_up=8, method="preserve", w21_init="random", w22_init="random", seed=3)
    model = randomize_new_weights(upscale(model, config).eval(), seed=3, w12_scale=0.3, head_scale=0.3)
    models.append(copy.deepcopy(model).eval())
    set_live_settings(model, router=router, router_prior=PRIOR, router_decay=DECAY, router_temperature=TEMPERATURE)
    ids, mask = token_batch()
    control, exact = controls(models, router)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    weights = model.scale_route.last.weights
    assert weights.shape[0] == 3
    assert_as_the_control(got, model, control, exact, ids, mask)
    # the weights sum to 1, as near as the control's
    ones = torch.ones(weights.shape[1:], dtype=torch.float64)
    assert_exact_to_rounding(weights.sum(0), ones, stock=control.last_weights.sum(0), what="total weight")


@pytest.mark.parametrize("router", ["confidence", "hybrid"])
@pytest.mark.parametrize("method", ["route", "preserve"])
def test_generate_with_a_kv_cache_equals_recomputing_and_a_reload_reads_the_same(router, method, tmp_path):
    """Greedy generation with a cache picks what the whole sequence's logits pick and equals generation without a
    cache; saved and reloaded, the model keeps its router and its settings."""
    if method == "route":
        base, model = _route_model(router)
    else:
        base, _, model = _preserve_model(router)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        no_cache = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, use_cache=False
        )
        logits = model(input_ids=out).logits
    assert torch.equal(logits[:, ids.shape[1] - 1 : -1].argmax(-1), out[:, ids.shape[1] :])
    assert torch.equal(out, no_cache)
    model.save_pretrained(tmp_path / "saved")
    reloaded = load(tmp_path / "saved", base_model=copy.deepcopy(base)).eval()
    reloaded.scale_route.eos_ids = (EOS,)
    assert reloaded.scale_config.router == router and reloaded.scale_config.router_temperature == TEMPERATURE
    with torch.no_grad():
        # the same weights read back and the same kernels on the same input: bitwise
        torch.testing.assert_close(reloaded(input_ids=out).logits, logits, rtol=0, atol=0)


def test_beam_search_reorders_the_hybrid_s_memory_and_left_padding_reads_each_row_alone():
    _, model = _route_model("hybrid")
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
        beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
    assert beams.shape == (3, 11)


def test_training_through_the_confidence_router_reaches_the_new_path_only():
    _, model = _route_model("confidence")
    model.train()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(8))
    model(input_ids=ids, labels=ids).loss.backward()
    head = model.get_output_embeddings()
    assert head.weight_up.grad is not None and head.weight_up.grad.abs().sum() > 0
    assert head.weight.grad is None, "the base's head stays frozen"


def test_the_base_weight_is_collected_for_the_confidence_router_and_settings_are_checked():
    _, _, model = _preserve_model("confidence")
    ids, mask = token_batch()
    with collect_base_weights(model) as collected, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(collected) == 1 and float(collected[0].min()) > 0 and float(collected[0].max()) < 1
    with pytest.raises(ValueError, match=r"router_confidence must be one of \('entropy', 'top'\)"):
        set_live_settings(model, router_confidence="margin")
    with pytest.raises(ValueError, match="router_temperature"):
        set_live_settings(model, router_temperature=0.0)
    with pytest.raises(ValueError, match="a mixture of models is read by one of"):
        ModelMixture([make_model("llama-gqa2-tied")] * 2, router="cosine")


@pytest.mark.parametrize(
    ("router", "read_as"), [("confidence", "confidence"), ("hybrid", "hybrid"), ("nested", "likelihood")]
)
def test_a_sequence_s_control_reads_with_the_confidence_router_it_is_given(router, read_as, tmp_path):
    """``options.scale.router`` confidence or hybrid: a sequence's control (its base and each task's model) mixes by
    that router, with the settings' temperature; any other router: by the likelihood routers' posterior."""
    from scale_cl.experiments.sequence_progress import SequenceControl

    base = make_model("llama-gqa2-tied")
    settings = ScaleConfig(hidden_up=32, ffn_up=8, router=router, router_temperature=0.25)
    control = SequenceControl(tmp_path, base, lambda: make_model("llama-gqa2-tied"), settings)
    control.add(1, make_model("llama-gqa2-tied", seed=3))
    mixture = control.reading(lambda model: {"model": model})["model"]
    assert (mixture.router, mixture.temperature, len(mixture.experts)) == (read_as, 0.25, 2)
