"""The nested-stage router (issue 40): a model grown per task under SCALE-Preserve holds the base's and every
earlier stage's exact logits in one forward pass; the router mixes them by the posterior over experts."""

from __future__ import annotations

import copy
import itertools

import torch

from conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
from scale_cl import ScaleConfig, load, upscale
from scale_cl.eval.mixture import ModelMixture
from scale_cl.tuner.modes import set_live_settings

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


def test_one_stage_is_the_likelihood_router():
    _, (_base, model) = _grown(stages=1)
    ids, mask = token_batch()
    with torch.no_grad():
        set_live_settings(model, router="likelihood", router_prior=PRIOR, router_decay=DECAY)
        likelihood = model(input_ids=ids, attention_mask=mask).logits
        set_live_settings(model, router="nested")
        nested = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(nested[real], likelihood[real], rtol=0, atol=2e-5)


def test_the_experts_are_the_base_and_every_stage_s_model_exactly():
    """Upscaled three times: the mixture of one pass is the mixture of the four models run apart (the base and the
    model after each stage: the control, `ModelMixture`, four forward passes), every expert weighing in somewhere."""
    model, models = _grown(stages=3)
    ids, mask = token_batch()
    with torch.no_grad():
        own = [m(input_ids=ids, attention_mask=mask).logits for m in models]
        control = ModelMixture(models, prior=PRIOR, decay=DECAY)
        expected = control(input_ids=ids, attention_mask=mask).logits
        set_live_settings(model, router="nested", router_prior=PRIOR, router_decay=DECAY)
        routed = model(input_ids=ids, attention_mask=mask).logits
        weights = model.scale_route.last.weights
    real = mask.bool()
    torch.testing.assert_close(routed[real], expected[real], rtol=0, atol=2e-5)
    torch.testing.assert_close(weights[:, real], control.last_weights[:, real], rtol=0, atol=1e-5)
    assert weights.shape[0] == 4 and (weights[:, real].amax(dim=1) > 0.2).all(), "each expert weighs in somewhere"
    torch.testing.assert_close(weights.sum(0), torch.ones(weights.shape[1:]))
    assert all((later - earlier).abs().max() > 1e-2 for earlier, later in itertools.pairwise(own)), "four experts"


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
        torch.testing.assert_close(reloaded(input_ids=out).logits, logits, rtol=0, atol=1e-5)
