"""The nested-stage router: a model grown per task under SCALE-Preserve holds the base's and every
earlier stage's exact logits in one forward pass; the router mixes them by the posterior over experts.

The one pass's fp32 mixture lies as close to the float64 mixture of the models run apart as the fp32 mixture of the
models run apart does (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from scale_cl import ScaleConfig, load, upscale
from scale_cl.eval.mixture import ModelMixture
from scale_cl.tuner.modes import set_live_settings
from tests.conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding, weight_floor

pytestmark = pytest.mark.exactness

PRIOR, DECAY = 0.4, 0.9


def _grown(stages: int = 3):
    """A SCALE-Preserve model grown ``stages - 1`` times, every stage's new weights random (its head columns
    speaking), and each earlier model as it was when the next stage grew it (the base first)."""
    base = make_model("llama-gqa2-tied").eval()
    model = upscaled_copy(base, "preserve", w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=2, w12_scale=0.3, head_scale=0.3)
    models = [base, copy.deepcopy(model)]
    for seed in range(3, 2 + stages):
        config = ScaleConfig(hidden_up=32, ffn_up=8, method="preserve", w21_init="random", w22_init="random", seed=seed)
        model = randomize_new_weights(upscale(model, config).eval(), seed=seed, w12_scale=0.3, head_scale=0.3)
        models.append(copy.deepcopy(model))
    return model.eval(), models


def _controls(models) -> tuple[ModelMixture, ModelMixture]:
    """The control of ``models`` (the stock computation: the models run apart, mixed) and that of float64 copies."""
    copies = [copy.deepcopy(m).double() for m in models]
    return ModelMixture(models, prior=PRIOR, decay=DECAY), ModelMixture(copies, prior=PRIOR, decay=DECAY)


def _assert_as_the_control(routed, weights, control, exact, ids, mask) -> None:
    """The one pass's mixture ``routed`` and ``weights`` as close to the float64 control's as the fp32 control's."""
    with torch.no_grad():
        stock = control(input_ids=ids, attention_mask=mask).logits
        exact_logits = exact(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_exact_to_rounding(routed[real], exact_logits[real], stock=stock[real], what="mixture")
    stock_w, exact_w = control.last_weights[:, real], exact.last_weights[:, real]
    floor = weight_floor(exact_logits, ids, real, PRIOR, DECAY)
    assert_exact_to_rounding(weights[:, real], exact_w, stock=stock_w, ulps=floor, what="weights")


def test_one_stage_is_the_likelihood_router():
    _, (_base, model) = _grown(stages=1)
    ids, mask = token_batch()
    with torch.no_grad():
        set_live_settings(model, router="likelihood", router_prior=PRIOR, router_decay=DECAY)
        likelihood = model(input_ids=ids, attention_mask=mask).logits
        exact = copy.deepcopy(model).double()(input_ids=ids, attention_mask=mask).logits
        set_live_settings(model, router="nested")
        nested = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    # as close to the likelihood router's float64 mixture as the likelihood router in fp32
    assert_exact_to_rounding(nested[real], exact[real], stock=likelihood[real], what="nested against likelihood")


def test_the_experts_are_the_base_and_every_stage_s_model_exactly():
    """Upscaled three times: the mixture of one pass is the mixture of the four models run apart (the base and the
    model after each stage: the control, `ModelMixture`, four forward passes), every expert weighing in somewhere."""
    model, models = _grown(stages=3)
    ids, mask = token_batch()
    set_live_settings(model, router="nested", router_prior=PRIOR, router_decay=DECAY)
    control, exact = _controls(models)
    with torch.no_grad():
        own = [m(input_ids=ids, attention_mask=mask).logits for m in models]
        routed = model(input_ids=ids, attention_mask=mask).logits
        weights = model.scale_route.last.weights
    _assert_as_the_control(routed, weights, control, exact, ids, mask)
    real = mask.bool()
    assert weights.shape[0] == 4 and (weights[:, real].amax(dim=1) > 0.2).all(), "each expert weighs in somewhere"
    # the weights sum to 1, as near as the control's
    ones = torch.ones(weights.shape[1:], dtype=torch.float64)
    assert_exact_to_rounding(weights.sum(0), ones, stock=control.last_weights.sum(0), what="total weight")
    assert all((later - earlier).abs().max() > 1e-2 for earlier, later in itertools.pairwise(own)), "four experts"


def test_a_grown_model_with_its_newest_increment_off_by_one_percent_is_outside_the_rounding_bound():
    """Mutation: the nested router reading the newest stage's increment 1% too strong (``alpha Z_up`` at alpha 1.01,
    the earlier stages' columns as they are) against the control of the models run apart: farther from the float64
    control than rounding allows."""
    model, models = _grown(stages=2)
    ids, mask = token_batch()
    set_live_settings(model, router="nested", router_prior=PRIOR, router_decay=DECAY, up_logit_scale=1.01)
    control, exact = _controls(models)
    with torch.no_grad():
        routed = model(input_ids=ids, attention_mask=mask).logits
    with pytest.raises(AssertionError, match="from the float64 reference"):
        _assert_as_the_control(routed, model.scale_route.last.weights, control, exact, ids, mask)


def test_generate_with_a_cache_saves_and_reloads(tmp_path):
    model, models = _grown(stages=2)
    set_live_settings(model, router="nested", router_prior=PRIOR, router_decay=DECAY)
    ids, _ = token_batch(padded=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        logits = model(input_ids=out).logits
    assert torch.equal(logits[:, ids.shape[1] - 1 : -1].argmax(-1), out[:, ids.shape[1] :])
    model.save_pretrained(tmp_path / "saved")
    reloaded = load(tmp_path / "saved", base_model=copy.deepcopy(models[0])).eval()
    assert reloaded.scale_config.router == "nested"
    with torch.no_grad():
        # the same weights read back and the same kernels on the same input: bitwise
        torch.testing.assert_close(reloaded(input_ids=out).logits, logits, rtol=0, atol=0)
