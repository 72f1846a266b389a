"""The options that let the new stream fall quiet on old-domain tokens (docs/design.md §2): ``up_norm``,
``embed_up_init``, ``up_logit_scale`` and SCALE-Route's ``route_exact``.

Each keeps Theorem 3.1 on every architecture and method; each computes what its definition says (checked
against a reference written here); the ones read at every forward (``up_logit_scale``, ``route_exact``) are
the model's settings, saved and reloaded with it. The export's copy is checked in test_export.py.

"Equal" is to rounding: an fp32 result lies as close to the float64 value of what it must equal as the stock fp32
computation of that does (`exactness.assert_exact_to_rounding`; the base model's, for Theorem 3.1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from scale_cl import load, set_method, set_up_logit_scale
from scale_cl.tuner.layers import SplitNorm
from scale_cl.tuner.modes import set_live_settings
from tests.conftest import make_model, randomize_new_weights
from tests.exactness import assert_exact_to_rounding
from tests.tuner.test_preservation import (
    assert_equal_within,
    assert_logits_base,
    assert_original_stream_equal,
    batch,
    run,
    run_base,
    train,
    upscaled,
)

pytestmark = pytest.mark.exactness

METHODS = ("preserve", "adapt", "route")
QUIET = {"up_norm": "joint", "embed_up_init": "zero", "up_logit_scale": 0.5, "route_exact": True}


@pytest.mark.parametrize("up_norm", ["original", "joint"])
@pytest.mark.parametrize("method", METHODS)
def test_theorem_3_1_holds_with_every_option(arch_name, method, up_norm):
    """With W12 = 0: the original stream of every layer is the base model's, and with W_out_up = 0 the logits."""
    base = make_model(arch_name)
    model = upscaled(base, method, preserve_layers=1, **{**QUIET, "up_norm": up_norm})
    ids, mask = batch(padded=True)
    base_run, out = run_base(base, ids, mask), run(model, ids, mask)
    assert_logits_base(out.logits, base_run, f"{arch_name}/{method} logits")
    assert_original_stream_equal(base_run, out, base.config.hidden_size, ids.shape[0])


@pytest.mark.parametrize("options", [{"up_norm": "joint"}, {"embed_up_init": "zero"}], ids=["up_norm", "embed"])
def test_preserve_keeps_the_original_stream_through_training(options):
    """SCALE-Preserve trains the new stream (loss falls) and its original stream stays the base model's."""
    base = make_model("llama-gqa2-tied")
    model = upscaled(base, "preserve", **options)
    ids, mask = batch(padded=True)
    losses = train(model, ids, mask, steps=8)
    assert losses[-1] < losses[0]
    base_run, out = run_base(base, ids, mask), run(model, ids, mask)
    assert_original_stream_equal(base_run, out, base.config.hidden_size, ids.shape[0])
    assert not torch.equal(out.logits, base_run.stock.logits)  # it did learn something


# ------------------------------------------------------------------------------------------------ up_norm
@pytest.mark.parametrize("up_norm", ["original", "joint"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_up_norm_divides_x_up_by_the_chosen_statistic(kind, up_norm):
    """x_up over the RMS (rms) or standard deviation (layer) of x or of [x; x_up]; x by its own norm, bitwise."""
    d, u, eps = 12, 8, 1e-5
    base = nn.LayerNorm(d, eps=eps) if kind == "layer" else nn.Module()
    if kind == "rms":
        base.weight = nn.Parameter(torch.rand(d) + 0.5)
    norm = SplitNorm(base, kind, u, eps, up_norm=up_norm)
    with torch.no_grad():
        norm.weight_up.copy_(torch.rand(u) + 0.5)
        if kind == "layer":
            norm.bias_up.copy_(torch.randn(u))
    hidden = torch.randn(3, 5, d + u) * 3
    x, x_up = hidden[..., :d], hidden[..., d:]
    shift = norm.bias_up if kind == "layer" else 0

    def definition(hidden, weight_up, shift):  # in the input's dtype
        x_up, ref = hidden[..., d:], hidden[..., :d] if up_norm == "original" else hidden
        stat = ref.pow(2).mean(-1, keepdim=True) if kind == "rms" else ref.var(-1, unbiased=False, keepdim=True)
        return x_up / torch.sqrt(stat + eps) * weight_up + shift

    out = norm(hidden)
    with torch.no_grad():
        stock = definition(hidden, norm.weight_up, shift)
        exact = definition(hidden.double(), norm.weight_up.double(), shift if kind == "rms" else shift.double())
    assert_exact_to_rounding(out[..., d:], exact, stock=stock, what=f"x_up by the {up_norm} statistic")
    own = SplitNorm(base, kind, u, eps)
    assert torch.equal(out[..., :d], own(hidden)[..., :d])  # x: the base norm's arithmetic, bitwise
    # Quiet stays quiet: x_up a hundred times smaller gives an output about that much smaller (exactly, for
    # "original"), where x_up's own norm undoes the scale.
    quiet = norm(torch.cat((x, x_up / 100), dim=-1))[..., d:] - shift
    ratio = (quiet.abs().mean() / (out[..., d:] - shift).abs().mean()).item()
    # original: exactly 0.01 in exact arithmetic; each mean of 120 fp32 values rounds by under 120 eps / 2 (7e-6)
    # relative even summed naively, x_up / 100 by eps / 2: 1e-4 relative holds their sum with 5x room
    assert 0.005 < ratio < 0.03 if up_norm == "joint" else ratio == pytest.approx(0.01, rel=1e-4)
    own_quiet = own(torch.cat((x, x_up / 100), dim=-1))[..., d:] - shift
    assert (own_quiet.abs().mean() / (own(hidden)[..., d:] - shift).abs().mean()).item() > 0.5


def test_unknown_up_norm_is_refused():
    from scale_cl import ScaleConfig

    with pytest.raises(ValueError, match=r"up_norm must be one of \('own', 'original', 'joint'\), got 'rms'"):
        ScaleConfig(hidden_up=16, ffn_up=0, up_norm="rms")


# ----------------------------------------------------------------------------------------- embed_up_init
def test_zero_embed_up_starts_silent_and_changes_nothing_else():
    base = make_model("llama-gqa2-tied")
    default = upscaled(base, "adapt", w21_init="random")
    zero = upscaled(base, "adapt", w21_init="random", embed_up_init="zero")
    assert torch.count_nonzero(zero.get_input_embeddings().weight_up) == 0
    assert torch.count_nonzero(default.get_input_embeddings().weight_up) > 0
    for (name, a), (_, b) in zip(default.named_parameters(), zero.named_parameters(), strict=True):
        if "embed_tokens.weight_up" not in name:
            assert torch.equal(a, b), name  # every other initialiser drew the same numbers


# ----------------------------------------------------------------------------------------- up_logit_scale
def lively(method: str, **options):
    base = make_model("llama-gqa2-tied")
    model = upscaled(base, method, preserve_layers=1, **options)
    return base, randomize_new_weights(model, seed=5, w12_scale=0.3, head_scale=0.3)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 2.0])
def test_up_logit_scale_weighs_the_new_streams_logits(alpha):
    _, model = lively("adapt")
    ids, mask = batch(padded=True)
    seen = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        set_up_logit_scale(model, alpha)
        logits = model(input_ids=ids, attention_mask=mask).logits
        handle.remove()
        # Z + alpha Z_up from the head's input, written out: in fp32 and on float64 copies
        parts = seen[-1].split((head.hidden_size, head.hidden_up), dim=-1)
        z, z_up = head.project(*parts)
        exact_z, exact_z_up = copy.deepcopy(head).double().project(*(part.double() for part in parts))
    assert_exact_to_rounding(logits, exact_z + alpha * exact_z_up, stock=z + alpha * z_up, what=f"alpha {alpha}")
    assert model.scale_config.up_logit_scale == alpha


def test_up_logit_scale_zero_gives_preserve_the_base_models_logits_after_training():
    base = make_model("llama-gqa2-tied")
    model = upscaled(base, "preserve")
    ids, mask = batch(padded=True)
    train(model, ids, mask, steps=5)
    base_run = run_base(base, ids, mask)
    assert not torch.allclose(run(model, ids, mask).logits, base_run.stock.logits, atol=1e-3)
    set_up_logit_scale(model, 0.0)
    assert_logits_base(run(model, ids, mask).logits, base_run, "preserve at alpha 0")


def test_a_refused_up_logit_scale_changes_nothing():
    _, model = lively("adapt")
    with pytest.raises(ValueError, match="up_logit_scale must be >= 0, got -1"):
        set_up_logit_scale(model, -1)
    assert model.scale_config.up_logit_scale == 1.0


# ------------------------------------------------------------------------------------------- route_exact
def test_route_exact_gives_routed_tokens_the_base_logits_and_the_rest_the_adapt_paths():
    base, model = lively("route", route_exact=True)
    ids, mask = batch(padded=True)
    real = mask.bool()
    base_run = run_base(base, ids, mask)
    shares = {}
    for tau in torch.linspace(-0.9, 0.9, 19).tolist():  # a tau that routes some tokens each way
        set_method(model, "route", tau=tau)
        run(model, ids, mask)
        shares[tau] = model.scale_route.last.routed[real].float().mean().item()
    tau = min(shares, key=lambda t: abs(shares[t] - 0.5))
    assert 0.1 < shares[tau] < 0.9, shares
    set_method(model, "route", tau=tau)
    logits = run(model, ids, mask).logits
    routed = model.scale_route.last.routed & real
    unrouted = ~model.scale_route.last.routed & real
    adapt = run_base(set_method(model, "adapt"), ids, mask)  # the adapt model, in fp32 and in float64
    stock, exact = base_run.stock.logits, base_run.exact.logits
    assert_equal_within(logits[routed], stock[routed], exact[routed], "routed tokens: the base model's logits")
    stock, exact = adapt.stock.logits, adapt.exact.logits
    assert_equal_within(logits[unrouted], stock[unrouted], exact[unrouted], "the others: the adapt path's Z_a + Z_a_up")
    # Eq. 5 as the paper writes it gives the routed tokens something else.
    paper = upscaled(base, "route", preserve_layers=1)
    paper.load_state_dict(model.state_dict())
    set_method(paper, "route", tau=tau)
    assert (run(paper, ids, mask).logits[routed] - base_run.stock.logits[routed]).abs().max() > 1e-3


def test_route_exact_routed_tokens_send_no_gradient():
    """A routed token's logits are the frozen base model's: its loss reaches no trainable parameter."""
    _, model = lively("route", route_exact=True)
    set_method(model, "route", tau=-1.0)  # every token to the preserve path (cos > -1)
    ids, mask = batch(padded=False)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert model.scale_route.last.routed.all()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is None or torch.count_nonzero(g) == 0 for g in grads.values())
    # The same batch with Eq. 5 as the paper writes it does train: Z_p_up and Z_a's half carry gradients.
    model.zero_grad()
    set_live_settings(model, route_exact=False)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert any(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in model.parameters() if p.requires_grad)


def test_the_options_are_saved_and_reloaded(tmp_path):
    _, model = lively("route", up_norm="joint", embed_up_init="zero", route_exact=True)
    set_up_logit_scale(model, 0.75)
    set_method(model, "route", tau=0.125)
    ids, mask = batch(padded=True)
    expected = run(model, ids, mask).logits
    model.save_pretrained(tmp_path / "ckpt")
    reloaded = load(tmp_path / "ckpt", base_model=make_model("llama-gqa2-tied"))
    cfg = reloaded.scale_config
    assert (cfg.up_norm, cfg.embed_up_init, cfg.route_exact, cfg.up_logit_scale, cfg.route_tau) == (
        "joint",
        "zero",
        True,
        0.75,
        0.125,
    )
    assert torch.equal(run(reloaded, ids, mask).logits, expected)


def test_the_cpt_frontier_reads_route_with_and_without_route_exact_and_restores_the_model():
    """`up_logit_frontier` really switches route_exact on for its second pass (its logits differ where tokens
    route), evaluates each alpha, and leaves the model's own settings as they were."""
    from scale_cl.eval.readings import up_logit_frontier

    _, model = lively("route")
    ids, mask = batch(padded=True)
    set_method(model, "route", tau=0.0)
    before = model.scale_config

    def evaluate(m):
        logits = run(m, ids, mask).logits
        return {"logits": logits, "base_weight": m.scale_route.last.base_weight.clone()}

    frontier = up_logit_frontier(model, evaluate, (0.5, 1.0))
    assert [(p["alpha"], p.get("route_exact", False), p.get("router", "cosine")) for p in frontier] == [
        (0.5, False, "cosine"),
        (1.0, False, "cosine"),
        (0.5, True, "cosine"),
        (1.0, True, "cosine"),
        (0.5, False, "likelihood"),
        (1.0, False, "likelihood"),
    ]
    routed = frontier[1]["base_weight"].bool() & mask.bool()  # Eq. 5's decision as 0 or 1
    assert routed.any()
    assert (frontier[3]["logits"][routed] - frontier[1]["logits"][routed]).abs().max() > 1e-4
    weight = frontier[5]["base_weight"]
    assert ((weight > 0) & (weight < 1)).any(), "the likelihood router's weight w per token, not a decision"
    assert (frontier[5]["logits"] - frontier[1]["logits"]).abs().max() > 1e-4
    assert model.scale_config == before
    assert torch.equal(run(model, ids, mask).logits, frontier[1]["logits"])


def test_only_the_settings_read_at_every_forward_change_on_a_live_model():

    _, model = lively("route")
    before = model.scale_config
    with pytest.raises(ValueError, match=r"\['up_norm'\] cannot change on a live model"):
        set_live_settings(model, up_norm="joint", up_logit_scale=0.5)
    assert model.scale_config == before
    set_live_settings(model, up_logit_scale=0.5, route_exact=True)
    assert (model.scale_config.up_logit_scale, model.scale_config.route_exact) == (0.5, True)
