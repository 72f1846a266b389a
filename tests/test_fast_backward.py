"""Skipping the gradient through frozen products where the original stream is constant is exact.

`set_method` marks the modules whose original input depends on no trainable parameter
(``constant_input``); they detach it, so the backward pass never runs through a frozen ``W`` or a
frozen norm there, and route computes the preserve path's original logits without gradient. The
parameter gradients must equal those of the plain computation (every ``constant_input`` off).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import hidden_up_for, make_model, randomize_new_weights, token_batch
from scale_cl import ScaleConfig, set_method, upscale
from scale_cl.layers import ScaleHead, ScaleLinear, SplitNorm

FAST_MODULES = (ScaleLinear, SplitNorm, ScaleHead)


def _grads(model, ids, mask) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _plain(model):
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, FAST_MODULES):
            module.constant_input = False
    return plain


@pytest.mark.parametrize(
    "arch", ["llama-gqa2-tied", "qwen2-qkv-bias", "neox-parallel-rot0.25", "neox-sequential-rot1.0"]
)
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
@pytest.mark.parametrize("preserve_layers", [0, 2, 3])
def test_parameter_gradients_equal_the_plain_computation(arch, method, preserve_layers):
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
    model = randomize_new_weights(upscale(base, cfg), seed=1, w12_scale=0.3)
    ids, mask = token_batch(padded=True)
    fast, plain = _grads(model, ids, mask), _grads(_plain(model), ids, mask)
    assert fast.keys() == plain.keys() and fast
    for name in fast:
        torch.testing.assert_close(fast[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("method", "constant_layers", "constant_head"), [("preserve", 3, True), ("adapt", 2, False), ("route", 2, False)]
)
def test_constant_input_marks_exactly_the_layers_below_the_first_w12(method, constant_layers, constant_head):
    model = upscale(
        make_model("llama-gqa2-tied"), ScaleConfig(hidden_up=32, ffn_up=16, method=method, preserve_layers=2)
    )
    for index, layer in enumerate(model.model.layers):
        flags = {m.constant_input for m in layer.modules() if isinstance(m, FAST_MODULES)}
        assert flags == {index < constant_layers}
    assert model.model.norm.constant_input is constant_head
    assert model.lm_head.constant_input is constant_head
    set_method(model, "preserve")
    assert all(m.constant_input for m in model.modules() if isinstance(m, FAST_MODULES))


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
