"""`scale_cl.methods.prepare`: one entry point for FFT, LoRA, Freeze, LLaMA Pro and the SCALE methods.

For every method: the trainable set is exactly what the method says (derived here from parameter
names and layer indices, not from the implementation), frozen parameters stay bitwise unchanged
while trainable ones move, the function-preserving methods give the base logits at step 0, and the
parameter matching of Section 5.1 (LoRA rank, LLaMA Pro blocks) agrees with brute force.

"The base logits" is to rounding: as close to the base model's float64 logits as the base model's own fp32 logits
are (`exactness.assert_exact_to_rounding`).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scale_cl import ScaleConfig, parameter_summary, scale_config_of, upscale
from scale_cl.methods import (
    METHOD_NAMES,
    REGISTRY,
    lora_trainable_count,
    match_llama_pro_blocks,
    match_lora_rank,
    method_options,
    prepare,
    scale_spec,
    scale_trainable_count,
    trainable_parameter_count,
)
from scale_cl.tuner.config import METHODS as SCALE_CONFIG_METHODS
from tests.conftest import ARCHS, VOCAB, greedy, hidden_up_for, make_model, tiny_scale_config, token_batch
from tests.exactness import assert_exact_to_rounding

SCALE_NAMES = ("scale_preserve", "scale_adapt", "scale_route")
LLAMA, NEOX_PAR, NEOX_SEQ = "llama-gqa2-tied", "neox-parallel-rot0.25", "neox-sequential-rot1.0"
ATTN_OUT = {"llama": ("self_attn.o_proj", "mlp.down_proj"), "neox": ("attention.dense", "mlp.dense_4h_to_h")}

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # transformers 5: is_gradient_checkpointing
    pytest.mark.exactness,
]


# --------------------------------------------------------------------------------------------
# Helpers


def deep_model(name: str, layers: int, seed: int = 0, **config_overrides):
    """A tiny model of architecture ``name`` with ``layers`` decoder layers (perturbed like conftest's)."""
    model_cls, config = ARCHS[name]
    data = config.to_dict()
    data.pop("layer_types", None)
    data.update(num_hidden_layers=layers, **config_overrides)
    torch.manual_seed(seed)
    model = model_cls(type(config)(**data))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def scale_cfg(base, method: str = "preserve", **fields) -> ScaleConfig:
    return tiny_scale_config(base, method, **{"preserve_layers": 1, **fields})


def options_for(method: str, base) -> dict:
    """Small, valid options for each method on a conftest model."""
    if method == "lora":
        return {"rank": 4}
    if method == "freeze":
        return {"layers": 1}
    if method == "llama_pro":
        return {"blocks": 1}
    if method in SCALE_NAMES:  # random W22 too: a non-zero new stream everywhere from the start
        return {
            "hidden_up": hidden_up_for(base),
            "ffn_up": 8,
            "preserve_layers": 1,
            "w21_init": "random",
            "w22_init": "random",
        }
    return {}


def layer_index(name: str) -> int | None:
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def all_names(model) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def trainable_names(model) -> set[str]:
    return {name for name, p in all_names(model).items() if p.requires_grad}


def family(name: str) -> str:
    return "neox" if name.startswith("neox") else "llama"


def logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def assert_base_logits(got: torch.Tensor, base, ids, mask, what: str) -> torch.Tensor:
    """``got`` is ``base``'s logits on the batch to rounding (as close to its float64 logits as its fp32 logits
    are); returns the base's fp32 logits."""
    want = logits(base, ids, mask)
    assert got.shape == want.shape, what
    assert torch.isfinite(want).all()
    exact = logits(copy.deepcopy(base).double(), ids, mask)
    assert_exact_to_rounding(got, exact, stock=want, what=what)
    return want


def train_two_steps(model) -> tuple[set[str], set[str]]:
    """Two AdamW steps (no weight decay: only gradients move parameters); returns (frozen, moved) names.

    Asserts that every frozen parameter (under every name it has) is bitwise unchanged and got no gradient.
    """
    ids, mask = token_batch(padded=True, pads=(4,))
    before = {name: p.detach().clone() for name, p in all_names(model).items()}
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
    frozen, moved = set(), set()
    for name, p in all_names(model).items():
        if p.requires_grad:
            if not torch.equal(p.detach(), before[name]):
                moved.add(name)
        else:
            frozen.add(name)
            assert p.grad is None, f"frozen {name} got a gradient"
            assert torch.equal(p.detach(), before[name]), f"frozen {name} changed"
    return frozen, moved


def expected_llama_pro_positions(num_layers: int, blocks: int) -> list[int]:
    """Where the new blocks sit in the expanded stack: after each group of L/N originals."""
    group = num_layers // blocks
    return [k * (group + 1) + group for k in range(blocks)]


# --------------------------------------------------------------------------------------------
# Dispatcher: names, options, errors


@pytest.mark.slow
def test_registry_derives_the_scale_methods_and_imports_no_baseline_until_asked():
    """One registry: its SCALE entries are ScaleConfig's methods, and `import scale_cl` pulls in no PEFT."""
    scale = {spec.scale_method for spec in REGISTRY.values() if spec.is_scale}
    assert scale == set(SCALE_CONFIG_METHODS) and len(METHOD_NAMES) == len(REGISTRY) == 7
    assert all(scale_spec(spec.scale_method) is spec for spec in REGISTRY.values() if spec.is_scale)
    with pytest.raises(ValueError, match="unknown SCALE method 'scale_route'; valid: preserve, adapt, route"):
        scale_spec("scale_route")  # a method's name is not its ScaleConfig.method
    assert all(callable(spec.prepare_function()) for spec in REGISTRY.values())
    code = "import sys, scale_cl, scale_cl.methods; print(any(m.split('.')[0] == 'peft' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
    assert method_options("fft") == ()
    assert set(method_options("lora")) == {"rank", "alpha", "dropout", "target_modules", "match"}
    assert method_options("freeze") == ("layers",)
    assert set(method_options("llama_pro")) == {"blocks", "match"}
    assert {"scale", "hidden_up", "ffn_up", "preserve_layers", "collab_modules"} <= set(method_options("scale_adapt"))
    assert "method" not in method_options("scale_adapt")


def test_unknown_method_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown method 'qlora'.*fft, lora, freeze, llama_pro, scale_preserve"):
        prepare(make_model(LLAMA), "qlora")


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_unknown_option_names_the_accepted_ones(method):
    base = make_model(LLAMA)
    expected = "takes no options" if method == "fft" else re.escape(repr(list(method_options(method))))
    with pytest.raises(ValueError, match=rf"{method}: unknown options \['bogus'\]; .*{expected}"):
        prepare(base, method, bogus=1, **options_for(method, base))
    # nothing was changed by the refused call
    assert all(p.requires_grad for p in base.parameters())
    assert not hasattr(base.config, "scale_cl") and not hasattr(base.config, "llama_pro")


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("freeze", {"layers": 4}, "layers=4 must be between 0 and the model's 3 decoder layers"),
        ("freeze", {"layers": -1}, "layers=-1 must be between 0"),
        ("freeze", {"layers": "2"}, "layers must be an int"),
        ("freeze", {"layers": True}, "layers must be an int"),
        ("llama_pro", {"blocks": 2}, r"blocks=2 must divide the model's 3 layers.*valid values: \[1, 3\]"),
        ("llama_pro", {"blocks": 0}, r"valid values: \[1, 3\]"),
        ("llama_pro", {"blocks": "match"}, "blocks='match' needs match="),
        ("llama_pro", {"blocks": 1, "match": ScaleConfig(hidden_up=16, ffn_up=0)}, "only read with blocks='match'"),
        ("lora", {"rank": "match"}, "rank='match' needs match="),
        ("lora", {"rank": 4, "match": ScaleConfig(hidden_up=16, ffn_up=0)}, "only read with rank='match'"),
        ("lora", {"rank": 0}, "rank must be a positive int or 'match'"),
        ("lora", {"rank": 2.5}, "rank must be a positive int"),
        ("lora", {"alpha": -1.0}, "alpha must be a positive number"),
        ("lora", {"dropout": 1.5}, r"dropout must be a number in \[0, 1\)"),
        ("lora", {"target_modules": []}, "target_modules must be"),
        ("lora", {"rank": "match", "match": {"hidden_up": 16}}, "match must be a ScaleConfig"),
        ("scale_adapt", {}, r"missing \['hidden_up', 'ffn_up'\]"),
        ("scale_adapt", {"ffn_up": 8}, r"missing \['hidden_up'\]"),
        ("scale_adapt", {"hidden_up": 32, "ffn_up": 8, "method": "route"}, r"unknown options \['method'\]"),
        ("scale_adapt", {"scale": {"hidden_up": 16}}, "scale must be a ScaleConfig"),
        ("scale_adapt", {"hidden_up": 24, "ffn_up": 8}, "must add whole attention heads"),
        ("scale_route", {"hidden_up": 16, "ffn_up": 8, "route_tau": 2.0}, "route_tau"),
    ],
)
def test_invalid_option_values(method, options, message):
    with pytest.raises(ValueError, match=message):
        prepare(make_model(LLAMA), method, **options)


# --------------------------------------------------------------------------------------------
# The trainable set of each method, and training keeps the frozen part bitwise


@pytest.mark.parametrize("arch", [LLAMA, NEOX_PAR])
def test_fft_trains_everything(arch):
    base = make_model(arch)
    for p in base.parameters():  # start from a partly frozen model: fft must unfreeze it
        p.requires_grad_(False)
    model = prepare(base, "fft")
    assert model is base
    assert trainable_names(model) == set(all_names(model))
    assert trainable_parameter_count(model) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    frozen, moved = train_two_steps(model)
    assert not frozen
    assert moved == set(all_names(model))


def test_trainable_parameter_count_counts_tied_weights_once():
    model = prepare(make_model("llama-gqa2-tied"), "fft")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with_duplicates = sum(p.numel() for p in all_names(model).values())
    tied = model.get_input_embeddings().weight.numel()
    assert trainable_parameter_count(model) == with_duplicates - tied


@pytest.mark.parametrize("arch", [LLAMA, "llama-biases", NEOX_SEQ])
def test_lora_trains_only_adapters_on_every_attention_and_ffn_linear(arch):
    from peft import PeftModel

    base = make_model(arch)
    model = prepare(copy.deepcopy(base), "lora", rank=4)
    assert isinstance(model, PeftModel)
    names = trainable_names(model)
    assert names and all(re.search(r"\.lora_[AB]\.default\.weight$", n) for n in names), sorted(names)
    # every attention/FFN linear has an adapter, the LM head has none
    wrapped = {n.rsplit(".lora_", 1)[0] for n in names}
    if family(arch) == "llama":
        prefix, attn = "base_model.model.model.layers", ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))
        ffn = ("gate_proj", "up_proj", "down_proj")
    else:
        prefix, attn = "base_model.model.gpt_neox.layers", ("attention", ("query_key_value", "dense"))
        ffn = ("dense_h_to_4h", "dense_4h_to_h")
    expected = {f"{prefix}.{i}.{attn[0]}.{s}" for i in range(3) for s in attn[1]}
    expected |= {f"{prefix}.{i}.mlp.{s}" for i in range(3) for s in ffn}
    assert wrapped == expected
    assert trainable_parameter_count(model) == lora_trainable_count(base, 4)
    # alpha defaults to 2 * rank
    assert model.peft_config["default"].lora_alpha == 8
    frozen, moved = train_two_steps(model)
    assert moved == names, f"did not move: {sorted(names - moved)}"
    assert frozen == set(all_names(model)) - names


@pytest.mark.parametrize("arch", [LLAMA, "llama-mha-untied", NEOX_PAR])
@pytest.mark.parametrize("layers", [0, 1, 3])
def test_freeze_embedding_and_bottom_layers(arch, layers):
    base = make_model(arch)
    model = prepare(base, "freeze", layers=layers)
    tied = base.config.tie_word_embeddings
    embed = "model.embed_tokens.weight" if family(arch) == "llama" else "gpt_neox.embed_in.weight"
    head = "lm_head.weight" if family(arch) == "llama" else "embed_out.weight"
    expected_frozen = {
        name
        for name in all_names(model)
        if name == embed or (tied and name == head) or layer_index(name) in range(layers)
    }
    assert set(all_names(model)) - trainable_names(model) == expected_frozen
    assert (head in expected_frozen) == tied, "a tied LM head is the embedding: frozen with it"
    frozen, moved = train_two_steps(model)
    assert frozen == expected_frozen
    assert moved == set(all_names(model)) - expected_frozen


def test_freeze_selects_layers_by_index_not_name_substring():
    """layers=2 on 12 layers freezes layers 0 and 1 only; "layers.1" must not catch layers 10 and 11."""
    model = prepare(deep_model("llama-mha-untied", layers=12), "freeze", layers=2)
    decoder = model.model.layers
    assert all(not p.requires_grad for i in (0, 1) for p in decoder[i].parameters())
    assert all(p.requires_grad for i in range(2, 12) for p in decoder[i].parameters())
    for name, p in all_names(model).items():
        index = layer_index(name)
        if index in (1, 10, 11):
            assert p.requires_grad == (index != 1), name
    assert not model.model.embed_tokens.weight.requires_grad
    assert model.lm_head.weight.requires_grad and model.model.norm.weight.requires_grad
    frozen, moved = train_two_steps(model)
    assert {layer_index(n) for n in moved} == {*range(2, 12), None}
    assert {layer_index(n) for n in frozen} == {0, 1, None}  # None: the embedding

    all_frozen = prepare(deep_model("llama-mha-untied", layers=12), "freeze", layers=12)
    assert {layer_index(n) for n in trainable_names(all_frozen)} == {None}  # final norm and head
    with pytest.raises(ValueError, match="layers=13 must be between 0 and the model's 12 decoder layers"):
        prepare(deep_model("llama-mha-untied", layers=12), "freeze", layers=13)


@pytest.mark.parametrize(("arch", "layers", "blocks"), [(LLAMA, 3, 1), (NEOX_PAR, 3, 3), ("llama-biases", 12, 3)])
def test_llama_pro_trains_exactly_the_new_blocks(arch, layers, blocks):
    base = deep_model(arch, layers) if layers != 3 else make_model(arch)
    model = prepare(copy.deepcopy(base), "llama_pro", blocks=blocks)
    positions = expected_llama_pro_positions(layers, blocks)
    assert model.config.llama_pro == {"base_layers": layers, "blocks": blocks, "inserted": positions}
    assert trainable_names(model) == {n for n in all_names(model) if layer_index(n) in positions}
    # every original parameter is still there, unchanged, under its new index
    originals = [i for i in range(layers + blocks) if i not in positions]
    backbone = model.model if family(arch) == "llama" else model.gpt_neox
    base_backbone = base.model if family(arch) == "llama" else base.gpt_neox
    for old, new in enumerate(originals):
        assert backbone.layers[new] is not None
        for (n1, p1), (n2, p2) in zip(
            base_backbone.layers[old].named_parameters(), backbone.layers[new].named_parameters(), strict=True
        ):
            assert n1 == n2 and torch.equal(p1, p2) and not p2.requires_grad
    # each copy equals its source block except the zeroed residual outputs
    for pos in positions:
        source = dict(backbone.layers[pos - 1].named_parameters())
        for name, p in backbone.layers[pos].named_parameters():
            if name.rsplit(".", 1)[0] in ATTN_OUT[family(arch)]:
                assert not p.any(), f"{name} not zeroed"
            else:
                assert torch.equal(p, source[name]), name
    frozen, moved = train_two_steps(model)
    assert moved == trainable_names(model), f"did not move: {sorted(trainable_names(model) - moved)}"
    assert {layer_index(n) for n in frozen} - {None} == set(originals)


@pytest.mark.parametrize("method", SCALE_NAMES)
@pytest.mark.parametrize("arch", [LLAMA, NEOX_SEQ])
def test_scale_methods_train_what_upscale_trains(arch, method):
    base = make_model(arch)
    options = options_for(method, base)
    model = prepare(copy.deepcopy(base), method, **options)
    cfg = ScaleConfig(method=method.removeprefix("scale_"), **options)
    assert scale_config_of(model) == cfg
    direct = upscale(copy.deepcopy(base), cfg)
    assert trainable_names(model) == trainable_names(direct)
    assert any(n.endswith(".w12") for n in trainable_names(model)) == (method != "scale_preserve")
    assert trainable_parameter_count(model) == parameter_summary(direct).trainable == scale_trainable_count(base, cfg)
    frozen, moved = train_two_steps(model)
    assert moved == trainable_names(model), f"did not move: {sorted(trainable_names(model) - moved)}"
    originals = set(all_names(base))
    assert originals <= frozen
    assert all(n.endswith(".w12") for n in frozen - originals)  # W12 outside collaborative linears (or preserve)


def test_scale_config_option_and_overrides():
    base = make_model(LLAMA)
    scale = ScaleConfig(hidden_up=32, ffn_up=8, method="preserve", preserve_layers=2)
    model = prepare(copy.deepcopy(base), "scale_route", scale=scale)
    assert scale_config_of(model) == ScaleConfig(hidden_up=32, ffn_up=8, method="route", preserve_layers=2)
    model = prepare(copy.deepcopy(base), "scale_adapt", scale=scale, preserve_layers=1, collab_modules=("attn",))
    assert scale_config_of(model) == ScaleConfig(
        hidden_up=32, ffn_up=8, method="adapt", preserve_layers=1, collab_modules=("attn",)
    )
    assert scale.method == "preserve" and scale.preserve_layers == 2  # the caller's config is untouched


# --------------------------------------------------------------------------------------------
# Step 0: the function-preserving methods compute the base model's logits


@pytest.mark.parametrize("method", ["lora", "llama_pro", *SCALE_NAMES])
@pytest.mark.parametrize("arch", [LLAMA, "llama-biases", "qwen2-qkv-bias", NEOX_PAR, NEOX_SEQ])
def test_step0_logits_equal_base(arch, method):
    base = make_model(arch)
    ids, mask = token_batch(padded=True)
    options = {"blocks": 3} if method == "llama_pro" else options_for(method, base)
    model = prepare(copy.deepcopy(base), method, **options)
    want = assert_base_logits(logits(model, ids, mask), base, ids, mask, f"{method} on {arch}")
    # Guard: the comparison can fail. One trained-looking step of the new part changes the logits.
    with torch.no_grad():
        trainable = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(3)
        for p in trainable:
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        if method in SCALE_NAMES:
            model.get_output_embeddings().weight_up.normal_(0, 0.3)
    assert (logits(model, ids, mask) - want).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------
# LLaMA Pro: config, KV-cache indices, generate


@pytest.mark.parametrize(("arch", "layers", "blocks"), [("qwen2-qkv-bias", 3, 3), (LLAMA, 12, 4), (NEOX_SEQ, 6, 2)])
def test_llama_pro_config_layer_idx_and_generate(arch, layers, blocks):
    base = deep_model(arch, layers)
    with torch.no_grad():  # larger embeddings: greedy tokens vary, so equality is not cheap
        base.get_input_embeddings().weight.mul_(25.0)
    model = prepare(copy.deepcopy(base), "llama_pro", blocks=blocks)
    total = layers + blocks
    assert model.config.num_hidden_layers == total
    backbone = model.model if family(arch) == "llama" else model.gpt_neox
    assert len(backbone.layers) == total
    attention = [layer.self_attn if family(arch) == "llama" else layer.attention for layer in backbone.layers]
    assert [a.layer_idx for a in attention] == list(range(total))
    assert all(a.config is model.config for a in attention), "a copy holds its own config"
    if hasattr(base.config, "layer_types"):
        assert model.config.layer_types == ["full_attention"] * total
        assert base.config.layer_types == ["full_attention"] * layers  # the base is untouched
    else:
        assert getattr(model.config, "layer_types", None) is None

    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    expected = greedy(base, ids, mask)
    assert len(torch.unique(expected[:, ids.shape[1] :])) > 1
    assert torch.equal(greedy(model, ids, mask), expected)


def test_llama_pro_layer_types_follow_their_source_block():
    """Qwen2 with alternating sliding-window layers: each copy gets its source's type, the KV cache follows."""
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    base = deep_model("qwen2-qkv-bias", 4, layer_types=types, use_sliding_window=True, sliding_window=3)
    with torch.no_grad():
        base.get_input_embeddings().weight.mul_(25.0)
    assert base.model.has_sliding_layers
    model = prepare(copy.deepcopy(base), "llama_pro", blocks=2)
    sliding, full = "sliding_attention", "full_attention"
    assert model.config.layer_types == [full, sliding, sliding, full, sliding, sliding]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 3, 3, None, 3, 3]
    ids, mask = token_batch(padded=True)
    assert_base_logits(logits(model, ids, mask), base, ids, mask, "llama_pro with sliding layers")
    expected = greedy(base, ids, mask)
    assert torch.equal(greedy(model, ids, mask), expected)


def test_llama_pro_default_blocks():
    assert prepare(deep_model(LLAMA, 12), "llama_pro").config.llama_pro["blocks"] == 3
    assert prepare(deep_model(LLAMA, 8), "llama_pro").config.llama_pro["blocks"] == 2
    assert prepare(make_model(LLAMA), "llama_pro").config.llama_pro["blocks"] == 1  # 3 // 4 = 0: smallest valid
    assert prepare(deep_model(LLAMA, 6), "llama_pro").config.llama_pro["blocks"] == 1  # 6 // 4 = 1 divides 6


# --------------------------------------------------------------------------------------------
# Parameter matching (Section 5.1)


def test_scale_trainable_count_equals_real_count(arch_name):
    base = make_model(arch_name)
    for method in ("preserve", "adapt", "route"):
        for ffn_up in (0, 8):
            for extra in (
                {},
                {"preserve_layers": 2, "collab_modules": ("attn",)},
                {"hidden_up": hidden_up_for(base, 2)},
            ):
                cfg = scale_cfg(base, method, ffn_up=ffn_up, **extra)
                real = parameter_summary(upscale(copy.deepcopy(base), cfg)).trainable
                assert scale_trainable_count(base, cfg) == real, (method, ffn_up, extra)


def test_scale_trainable_count_rejects_what_upscale_rejects():
    with pytest.raises(ValueError, match="must add whole attention heads"):
        scale_trainable_count(make_model(LLAMA), ScaleConfig(hidden_up=24, ffn_up=0))


@pytest.mark.parametrize("arch", [LLAMA, NEOX_PAR])
@pytest.mark.parametrize("method", ["preserve", "adapt"])
def test_lora_rank_match_is_the_closest_rank_within_10_percent(arch, method):
    base = make_model(arch)
    cfg = scale_cfg(base, method)
    target = scale_trainable_count(base, cfg)
    model = prepare(copy.deepcopy(base), "lora", rank="match", match=cfg)
    rank = model.peft_config["default"].r
    count = trainable_parameter_count(model)
    assert abs(count - target) <= 0.1 * target, (rank, count, target)
    assert model.peft_config["default"].lora_alpha == 2 * rank
    # brute force with real PEFT models: the neighbouring ranks are no closer
    for other in (rank - 1, rank + 1):
        if other >= 1:
            real = trainable_parameter_count(prepare(copy.deepcopy(base), "lora", rank=other))
            assert abs(real - target) >= abs(count - target)


def test_lora_rank_match_fails_when_no_rank_is_within_10_percent():
    # head_dim 4, 16 heads, ffn_up 0: the SCALE count lands between LoRA ranks 1 and 2
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    cfg = ScaleConfig(hidden_up=4, ffn_up=0)
    target = scale_trainable_count(base, cfg)
    per_rank = trainable_parameter_count(prepare(copy.deepcopy(base), "lora", rank=1))
    assert all(abs(r * per_rank - target) > 0.1 * target for r in range(1, 2 * target // per_rank + 2))
    with pytest.raises(ValueError, match="no LoRA rank trains within 10%"):
        prepare(base, "lora", rank="match", match=cfg)


def test_lora_target_modules_count_matches_peft():
    base = make_model("llama-biases")
    for targets in (["q_proj", "v_proj"], ["mlp.down_proj"], r".*\.(k_proj|up_proj)"):
        model = prepare(copy.deepcopy(base), "lora", rank=3, target_modules=targets)
        assert trainable_parameter_count(model) == lora_trainable_count(base, 3, targets), targets


def test_llama_pro_blocks_match_is_the_closest_by_brute_force():
    base = deep_model("llama-mha-untied", 12)
    real = {
        n: trainable_parameter_count(prepare(copy.deepcopy(base), "llama_pro", blocks=n)) for n in (1, 2, 3, 4, 6, 12)
    }
    chosen = set()
    for hidden_mult, ffn_up, method in ((1, 0, "preserve"), (1, 8, "preserve"), (1, 0, "adapt"), (1, 64, "adapt")):
        cfg = scale_cfg(base, method, hidden_up=hidden_up_for(base, hidden_mult), ffn_up=ffn_up)
        target = scale_trainable_count(base, cfg)
        best = min(real, key=lambda n: (abs(real[n] - target), n))
        model = prepare(copy.deepcopy(base), "llama_pro", blocks="match", match=cfg)
        assert model.config.llama_pro["blocks"] == best, (target, real)
        assert trainable_parameter_count(model) == real[best]
        chosen.add(best)
    assert len(chosen) == 4, f"the configs should exercise different block counts, got {chosen}"


def test_methods_do_not_warn_about_anything_unexpected():
    """prepare itself is quiet on a supported model (only transformers' own FutureWarnings are tolerated)."""
    base = make_model(LLAMA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in METHOD_NAMES:
            prepare(copy.deepcopy(base), method, **options_for(method, base))
    assert [str(w.message) for w in caught if not issubclass(w.category, FutureWarning)] == []


@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_matching_on_llama_3_2_1b_shapes_gives_the_papers_16_to_20_layers(method):
    """Section 5.1: SCALE (u=256, f=1024, L_fp=3) on Llama-3.2-1B is matched by LLaMA Pro 16 -> 20 layers.

    Counting needs shapes only, so the 1B model lives on the meta device (no memory, no weights).
    """
    from scale_cl.bench.shapes import SHAPES

    with torch.device("meta"):
        base = LlamaForCausalLM(SHAPES["llama-1b"].make_config())
    target = scale_trainable_count(base, ScaleConfig(hidden_up=256, ffn_up=1024, method=method, preserve_layers=3))
    assert match_llama_pro_blocks(base, target) == 4
    rank = match_lora_rank(base, target)
    assert abs(lora_trainable_count(base, rank) - target) <= 0.1 * target


def test_every_method_declares_the_experiment_settings_it_reads():
    """Each method's declaration names the `MethodSettings` it reads and the prepare options they give; every name is
    real: a setting of `MethodSettings`, an option its prepare function takes."""
    from dataclasses import fields, is_dataclass

    from scale_cl.experiments.settings import MethodSettings, settings_of

    options = MethodSettings()
    for method, spec in REGISTRY.items():
        assert settings_of(method) == spec.reads and spec.reads
        for dotted in spec.reads:
            node = options
            for part in dotted.split("."):
                assert is_dataclass(node) and part in {f.name for f in fields(node)}, f"{method}: {dotted}"
                node = getattr(node, part)
        for option, setting in spec.prepare_settings:
            assert option in method_options(method) and setting in spec.reads, f"{method}: {option}"
        assert spec.match_option is None or spec.match_option in dict(spec.prepare_settings)
    with pytest.raises(ValueError, match="unknown method 'ftt'"):
        settings_of("ftt")


@pytest.mark.slow
def test_import_scale_cl_loads_the_tuner_only():
    """``import scale_cl`` is the tuner: no method, training, data, experiment or CLI module, and no library for
    learning tokens (the vocabulary rows it loads need none), for the baselines (PEFT) or for a quantized base
    (bitsandbytes, imported when a base is quantized)."""
    code = (
        "import json, sys, scale_cl; print(json.dumps(sorted({m for m in sys.modules if m.split('.')[0] in "
        "('peft', 'tokenizers', 'bitsandbytes')} | "
        "{m.split('.')[1] for m in sys.modules if m.startswith('scale_cl.')})))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the tuner's folder and its utilities: the settings' checks (types, ranges), atomic files, and which modeling code
    # `load` trusts (an exported folder's)
    assert set(json.loads(loaded)) <= {"tuner", "bounds", "setting_types", "files", "remote_code"}, loaded
    code = "import sys, scale_cl.tuner.vocab; print('scale_cl.tuner.vocab.tokenizer' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
