"""Skipping the gradient through frozen products where the original stream is constant is exact.

`set_method` marks the modules whose original input depends on no trainable parameter
(``constant_input``); they detach it, so the backward pass never runs through a frozen ``W`` or a
frozen norm there. Route does the same for the preserve half of its stacked batch
(``constant_half``) and computes the preserve path's original logits without gradient.
The parameter gradients must equal those of the plain computation (every such flag off): in fp32, to
rounding, as close to the plain computation's float64 gradients as its own fp32 gradients are
(`exactness.assert_exact_to_rounding`).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from scale_cl import ScaleConfig, set_method, upscale
from scale_cl.tuner.layers import ScaleHead, ScaleLinear, SplitNorm
from scale_cl.tuner.modes import set_live_settings
from tests.conftest import hidden_up_for, hold_w12, make_model, randomize_new_weights, token_batch
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

FAST_MODULES = (ScaleLinear, SplitNorm, ScaleHead)


def _grads(model, ids, mask) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _plain(model):
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, FAST_MODULES):
            module.constant_input = module.constant_half = False
        if hasattr(module, "scale_heads"):  # the attention's original heads: called with the others
            module.scale_heads.constant = module.scale_heads.constant_half = False
    return plain


def assert_plain_gradients(fast: dict, plain: dict, exact: dict, what: str = "") -> None:
    """Every gradient of ``fast`` is the plain computation's to rounding (``plain`` in fp32, ``exact`` in float64)."""
    assert fast.keys() == plain.keys() == exact.keys() and fast
    for name in fast:
        assert_exact_to_rounding(fast[name], exact[name], stock=plain[name], what=f"{what}{name}")


def lively_model(arch: str, method: str, preserve_layers: int):
    base = make_model(arch)
    cfg = ScaleConfig(
        hidden_up=hidden_up_for(base),
        ffn_up=16,
        method=method,
        preserve_layers=preserve_layers,
        w21_init="random",
        w22_init="random",
        route_tau=0.3,
    )
    return randomize_new_weights(upscale(base, cfg), seed=1, w12_scale=0.3)


@pytest.mark.parametrize(
    "arch", ["llama-gqa2-tied", "qwen2-qkv-bias", "neox-parallel-rot0.25", "neox-sequential-rot1.0"]
)
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
@pytest.mark.parametrize("preserve_layers", [0, 2, 3])
def test_parameter_gradients_equal_the_plain_computation(arch, method, preserve_layers):
    # The two graphs sum the same terms in a different order (in float64 they agree to ~1e-16), which in fp32 leaves
    # rounding differences of a few 1e-6 in the embedding's gradient (seen with transformers 5.24): bounded by the
    # plain computation's own distance from its float64 gradients.
    model = lively_model(arch, method, preserve_layers)
    ids, mask = token_batch(padded=True)
    plain = _plain(model)
    assert_plain_gradients(
        _grads(model, ids, mask), _grads(plain, ids, mask), _grads(plain.double(), ids, mask), f"{method}: "
    )


def test_a_gradient_missing_a_term_is_outside_the_bound():
    """The mutation: one module taken as constant although a W12 reaches its input (the first W12 layer's norm before
    the FFN, as a `set_method` that marked that whole layer would), so the gradients of the parameters below it (the
    layer's attention blocks, the earlier new weights) keep their terms along the residual stream and miss the ones
    through the FFN."""
    model = lively_model("llama-gqa2-tied", "adapt", preserve_layers=2)
    ids, mask = token_batch(padded=True)
    plain = _plain(model)
    stock, exact = _grads(plain, ids, mask), _grads(plain.double(), ids, mask)
    assert_plain_gradients(_grads(model, ids, mask), stock, exact)  # the control
    norm = model.get_decoder().layers[2].post_attention_layernorm
    assert not norm.constant_input
    norm.constant_input = True
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_plain_gradients(_grads(model, ids, mask), stock, exact, "mutated: a norm taken as constant: ")


# What reads the first W12 layer's input (the base model's stream there) is constant; what a W12 of it reaches is
# not. Per module of that layer, for each collab_modules setting and residual: is its original input constant?
FIRST_W12_LAYER = {
    ("llama-gqa2-tied", ("attn", "ffn")): {"input_layernorm": True, "q_proj": True, "k_proj": True, "v_proj": True,
                                           "o_proj": False, "post_attention_layernorm": False, "gate_proj": False,
                                           "up_proj": False, "down_proj": False, "heads": False},
    ("llama-gqa2-tied", ("ffn",)): {"input_layernorm": True, "q_proj": True, "k_proj": True, "v_proj": True,
                                    "o_proj": True, "post_attention_layernorm": True, "gate_proj": True,
                                    "up_proj": True, "down_proj": False, "heads": True},
    ("neox-parallel-rot0.25", ("attn",)): {"input_layernorm": True, "query_key_value": True, "dense": False,
                                           "post_attention_layernorm": True, "dense_h_to_4h": True,
                                           "dense_4h_to_h": True, "heads": False},
    ("neox-sequential-rot1.0", ("attn",)): {"input_layernorm": True, "query_key_value": True, "dense": False,
                                            "post_attention_layernorm": False, "dense_h_to_4h": False,
                                            "dense_4h_to_h": False, "heads": False},
}  # fmt: skip


def _marks(layer) -> dict[str, bool]:
    marks = {
        name.rsplit(".", 1)[-1]: m.constant_input for name, m in layer.named_modules() if isinstance(m, FAST_MODULES)
    }
    heads = [m.scale_heads.constant for m in layer.modules() if hasattr(m, "scale_heads")]
    return {**marks, "heads": heads[0]}


@pytest.mark.parametrize(("arch", "collab"), list(FIRST_W12_LAYER))
@pytest.mark.parametrize(("method", "first_w12"), [("preserve", 3), ("adapt", 2), ("route", 2)])
def test_constant_input_marks_what_no_w12_reaches(arch, collab, method, first_w12):
    cfg = ScaleConfig(hidden_up=32, ffn_up=16, method=method, preserve_layers=2, collab_modules=collab)
    model = upscale(make_model(arch), cfg)
    layers = model.get_decoder().layers
    for index, layer in enumerate(layers):
        marks = _marks(layer)
        if index == first_w12:
            assert marks == FIRST_W12_LAYER[arch, collab]
        else:
            assert set(marks.values()) == {index < first_w12}, index
    constant_head = first_w12 == len(layers)
    assert model.get_decoder().get_submodule(next(n for n in ("norm", "final_layer_norm") if hasattr(
        model.get_decoder(), n))).constant_input is constant_head  # fmt: skip
    assert model.get_output_embeddings().constant_input is constant_head
    # Route's stacked layers (from preserve_layers on) hold a constant preserve half; nothing else does.
    for index, layer in enumerate(layers):
        flags = {m.constant_half for m in layer.modules() if isinstance(m, FAST_MODULES)}
        flags |= {m.scale_heads.constant_half for m in layer.modules() if hasattr(m, "scale_heads")}
        assert flags == {method == "route" and index >= 2}
    set_method(model, "preserve")
    assert all(m.constant_input for m in model.modules() if isinstance(m, FAST_MODULES))
    assert not any(m.constant_half for m in model.modules() if isinstance(m, FAST_MODULES))
    assert all(m.scale_heads.constant for m in model.modules() if hasattr(m, "scale_heads"))


@pytest.mark.parametrize("constant", [True, False])
def test_constant_input_stops_the_gradient_into_the_original_stream(constant):
    model = upscale(
        make_model("llama-gqa2-tied"), ScaleConfig(hidden_up=32, ffn_up=16, w21_init="random", w22_init="random")
    )
    linear = model.model.layers[0].mlp.up_proj
    linear.constant_input = constant
    hidden = torch.randn(2, 5, linear.in_features + linear.in_up, requires_grad=True)
    linear(hidden).sum().backward()
    into_original = hidden.grad[..., : linear.in_features]
    # Plain: W and W21 send gradient back into x. Fast: x is a constant, so nothing is computed for it.
    assert bool(torch.count_nonzero(into_original) == 0) is constant
    assert torch.count_nonzero(hidden.grad[..., linear.in_features :]) > 0


@pytest.mark.parametrize("use_w12", [True, False])
def test_route_stacked_linear_sends_no_gradient_into_the_preserve_half(use_w12):
    """Route's stacked batch: the preserve half's original part is a constant (no gradient computed
    into it, none saved for its frozen product); the outputs equal the plain computation's."""
    model = upscale(
        make_model("llama-gqa2-tied"), ScaleConfig(hidden_up=32, ffn_up=16, w21_init="random", w22_init="random")
    )
    randomize_new_weights(hold_w12(model), seed=2, w12_scale=0.3)
    linear = model.model.layers[1].mlp.up_proj
    linear.use_w12, linear.constant_input = use_w12, False  # a collaborative layer's: its x is not constant
    linear.route = model.scale_route
    set_live_settings(model, route_tau=0.5)
    model.scale_route.switch(True, first_stacked=1)
    hidden = torch.randn(4, 5, linear.in_features + linear.in_up, generator=torch.Generator().manual_seed(4))

    def forward(linear, fast: bool, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        linear.constant_half = fast
        leaf = hidden.clone().requires_grad_(True)
        out = linear(leaf)
        out.backward(torch.ones_like(out))
        return out.detach(), leaf.grad

    (out, grad), (plain_out, plain_grad) = forward(linear, True, hidden), forward(linear, False, hidden)
    exact_out, exact_grad = forward(copy.deepcopy(linear).double(), False, hidden.double())
    assert_exact_to_rounding(out, exact_out, stock=plain_out, what="output")
    d = linear.in_features
    assert torch.count_nonzero(grad[:2, :, :d]) == 0  # the preserve half's x: a constant
    assert torch.count_nonzero(plain_grad[:2, :, :d]) > 0  # the plain computation takes its gradient
    # the adapt half's gradient is unchanged, and the preserve half's into x_up
    assert_exact_to_rounding(grad[2:], exact_grad[2:], stock=plain_grad[2:], what="into the adapt half")
    what = "into the preserve half's x_up"
    assert_exact_to_rounding(grad[:2, :, d:], exact_grad[:2, :, d:], stock=plain_grad[:2, :, d:], what=what)


def _mlp_the_base_way(mlp, hidden: torch.Tensor) -> torch.Tensor:
    """The base model's MLP formula applied to the widened linears: activation over the full width."""
    gate, up, down, act = (getattr(mlp, name) if name else None for name in mlp.names)
    inner = act(up(hidden)) if gate is None else act(gate(hidden)) * up(hidden)
    return down(inner)


def _saved_shapes(fn, *args) -> tuple[torch.Tensor, list[torch.Size]]:
    """``fn(*args)`` and the shape of every tensor autograd saves for backward while running it."""
    shapes: list[torch.Size] = []

    def pack(tensor):
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*args)
    return out, shapes


def _backward_through(forward, model, module, hidden: torch.Tensor) -> tuple:
    """``forward(hidden)`` and a backward of ones: (output, gradient into ``hidden``, ``module``'s parameter
    gradients, the shapes autograd saved)."""
    model.zero_grad(set_to_none=True)
    leaf = hidden.clone().requires_grad_(True)
    out, shapes = _saved_shapes(forward, leaf)
    out.backward(torch.ones_like(out))
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    return out.detach(), leaf.grad, grads, shapes


@pytest.mark.parametrize("arch", ["llama-biases", "neox-parallel-rot0.25"])
@pytest.mark.parametrize("constant", [True, False])
def test_split_mlp_equals_the_base_formula_and_keeps_no_full_width_activation(arch, constant):
    """`ScaleMLP` applies the activation (and gate) per part: same output and gradients as over the
    full width; where the original columns are constant it saves nothing of their width for backward."""
    base = make_model(arch)
    # ffn_up 24: the full FFN width (72 or 120) then differs from every other width in the MLP.
    cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=24, w21_init="random", w22_init="random")
    model = randomize_new_weights(upscale(base, cfg), seed=1, w12_scale=0.3)
    mlp = model.get_decoder().layers[0].mlp
    for module in mlp.modules():
        if isinstance(module, ScaleLinear):
            module.constant_input = constant
    up = getattr(mlp, mlp.names[1])
    full_width = up.out_features + up.out_up
    assert up.out_up == cfg.ffn_up
    hidden = torch.randn(2, 5, up.in_features + up.in_up, generator=torch.Generator().manual_seed(3))

    out, into, grads, shapes = _backward_through(mlp, model, mlp, hidden)
    base_way = functools.partial(_mlp_the_base_way, mlp)
    ref_out, ref_into, ref_grads, ref_shapes = _backward_through(base_way, model, mlp, hidden)
    mlp64 = copy.deepcopy(mlp).double()
    exact = _backward_through(functools.partial(_mlp_the_base_way, mlp64), mlp64, mlp64, hidden.double())

    assert_exact_to_rounding(out, exact[0], stock=ref_out, what="output")
    assert_exact_to_rounding(into, exact[1], stock=ref_into, what="gradient into the input")
    assert_plain_gradients(grads, ref_grads, exact[2])
    # What the activation and gate keep for backward (the linears save 2-D views, these are 3-D):
    # the base formula all ffn + ffn_up columns; the split one only the columns that need gradients.
    kept = sorted({shape[-1] for shape in shapes if len(shape) == 3})
    assert {shape[-1] for shape in ref_shapes if len(shape) == 3} == {full_width}
    assert kept == ([cfg.ffn_up] if constant else [cfg.ffn_up, up.out_features])


def test_route_mlp_runs_the_halves_apart_and_keeps_nothing_of_the_preserve_halfs_original_columns():
    """Route's stacked training batch through a collaborative `ScaleMLP`: the same output and gradients as the plain
    computation; the preserve half's original ``ffn`` columns (a constant there) are saved for no backward."""
    base = make_model("llama-biases")
    cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=24, w21_init="random", w22_init="random")
    model = randomize_new_weights(upscale(base, cfg), seed=1, w12_scale=0.3)
    set_method(model, "route")
    mlp = model.get_decoder().layers[1].mlp
    up = getattr(mlp, mlp.names[1])
    assert up.constant_half and up.use_w12
    hidden = torch.randn(4, 5, up.in_features + up.in_up, generator=torch.Generator().manual_seed(3))

    def through(mlp, fast: bool, hidden: torch.Tensor) -> tuple:
        for module in mlp.modules():
            if isinstance(module, ScaleLinear):
                module.constant_half = fast
        return _backward_through(mlp, mlp, mlp, hidden)

    (out, into, grads, shapes), (ref_out, ref_into, ref_grads, ref_shapes) = (
        through(mlp, True, hidden),
        through(mlp, False, hidden),
    )
    exact_out, exact_into, exact_grads, _ = through(copy.deepcopy(mlp).double(), False, hidden.double())

    assert_exact_to_rounding(out, exact_out, stock=ref_out, what="output")
    d = up.in_features
    assert torch.count_nonzero(into[:2, :, :d]) == 0  # the preserve half's x: a constant
    assert_exact_to_rounding(into[2:], exact_into[2:], stock=ref_into[2:], what="into the adapt half")
    what = "into the preserve half's x_up"
    assert_exact_to_rounding(into[:2, :, d:], exact_into[:2, :, d:], stock=ref_into[:2, :, d:], what=what)
    assert_plain_gradients(grads, ref_grads, exact_grads)
    # Activations of the original ffn columns kept for backward: the adapt half's only (2 rows), not the stacked 4.
    wide = [shape for shape in shapes if len(shape) == 3 and shape[-1] == up.out_features]
    assert wide and all(shape[0] == 2 for shape in wide)
    assert any(shape[0] == 4 for shape in ref_shapes if len(shape) == 3 and shape[-1] == up.out_features)


@pytest.mark.parametrize("method", ["preserve", "adapt"])
def test_the_head_sums_z_up_into_z_in_place_with_the_values_and_gradients_of_a_copy(method):
    """The head accumulates ``alpha Z_up`` into ``Z``'s own memory unless ``Z`` is kept (the free teacher's
    ``capture_base``); both give the same logits and parameter gradients, and the kept ``Z`` stays the base's."""
    base = make_model("llama-gqa2-tied").double()
    cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=16, method=method, w21_init="random", w22_init="random")
    model = randomize_new_weights(upscale(copy.deepcopy(base), cfg), seed=1, w12_scale=0.3, head_scale=0.3)
    set_live_settings(model, up_logit_scale=0.7)
    ids, mask = token_batch(padded=True)
    in_place = _grads(model, ids, mask)
    logits = model(input_ids=ids, attention_mask=mask).logits.detach()
    model.scale_route.capture_base = True
    copied = _grads(model, ids, mask)
    kept = model.scale_route.base_logits
    with torch.no_grad():
        copied_logits = model(input_ids=ids, attention_mask=mask).logits
    assert in_place.keys() == copied.keys() and in_place
    # All in float64 (eps 2.2e-16), the same products on the same values, accumulated into Z's memory or into a
    # copy: at most a few eps apart (bitwise here). 1e-12 absolute on logits and gradients of order 1e-2..10 (and
    # 1e-10 relative) is >= ~1e4 eps, and far below what a lost term or a wrong alpha (0.7 here) moves (>= 1e-3).
    for name in in_place:
        torch.testing.assert_close(in_place[name], copied[name], atol=1e-12, rtol=1e-10, msg=name)
    torch.testing.assert_close(logits, copied_logits, atol=1e-12, rtol=0)
    if method == "preserve":  # its Z is the base's logits exactly (the same products on the base's bitwise stream)
        torch.testing.assert_close(kept, base(input_ids=ids, attention_mask=mask).logits.detach(), atol=1e-10, rtol=0)
