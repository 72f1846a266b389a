"""Fitting the calibrated router after training without old data (`scale_cl.train.router_fit`): the old side is text
the model's own base writes, the new side the training text; the evidence is the model's own, the model unchanged but
for its gate; what cannot be fitted here is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import VOCAB, make_model, randomize_new_weights, upscaled_copy
from exactness import assert_exact_to_rounding
from scale_cl import ScaleConfig, upscale
from scale_cl.data.pseudo_replay import generate_blocks
from scale_cl.train.router_fit import base_view, collect_evidence, fit_router
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.routing.calibrated import Gate, gate_log_weights
from scale_cl.tuner.scale_state import scale_config_of

pytestmark = pytest.mark.exactness

EOS = 2


def _model(method: str, router: str = "cosine"):
    base = make_model("llama-gqa2-tied", seed=0).eval()
    extra = {"preserve_layers": 1} if method == "route" else {}
    model = upscaled_copy(base, method, w21_init="random", w22_init="random", seed=1, **extra)
    randomize_new_weights(model, seed=2, w12_scale=0.3, head_scale=0.5)
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    return base, set_live_settings(model, router=router).eval()


@pytest.mark.parametrize("method", ["preserve", "route"])
def test_the_old_side_is_sampled_from_the_models_own_base(method):
    """The base view of a trained model is its base model: logits as exact as the base's own, to float64."""
    base, model = _model(method)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = base_view(model)(input_ids=ids).logits
        stock, exact = base(input_ids=ids).logits, copy.deepcopy(base).double()(input_ids=ids).logits
    assert_exact_to_rounding(got, exact, stock=stock, what="the base view")
    assert scale_config_of(model).method == method and scale_config_of(model).up_logit_scale == 1.0  # left alone


def test_the_evidence_is_collected_and_the_model_left_as_it_was():
    _, model = _model("preserve", router="likelihood")
    blocks = torch.randint(3, VOCAB, (5, 7), generator=torch.Generator().manual_seed(4))
    model.train()
    evidence = collect_evidence(model, blocks, batch_size=2)
    assert [e.ids.shape[0] for e in evidence] == [2, 2, 1] and torch.equal(torch.cat([e.ids for e in evidence]), blocks)
    assert model.training and scale_config_of(model).router == "likelihood" and model.scale_route.evidence is None
    weights = gate_log_weights(evidence[0], Gate(), (EOS,)).exp()
    assert torch.allclose(weights.sum(0), torch.ones(2, 7, dtype=weights.dtype))  # a distribution over the experts


@pytest.mark.parametrize("objective", ["likelihood", "classification"])
def test_fitting_sets_the_fitted_gate_and_reads_only_the_training_text(objective):
    """The fit reads the training blocks it is given and text the base samples, nothing else; the model's router
    becomes the calibrated one with the fitted gate, every weight within its range, and no parameter moves. The
    "training text" here is text the model itself writes (its new expert's), so the fitted gate leans on the base
    on the base's text and on the model on its own."""
    _, model = _model("preserve")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    new = generate_blocks(model, EOS, 16, 16, seed=7)
    result = fit_router(model, new, EOS, seed=0, objective=objective, batch_size=8)
    config = scale_config_of(model)
    assert config.router == "calibrated" and result.fit.objective == objective
    gate = result.fit.gate
    assert (config.router_prior, config.router_decay, config.router_prefix_weight) == (
        gate.prior,
        gate.decay,
        gate.prefix_weight,
    )
    assert (config.router_entropy_weight, config.router_top_weight) == (gate.entropy_weight, gate.top_weight)
    ScaleConfig(hidden_up=32, ffn_up=8, **gate.settings())  # within every range
    assert (result.old_blocks, result.new_blocks, result.block_length) == (16, 16, 16)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert result.fit.old_base_weight > 0.5 > result.fit.new_base_weight, result.fit


def test_what_cannot_be_fitted_here_is_refused():
    _, adapt = _model("adapt")
    with pytest.raises(ValueError, match="SCALE-Route and SCALE-Preserve"):
        fit_router(adapt, torch.ones(2, 4, dtype=torch.long), EOS)
    _, model = _model("preserve")
    grown = upscale(model, ScaleConfig(hidden_up=32, ffn_up=8, method="preserve", w21_init="random", seed=3))
    with pytest.raises(ValueError, match="grown more than once"):
        fit_router(grown, torch.ones(2, 4, dtype=torch.long), EOS)
