"""Fitting the calibrated router after training without old data (`scale_cl.train.router_fit`): the old side is text
the model's own base writes, the new side the training text; the evidence is the model's own, the model unchanged but
for its gate; what cannot be fitted here is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import ScaleConfig, upscale
from scale_cl.data.pseudo_replay import generate_blocks
from scale_cl.eval.mixture import mixture_read_as
from scale_cl.train.router_fit import (
    GateRecipe,
    as_batches,
    base_view,
    collect_evidence,
    expert_count,
    expert_view,
    fit_router,
    spread_sample,
)
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.routing.calibrated import Gate, gate_log_weights
from scale_cl.tuner.scale_state import scale_config_of
from tests.conftest import VOCAB, make_model, randomize_new_weights, upscaled_copy
from tests.exactness import assert_exact_to_rounding

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
    result = fit_router(model, new, EOS, seed=0, recipe=GateRecipe(objective, sequences=16, batch_size=8))
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
    assert (result.experts, result.old_sequences, result.new_sequences, result.length) == (2, 16, 16, 16)
    assert result.summary()["objective"] == objective and result.summary()["seconds"] > 0
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert result.fit.old_base_weight > 0.5 > result.fit.new_base_weight, result.fit


def test_what_cannot_be_fitted_here_is_refused():
    _, adapt = _model("adapt")
    with pytest.raises(ValueError, match="SCALE-Route and SCALE-Preserve"):
        fit_router(adapt, torch.ones(2, 4, dtype=torch.long), EOS)
    _, model = _model("preserve")
    with pytest.raises(ValueError, match=r"an expert before the newest, 0\.\.0; got 1"):
        expert_view(model, 1)


def _grown():
    """The base, the model after its first stage (a SCALE-Preserve model, trained: random new weights) and that model
    grown again (three nested experts), the second stage's new weights random too."""
    base, model = _model("preserve")
    first = copy.deepcopy(model)
    grown = upscale(model, ScaleConfig(hidden_up=32, ffn_up=8, method="preserve", w21_init="random", seed=3))
    randomize_new_weights(grown, seed=4, w12_scale=0.0, head_scale=0.5)
    grown.config.eos_token_id = EOS
    grown.scale_route.eos_ids = (EOS,)
    return base, first, grown.eval()


def test_a_grown_models_views_are_its_earlier_models():
    """Each expert before the newest, read alone, is the model it was after that stage: the base, then the model
    after the first stage, logits as exact as theirs, to float64 (Theorem 3.1 at every stage)."""
    base, first, grown = _grown()
    assert expert_count(grown) == 3
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    for expert, earlier in enumerate((base, first)):
        with torch.no_grad():
            got = expert_view(grown, expert)(input_ids=ids).logits
            stock, exact = earlier(input_ids=ids).logits, copy.deepcopy(earlier).double()(input_ids=ids).logits
        assert_exact_to_rounding(got, exact, stock=stock, what=f"the grown model's expert {expert}")


def test_a_grown_model_is_fitted_on_its_base_s_text_and_reads_as_its_control():
    """A grown model's gate (three nested experts) is fitted on the base's samples against the training text, as a
    model upscaled once is; the control of the same three models, fitted the same way, reaches the same gate (the
    one-pass identity)."""
    base, first, grown = _grown()
    new = generate_blocks(grown, EOS, 16, 16, seed=7)
    control = mixture_read_as([base, first, copy.deepcopy(grown)], "likelihood", scale_config_of(grown))
    fitted = fit_router(control, new, EOS, seed=0, recipe=GateRecipe(sequences=16))
    one_pass = fit_router(grown, new, EOS, seed=0, recipe=GateRecipe(sequences=16))
    assert scale_config_of(grown).router == "calibrated" and control.router == "calibrated"
    assert (one_pass.experts, one_pass.old_sequences, one_pass.new_sequences) == (3, 16, 16)
    assert one_pass.fit.gate.decay == fitted.fit.gate.decay
    assert abs(one_pass.fit.value - fitted.fit.value) < 1e-4, (one_pass.fit, fitted.fit)
    assert one_pass.fit.old_base_weight > one_pass.fit.new_base_weight, one_pass.fit


def test_the_two_model_control_is_fitted_the_same_way():
    """A control (the base beside a trained model) is fitted on its first model's samples and the training text; its
    gate is set on the mixture and reads as the same gate set on the one-pass model (Preserve's control identity)."""
    base, model = _model("preserve")
    new = generate_blocks(model, EOS, 16, 16, seed=7)
    control = mixture_read_as([base, copy.deepcopy(model)], "likelihood", scale_config_of(model))
    fitted = fit_router(control, new, EOS, seed=0, recipe=GateRecipe(sequences=16))
    assert control.router == "calibrated" and (control.prior, control.decay) == (
        fitted.fit.gate.prior,
        fitted.fit.gate.decay,
    )
    assert control.gate["entropy_weight"] == fitted.fit.gate.entropy_weight
    assert fitted.fit.old_base_weight > 0.5 > fitted.fit.new_base_weight, fitted.fit
    one_pass = fit_router(model, new, EOS, seed=0, recipe=GateRecipe(sequences=16))
    assert one_pass.fit.gate.decay == fitted.fit.gate.decay  # the same evidence to rounding: the same grid point
    assert abs(one_pass.fit.value - fitted.fit.value) < 1e-4


def test_the_training_text_is_read_spread_and_padded_batches_keep_their_masks():
    data = [{"input_ids": torch.tensor([i, i])} for i in range(10)]
    assert [int(item["input_ids"][0]) for item in spread_sample(data, 4)] == [0, 3, 6, 9]
    assert len(spread_sample(data, 99)) == 10
    assert [int(item["input_ids"][0]) for item in spread_sample(iter(data), 3)] == [0, 1, 2]  # a stream: its first
    padded = {"input_ids": torch.tensor([[5, 6, 0], [7, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    batches = as_batches([padded, padded], sequences=3, batch_size=8)
    assert [b["input_ids"].shape[0] for b in batches] == [2, 1]
    assert torch.equal(batches[1]["attention_mask"], padded["attention_mask"][:1])
    with pytest.raises(ValueError, match="fitted by one of"):
        GateRecipe(objective="accuracy")


def test_spliced_text_changes_sides_once_and_says_who_wrote_each_next_token():
    from scale_cl.train.router_fit import spliced_sequences

    old, new = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.long)
    spliced, written = spliced_sequences(old, new, seed=0)
    for row in range(4):
        ids = spliced[row].tolist()
        first = 0 if row % 2 == 0 else 1  # old first on even rows
        cut = ids.index(1 - first)
        assert 2 <= cut <= 14 and ids == [first] * cut + [1 - first] * (16 - cut)  # one switch, in the middle
        assert written[row, :-1].tolist() == [bool(token) for token in ids[1:]] and not written[row, -1]
    assert torch.equal(spliced_sequences(old, new, seed=0)[0], spliced)  # the seed's cuts
    assert not torch.equal(spliced_sequences(old, new, seed=1)[0], spliced)


def test_a_fit_on_text_that_switches_lets_the_evidence_fade():
    """The third side: on text that changes from the base's to the model's own mid-sequence, the fit prefers a decay
    under 1 to the one it takes on whole sequences of each side (its evidence must fade to follow the switch)."""
    _, model = _model("preserve")
    new = generate_blocks(model, EOS, 16, 32, seed=7)
    whole = fit_router(model, new, EOS, seed=0, recipe=GateRecipe(sequences=16, switching=False))
    switching = fit_router(model, new, EOS, seed=0, recipe=GateRecipe(sequences=16))
    assert switching.fit.by_decay != whole.fit.by_decay  # a third side counted
    assert switching.fit.gate.decay <= whole.fit.gate.decay, (switching.fit.gate, whole.fit.gate)
