"""The calibrated router (`scale_cl.tuner.routing.calibrated`): the gate ``softmax_j(prior_j + a_r r_j,t + a_H (-H_j,t)
+ a_top ln max p_j,t)`` written out, causal, normalised, reset at EOS; the other mixing routers as its special cases;
in SCALE-Route's two paths, SCALE-Preserve's one path and a grown model's nested experts equal to the two-model
control (`ModelMixture`) of the same experts run apart; across ``generate()``'s calls and a reload.

Every fp32 result equal to a reference in exact arithmetic lies as close to the reference's float64 value as the
reference computed in fp32 does (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from scale_cl import ScaleConfig, load, set_method, upscale
from scale_cl.eval.mixture import ModelMixture, mixture_read_as
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.routing import ROUTERS
from scale_cl.tuner.routing.calibrated import DECAYS, OBJECTIVES, Gate, fit_gate, gate_log_weights
from scale_cl.tuner.routing.posterior import expert_evidence, posterior_mix
from tests.conftest import VOCAB, make_model, randomize_new_weights, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding, weight_floor

pytestmark = pytest.mark.exactness

EOS = 2
# A gate no fixed router computes: every kind of evidence weighed, the top probability against the entropy.
GATE = {"prior": 0.3, "decay": 0.8, "prefix_weight": 0.6, "entropy_weight": 2.0, "top_weight": -0.7}
SETTINGS = {f"router_{name}": value for name, value in GATE.items()}


def _mix(experts, ids, **overrides):
    gate = {**GATE, **overrides}
    return posterior_mix(experts, ids, eos_ids=(EOS,), prefix=True, **gate)


def _written_out(base: torch.Tensor, new: torch.Tensor, ids: torch.Tensor, gate: dict) -> tuple:
    """The mixture and the base's weight position by position, in the logits' dtype."""
    lb, ln = base.log_softmax(-1), new.log_softmax(-1)
    rows, length = ids.shape
    mixed, w_base = torch.empty_like(base), torch.empty(ids.shape, dtype=base.dtype)
    for row in range(rows):
        ratio = torch.zeros((), dtype=base.dtype)  # r_base - r_new: the two experts' running ratio
        for t in range(length):
            evidence = 0.0 if t == 0 else lb[row, t - 1, ids[row, t]] - ln[row, t - 1, ids[row, t]]
            ratio = torch.zeros_like(ratio) if ids[row, t] == EOS else gate["decay"] * ratio + evidence
            log_p = torch.stack((lb[row, t], ln[row, t]))
            entropy = -(log_p.exp() * log_p).sum(-1)
            top = log_p.amax(-1)
            score = gate["entropy_weight"] * (entropy[1] - entropy[0]) + gate["top_weight"] * (top[0] - top[1])
            w = w_base[row, t] = torch.sigmoid(gate["prior"] + gate["prefix_weight"] * ratio + score)
            mixed[row, t] = torch.log(w * lb[row, t].exp() + (1 - w) * ln[row, t].exp())
    return mixed, w_base


def _experts(seed: int = 2, rows: int = 2, length: int = 8):
    gen = torch.Generator().manual_seed(seed)
    base, new = torch.randn(rows, length, 9, generator=gen) * 2, torch.randn(rows, length, 9, generator=gen) * 2
    ids = torch.randint(3, 9, (rows, length), generator=gen)
    ids[1, 4] = EOS
    return base, new, ids


def test_the_gate_is_its_formula_written_out_causal_normalised_and_reset_at_eos():
    base, new, ids = _experts()
    logits, weights, _ = _mix([base, new], ids)
    (stock, stock_w), (exact, exact_w) = (
        _written_out(base, new, ids, GATE),
        _written_out(base.double(), new.double(), ids, GATE),
    )
    assert_exact_to_rounding(weights[0], exact_w, stock=stock_w, what="base weight")
    assert_exact_to_rounding(logits, exact, stock=stock, what="mixture")
    ones = torch.ones(ids.shape, dtype=torch.float64)
    assert_exact_to_rounding(logits.exp().sum(-1), ones, stock=stock.exp().sum(-1), ulps=32, what="total probability")
    assert float(weights[0].max() - weights[0].min()) > 0.2, "the weight moves: a mixture, not one constant"
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 9
    again = _mix([base, new], changed)[0]
    assert torch.equal(again[:, :-1], logits[:, :-1])  # w_t reads tokens up to x_t only
    # at the EOS the prefix starts again: the weight there is the one a fresh document's first position gets
    fresh = _mix([base[1:, 4:], new[1:, 4:]], ids[1:, 4:])[1]
    assert_exact_to_rounding(weights[0, 1, 4], fresh[0, 0, 0].double(), stock=fresh[0, 0, 0], what="after EOS")


def test_a_gate_with_the_entropy_weight_off_by_one_percent_is_outside_the_rounding_bound():
    """Mutation: ``a_H`` 2.02 for 2: farther from the written-out gate's float64 values than rounding allows."""
    base, new, ids = _experts()
    got = _mix([base, new], ids, entropy_weight=2.02)[0]
    stock, exact = (_written_out(b, n, ids, GATE)[0] for b, n in ((base, new), (base.double(), new.double())))
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_exact_to_rounding(got, exact, stock=stock, what="mixture")


@pytest.mark.parametrize(
    ("router", "gate"),
    [
        ("likelihood", {"prefix_weight": 1.0, "entropy_weight": 0.0, "top_weight": 0.0}),
        ("confidence", {"prefix_weight": 0.0, "entropy_weight": 1 / 0.25, "top_weight": 0.0}),
        ("hybrid", {"prefix_weight": 1.0, "entropy_weight": 0.0, "top_weight": 1 / 0.25}),
    ],
)
def test_the_fixed_routers_are_gates_of_their_own(router, gate):
    """The likelihood router is the gate ``(1, 0, 0)`` (bitwise: the same terms), the confidence router ``(0, 1/T,
    0)`` and the hybrid ``(1, 0, 1/T)`` with its "top" confidence (to rounding: ``c x (1/T)`` against ``c / T``)."""
    base, new, ids = _experts(seed=3)
    settings = {"prior": 0.3, "decay": 0.8, "eos_ids": (EOS,), "temperature": 0.25}
    confidence = {"likelihood": None, "confidence": "entropy", "hybrid": "top"}[router]
    fixed = dict(settings, prefix=router != "confidence", confidence=confidence)
    stock, stock_w, _ = posterior_mix([base, new], ids, **fixed)
    exact, exact_w, _ = posterior_mix([base.double(), new.double()], ids, **fixed)
    got, got_w, _ = _mix([base, new], ids, prior=0.3, decay=0.8, **gate)
    if router == "likelihood":
        assert torch.equal(got, stock) and torch.equal(got_w, stock_w)
    assert_exact_to_rounding(got, exact, stock=stock, what=f"the {router} router as a gate")
    assert_exact_to_rounding(got_w, exact_w, stock=stock_w, what="weights")


def _preserve_model():
    base = make_model("llama-gqa4-untied", seed=0).eval()
    model = upscaled_copy(base, "preserve", w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=2, w12_scale=0.3, head_scale=0.5)
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    trained = copy.deepcopy(model).eval()  # the model as it trained: no router
    return base, trained, set_live_settings(model, router="calibrated", **SETTINGS).eval()


def _route_model():
    base = make_model("llama-gqa2-tied", seed=0)
    model = upscaled_copy(base, "route", ffn_up=16, preserve_layers=1, w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=4, w12_scale=0.3)
    model.config.eos_token_id = EOS
    model.scale_route.eos_ids = (EOS,)
    adapt = set_method(copy.deepcopy(model), "adapt").eval()
    return base, adapt, set_live_settings(model, router="calibrated", **SETTINGS).eval()


def _controls(models) -> tuple[ModelMixture, ModelMixture]:
    """The calibrated control of ``models`` (fp32, the stock computation) and that of their float64 copies."""
    settings = ScaleConfig(hidden_up=32, ffn_up=8, router="calibrated", **SETTINGS)
    copies = [copy.deepcopy(m).double() for m in models]
    return tuple(mixture_read_as(ms, "calibrated", settings) for ms in (models, copies))


def _assert_as_the_control(model, models, ids, mask) -> None:
    control, exact = _controls(models)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        stock = control(input_ids=ids, attention_mask=mask).logits
        exact_logits = exact(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_exact_to_rounding(got[real], exact_logits[real], stock=stock[real], what="mixture")
    confidence = (abs(GATE["entropy_weight"]) + abs(GATE["top_weight"])) * math.log(got.shape[-1])
    floor = weight_floor(
        exact_logits,
        ids,
        real,
        GATE["prior"],
        GATE["decay"],
        confidence=confidence,
        prefix_weight=GATE["prefix_weight"],
    )
    weights, stock_w, exact_w = model.scale_route.last.weights, control.last_weights, exact.last_weights
    assert weights.shape[0] == len(models)
    assert_exact_to_rounding(weights[:, real], exact_w[:, real], stock=stock_w[:, real], ulps=floor, what="weights")
    assert float(weights[0][real].max() - weights[0][real].min()) > 0.05, "the gate moves the weight"


def test_preserve_in_one_pass_is_the_control_of_the_base_and_itself():
    base, trained, model = _preserve_model()
    ids, mask = token_batch()
    ids[0, 5] = EOS
    _assert_as_the_control(model, [base, trained], ids, mask)


def test_route_is_the_control_of_the_base_and_its_adapt_path():
    base, adapt, model = _route_model()
    ids, mask = token_batch()
    _assert_as_the_control(model, [base, adapt], ids, mask)


def test_a_grown_model_is_read_as_its_nested_experts():
    base = make_model("llama-gqa2-tied").eval()
    model = upscaled_copy(base, "preserve", w21_init="random", w22_init="random", seed=1)
    randomize_new_weights(model, seed=2, w12_scale=0.3, head_scale=0.3)
    models = [base, copy.deepcopy(model).eval()]
    config = ScaleConfig(hidden_up=32, ffn_up=8, method="preserve", w21_init="random", w22_init="random", seed=3)
    model = randomize_new_weights(upscale(model, config).eval(), seed=3, w12_scale=0.3, head_scale=0.3)
    models.append(copy.deepcopy(model).eval())
    set_live_settings(model, router="calibrated", **SETTINGS)
    _assert_as_the_control(model, models, *token_batch())


@pytest.mark.parametrize("method", ["route", "preserve"])
def test_generate_with_a_kv_cache_equals_recomputing_and_a_reload_keeps_the_gate(method, tmp_path):
    base, _, model = _route_model() if method == "route" else _preserve_model()
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
    assert reloaded.scale_config.router == "calibrated"
    assert {name: getattr(reloaded.scale_config, name) for name in SETTINGS} == SETTINGS
    with torch.no_grad():  # the same weights and gate read back, the same kernels on the same input: bitwise
        assert torch.equal(reloaded(input_ids=out).logits, logits)


def test_the_gate_s_settings_are_checked_and_declared():
    _, _, model = _preserve_model()
    assert ROUTERS["calibrated"].reads == tuple(SETTINGS)
    with pytest.raises(ValueError, match="router_prefix_weight"):
        set_live_settings(model, router_prefix_weight=-1.0)
    with pytest.raises(ValueError, match="router_entropy_weight"):
        set_live_settings(model, router_entropy_weight=1e3)
    with pytest.raises(ValueError, match="gate has the weights"):
        ModelMixture([make_model("llama-gqa2-tied")] * 2, router="calibrated", gate={"margin_weight": 1.0})
    unfitted = ScaleConfig(hidden_up=32, ffn_up=8, router="calibrated")  # the hybrid's defaults: entropy at T = 1/3
    assert (unfitted.router_prefix_weight, unfitted.router_entropy_weight, unfitted.router_top_weight) == (1, 3, 0)


# ------------------------------------------------------------------------------- the gate's fit on evidence
def test_the_evidence_a_pass_gives_its_router_reproduces_the_gate_s_weights():
    """While ``RouteState.evidence`` is a list, the router hands it each pass's `Evidence`; the gate computed from it
    alone (`gate_log_weights`, what the fit reads) is the model's own weighting."""
    _, _, model = _preserve_model()
    ids, mask = token_batch()
    ids[0, 5] = EOS
    exact_model = copy.deepcopy(model).double()
    for m in (model, exact_model):
        m.scale_route.evidence = []
        with torch.no_grad():
            m(input_ids=ids, attention_mask=mask)
    (evidence,), (exact_evidence,) = model.scale_route.evidence, exact_model.scale_route.evidence
    assert evidence.next_log_probs.shape == (2, *ids.shape) and evidence.predicted().sum() < mask.sum()
    gate = Gate(**GATE)
    weights = gate_log_weights(evidence, gate, (EOS,)).exp()
    exact = gate_log_weights(exact_evidence, gate, (EOS,)).exp()
    real = mask.bool()
    floor = 32.0  # the scores' size (~|prior| + 0.6 x the prefix's sum + 2.7 x ln V) over 2, as weight_floor has it
    stock = model.scale_route.last.weights
    assert_exact_to_rounding(weights[:, real], exact[:, real], stock=stock[:, real], ulps=floor, what="weights")


def _sampled_sides(seed: int = 0, rows: int = 48, length: int = 32, vocab: int = 12):
    """Two experts' fixed logits at every position, and tokens drawn from each: the old side from the base's
    distribution (expert 0), the new side from the new model's (expert 1)."""
    gen = torch.Generator().manual_seed(seed)
    experts = [2.0 * torch.randn(rows, length, vocab, generator=gen) for _ in range(2)]
    sides = []
    for expert in experts:  # position t's distribution predicts token t + 1
        ids = torch.randint(3, vocab, (rows, length), generator=gen)
        drawn = torch.multinomial(expert[:, :-1].softmax(-1).reshape(-1, vocab), 1, generator=gen)
        ids[:, 1:] = drawn.view(rows, length - 1)
        sides.append([expert_evidence(experts, ids)])
    return sides


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_a_gate_fitted_on_text_each_expert_wrote_tells_the_two_apart(objective):
    """The fit's own check on a known answer: text drawn from the base is read by the base, text drawn from the new
    model by the new model, so the mixture reads each side almost as well as its own expert does, far better than
    the unfitted gate (the hybrid's defaults, which the random experts' confidences mislead)."""
    old, new = _sampled_sides()
    fit = fit_gate(old, new, (EOS,), objective=objective)
    assert fit.old_base_weight > 0.8 and fit.new_base_weight < 0.2, fit
    own = [float(side[0].next_log_probs[j][side[0].predicted()].mean()) for j, side in enumerate((old, new))]
    assert fit.old_log_likelihood > own[0] - 0.15 and fit.new_log_likelihood > own[1] - 0.15, (fit, own)
    assert fit.gate.prefix_weight > 0.5, "the prefix tells the sides apart, the random confidences do not"
    assert set(fit.by_decay) == set(DECAYS) and fit.value == max(fit.by_decay.values())
    unfitted = fit_gate(old, new, (EOS,), objective=objective, decays=(Gate().decay,), steps=0)
    assert fit.value > unfitted.value


def test_a_fit_needs_both_sides_and_a_known_objective():
    old, new = _sampled_sides(rows=4, length=8)
    with pytest.raises(ValueError, match="both sides"):
        fit_gate(old, [], (EOS,))
    with pytest.raises(ValueError, match="one of \\('likelihood', 'classification'\\)"):
        fit_gate(old, new, (EOS,), objective="accuracy")
