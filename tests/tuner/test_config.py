"""ScaleConfig validation, upscale's checks against the model, and deterministic upscaling."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from scale_cl import METHODS, ScaleConfig, scale_config_of, set_method, upscale
from scale_cl.tuner.layers import ScaleLinear
from tests.conftest import VOCAB, hidden_up_for, make_model
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def probe_ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(31)
    return torch.randint(3, VOCAB, (2, 9), generator=gen)


def new_params(model) -> dict[str, torch.Tensor]:
    names = ("w12", "w21", "w22", "bias_up", "weight_up")
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in names}


# ----------------------------------------------------------------------------- ScaleConfig alone


@pytest.mark.parametrize("hidden_up", [0, -32])
def test_hidden_up_must_be_positive(hidden_up):
    with pytest.raises(ValueError, match=rf"ScaleConfig.hidden_up must be > 0, got {hidden_up}"):
        ScaleConfig(hidden_up=hidden_up, ffn_up=16)


def test_negative_ffn_up():
    with pytest.raises(ValueError, match=r"ScaleConfig\.ffn_up must be >= 0, got -1"):
        ScaleConfig(hidden_up=32, ffn_up=-1)


@pytest.mark.parametrize(("given", "concrete"), [(-1, 2), (-3, 0), (0, 0), (3, 3)])
def test_negative_preserve_layers_count_from_the_top(given, concrete):
    """-k makes the top k layers collaborative whatever the depth; the model records the concrete L_fp."""
    model = upscale(
        make_model("llama-gqa2-tied"), ScaleConfig(hidden_up=32, ffn_up=16, method="adapt", preserve_layers=given)
    )
    assert scale_config_of(model).preserve_layers == concrete
    layers = [
        i
        for i, layer in enumerate(model.model.layers)
        if any(isinstance(m, ScaleLinear) and m.collaborative for m in layer.modules())
    ]
    assert layers == list(range(concrete, 3))


@pytest.mark.parametrize("field", ["hidden_up", "ffn_up", "preserve_layers", "seed"])
@pytest.mark.parametrize("value", [32.0, "32", True])
def test_int_fields_reject_other_types(field, value):
    kwargs = {"hidden_up": 32, "ffn_up": 16, field: value}
    with pytest.raises(ValueError, match=f"ScaleConfig.{field} must be a whole number"):
        ScaleConfig(**kwargs)


@pytest.mark.parametrize(
    ("tau", "why"),
    [
        *[(tau, r"in \[-1, 1\]") for tau in (1.5, -2, 1.0000001)],
        *[(math.nan, "a finite number"), ("0.5", "a number, e.g. 0.001"), (True, "a number, e.g. 0.001")],
    ],
)
def test_route_tau_outside_minus_one_one(tau, why):
    with pytest.raises(ValueError, match=f"ScaleConfig.route_tau must be {why}, got"):
        ScaleConfig(hidden_up=32, ffn_up=16, route_tau=tau)


@pytest.mark.parametrize("tau", [-1, -1.0, 0, 0.5, 1, 1.0])
def test_route_tau_bounds_are_valid(tau):
    cfg = ScaleConfig(hidden_up=32, ffn_up=16, route_tau=tau)
    assert cfg.route_tau == float(tau)
    assert isinstance(cfg.route_tau, float)


@pytest.mark.parametrize("method", ["Preserve", "lora", "", "routes"])
def test_unknown_method(method):
    with pytest.raises(ValueError, match=r"method must be one of \('preserve', 'adapt', 'route'\)"):
        ScaleConfig(hidden_up=32, ffn_up=16, method=method)


@pytest.mark.parametrize("field", ["w21_init", "w22_init"])
@pytest.mark.parametrize("value", ["xavier", "SVD", ""])
def test_unknown_init(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be one of \('zero', 'random', 'svd'\)"):
        ScaleConfig(hidden_up=32, ffn_up=16, **{field: value})


@pytest.mark.parametrize("modules", [(), ("mlp",), ("attn", "embed"), ("attn", "attn")])
def test_bad_collab_modules(modules):
    with pytest.raises(ValueError, match="collab_modules"):
        ScaleConfig(hidden_up=32, ffn_up=16, collab_modules=modules)


def test_collab_modules_list_is_normalised_to_tuple():
    assert ScaleConfig(hidden_up=32, ffn_up=16, collab_modules=["ffn"]).collab_modules == ("ffn",)


def test_to_dict_from_dict_round_trip():
    cfg = ScaleConfig(
        hidden_up=48,
        ffn_up=0,
        method="route",
        preserve_layers=2,
        collab_modules=("attn",),
        w21_init="random",
        w22_init="svd",
        route_tau=-0.25,
        seed=9,
    )
    data = cfg.to_dict()
    assert data["collab_modules"] == ["attn"]
    assert ScaleConfig.from_dict(data) == cfg
    assert ScaleConfig.from_dict(json.loads(json.dumps(data))) == cfg  # as stored in scale_config.json
    assert ScaleConfig.from_dict(ScaleConfig(hidden_up=32, ffn_up=8).to_dict()) == ScaleConfig(hidden_up=32, ffn_up=8)


def test_from_dict_rejects_unknown_fields():
    data = {**ScaleConfig(hidden_up=32, ffn_up=16).to_dict(), "lora_rank": 8}
    with pytest.raises(ValueError, match=r"unknown ScaleConfig fields \['lora_rank'\]"):
        ScaleConfig.from_dict(data)


def test_from_dict_validates():
    data = {**ScaleConfig(hidden_up=32, ffn_up=16).to_dict(), "route_tau": 3.0}
    with pytest.raises(ValueError, match="route_tau"):
        ScaleConfig.from_dict(data)


# ----------------------------------------------------------------------------- checks against a model


@pytest.mark.parametrize(
    ("arch", "unit"),
    [
        ("llama-mha-untied", 16),
        ("llama-gqa2-tied", 32),
        ("llama-gqa3-tied", 48),
        ("llama-gqa4-untied", 64),
        ("llama-mqa", 64),
        ("neox-parallel-rot0.25", 16),
    ],
)
def test_hidden_up_must_add_whole_heads(arch, unit):
    base = make_model(arch)
    assert hidden_up_for(base) == unit
    for bad in (unit // 2, unit + 8, 3 * unit // 2):  # none is a multiple of the unit
        with pytest.raises(ValueError, match=rf"hidden_up={bad} must add whole attention heads") as err:
            upscale(copy.deepcopy(base), ScaleConfig(hidden_up=bad, ffn_up=16))
        message = str(err.value)
        assert f"= {unit} " in message  # the unit itself
        assert f"valid values: {unit}, {2 * unit}, {3 * unit}" in message
    # The failed attempts left the model untouched, and a multiple of the unit works.
    assert not getattr(base, "is_scale_upscaled", False)
    upscale(base, ScaleConfig(hidden_up=2 * unit, ffn_up=16))


@pytest.mark.parametrize("preserve_layers", [4, -4])
def test_preserve_layers_beyond_the_model(preserve_layers):
    base = make_model("llama-gqa2-tied")
    with pytest.raises(
        ValueError, match=f"preserve_layers={preserve_layers} does not fit the model's 3 decoder layers"
    ):
        upscale(copy.deepcopy(base), ScaleConfig(hidden_up=32, ffn_up=16, preserve_layers=preserve_layers))
    model = upscale(base, ScaleConfig(hidden_up=32, ffn_up=16, method="adapt", preserve_layers=3))
    assert not any(m.collaborative for m in model.modules() if isinstance(m, ScaleLinear))


def test_unsupported_architecture_names_supported_ones():
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="cannot upscale GPT2LMHeadModel") as err:
        upscale(model, ScaleConfig(hidden_up=16, ffn_up=16))
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPTNeoXForCausalLM"):
        assert supported in str(err.value)


def test_upscale_needs_a_scale_config():
    with pytest.raises(TypeError, match="ScaleConfig"):
        upscale(make_model("llama-mqa"), {"hidden_up": 64, "ffn_up": 16})


@pytest.mark.parametrize("method", ["lora", "Route", None])
def test_set_method_unknown_leaves_model_unchanged(method):
    model = upscale(make_model("llama-gqa2-tied"), ScaleConfig(hidden_up=32, ffn_up=16, method="adapt"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="method must be one of"):
        set_method(model, method)
    assert scale_config_of(model).method == "adapt"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_set_method_on_a_plain_model():
    with pytest.raises(ValueError, match="not upscaled"):
        set_method(make_model("llama-gqa2-tied"), "adapt")


@pytest.mark.parametrize("method", METHODS)
def test_set_method_updates_the_recorded_config(method):
    model = upscale(make_model("llama-mqa"), ScaleConfig(hidden_up=64, ffn_up=16, method="preserve"))
    set_method(model, method)
    assert scale_config_of(model).method == method
    assert model.scale_config.method == method


# ----------------------------------------------------------------------------- positive checks


@pytest.mark.parametrize("method", METHODS)
def test_ffn_up_zero_works_and_preserves_logits(arch_name, method):
    base = make_model(arch_name, seed=0)
    with torch.no_grad():
        expected = base(probe_ids()).logits
        exact = copy.deepcopy(base).double()(probe_ids()).logits
    cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=0, method=method, preserve_layers=1, w22_init="random")
    model = upscale(copy.deepcopy(base), cfg)
    ffn = [m for m in model.modules() if isinstance(m, ScaleLinear) and m.sublayer == "ffn"]
    assert ffn and all(m.w21.shape[0] == 0 or m.in_up == 0 for m in ffn)
    assert model.config.intermediate_size == base.config.intermediate_size
    with torch.no_grad():
        logits = model(probe_ids()).logits
    assert_exact_to_rounding(logits, exact, stock=expected, what="the base model's logits")
    # It trains: a backward pass reaches the new parameters.
    model.train()
    model(probe_ids(), labels=probe_ids()).loss.backward()
    assert model.get_output_embeddings().weight_up.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["llama-gqa3-tied", "neox-parallel-rot0.25"])
@pytest.mark.parametrize("init", ["svd", "random"])
def test_upscale_is_deterministic(arch, init):
    base = make_model(arch, seed=0)

    def build(seed: int):
        cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=16, w21_init=init, w22_init=init, seed=seed)
        return new_params(upscale(copy.deepcopy(base), cfg))

    torch.manual_seed(123)
    first = build(0)
    torch.manual_seed(456)  # the global RNG state does not matter, only the config's seed
    second = build(0)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name

    other = build(1)
    embedding_up = next(n for n in first if "embed" in n and n.endswith("weight_up"))
    assert not torch.equal(first[embedding_up], other[embedding_up])
    w21 = [n for n in first if n.endswith("w21") and first[n].numel()]
    if init == "random":
        assert all(not torch.equal(first[n], other[n]) for n in w21)
    else:  # a full SVD of these small matrices does not depend on the seed
        assert all(torch.equal(first[n], other[n]) for n in w21)
    assert any(first[n].abs().sum() > 0 for n in w21)


def test_upscale_does_not_touch_the_global_rng():
    base = make_model("llama-gqa2-tied")
    torch.manual_seed(5)
    upscale(base, ScaleConfig(hidden_up=32, ffn_up=16, w21_init="random", w22_init="random"))
    after = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(4))


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-sequential-rot1.0"])
def test_upscale_widens_the_hf_config(arch):
    base = make_model(arch)
    d, f, heads = base.config.hidden_size, base.config.intermediate_size, base.config.num_attention_heads
    u = 2 * hidden_up_for(base)
    model = upscale(base, ScaleConfig(hidden_up=u, ffn_up=24))
    assert model.config.hidden_size == d + u
    assert model.config.intermediate_size == f + 24
    assert model.config.num_attention_heads == heads + u // 16
    assert model.get_output_embeddings().weight_up.shape == (VOCAB, u)
