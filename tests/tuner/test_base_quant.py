"""A quantized frozen base (`scale_cl.tuner.quant`, ``--options.base_quant``): Theorem 3.1 against the quantized base.

Every tiny architecture, both kinds (int8, nf4) and every SCALE method: at start the upscaled model's logits are
bitwise those of the quantized base model (its original products are the quantized modules' own; Route's to
rounding, as on a dense base: its two paths run as one stacked batch). After training
the quantized weights are bitwise as stored, the new blocks trained, Preserve's original stream is still the
quantized base's, a checkpoint reloads bitwise (the base quantized again on load), LoRA on the base is PEFT's
QLoRA, and what cannot work is refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("bitsandbytes", reason="base_quant needs bitsandbytes (pip install 'scale-cl[quant]')")

from scale_cl import ScaleConfig, load, upscale
from scale_cl.experiments.growth import GrowthSettings
from scale_cl.experiments.settings import MethodSettings
from scale_cl.methods import prepare
from scale_cl.tuner.quant import dense_weight, is_quantized, quantize_base, quantized_kind
from tests.conftest import hidden_up_for, make_model, token_batch
from tests.exactness import assert_exact_to_rounding

KINDS = ("int8", "nf4")
METHODS = ("preserve", "adapt", "route")
pytestmark = [
    pytest.mark.filterwarnings("ignore:MatMul8bitLt"),  # bitsandbytes' int8 note on fp32 inputs
    pytest.mark.exactness,
]


def quantized(name: str, kind: str, seed: int = 0):
    return quantize_base(make_model(name, seed), kind).eval()


def scale(base, method: str, **fields):
    """Random W21/W22 (a busy new stream shows any leak into the original one)."""
    cfg = ScaleConfig(
        hidden_up=hidden_up_for(base), ffn_up=32, method=method, preserve_layers=1, w21_init="random", **fields
    )
    return upscale(copy.deepcopy(base), cfg).eval()


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def dense_twin(model):
    """A copy of ``model`` whose quantized linears are dense ones of their dequantized weights: the same function
    for nf4 (bitsandbytes dequantizes W and multiplies in the compute dtype; bitwise so in fp32), not for int8
    (LLM.int8 quantizes the input too)."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if is_quantized(module):
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(dense_weight(module))
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, dense)
    return twin


def quantized_state(model) -> dict[str, torch.Tensor]:
    """Every quantized module's stored tensors (weight data, and nf4's block scales), cloned."""
    state = {}
    for name, module in model.named_modules():
        if is_quantized(module):
            state[f"{name}.weight"] = module.weight.detach().clone()
            quant_state = getattr(module.weight, "quant_state", None)
            if quant_state is not None:
                state[f"{name}.absmax"] = quant_state.absmax.clone()
    return state


def train(model, steps: int = 3) -> float:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        ids, mask = token_batch(True, seed=step, rows=3, length=9, pads=(4, 1))
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


@pytest.mark.parametrize("kind", KINDS)
def test_the_base_is_really_quantized(kind):
    dense, base = make_model("llama-gqa2-tied"), quantized("llama-gqa2-tied", kind)
    linears = [m for m in base.modules() if is_quantized(m)]
    assert len(linears) == 7 * base.config.num_hidden_layers and quantized_kind(base) == kind
    assert all(not p.requires_grad for m in linears for p in m.parameters())
    q = base.model.layers[0].self_attn.q_proj
    if kind == "int8":  # one byte per value
        assert q.weight.dtype == torch.int8 and q.weight.shape == (q.out_features, q.in_features)
    else:  # two 4-bit values per byte
        assert q.weight.dtype == torch.uint8 and q.weight.numel() * 2 == q.in_features * q.out_features
    error = (dense_weight(q) - dense.model.layers[0].self_attn.q_proj.weight).abs().max().item()
    assert 0 < error < 0.05, f"dequantized weight off by {error}"
    ids, mask = token_batch(True, seed=0, rows=3, length=9, pads=(4, 1))
    assert not torch.equal(logits(base, ids, mask), logits(dense, ids, mask))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_upscaled_model_is_the_quantized_base_exactly(arch_name, kind, method):
    base = quantized(arch_name, kind)
    model = scale(base, method)
    ids, mask = token_batch(True, seed=1, rows=3, length=9, pads=(4, 1))
    ours, theirs = logits(model, ids, mask), logits(base, ids, mask)
    what = f"{arch_name} {kind} route"
    if method == "route" and kind == "nf4":  # its two paths run as one stacked batch: other GEMM shapes, other rounding
        exact = logits(dense_twin(base).double(), ids, mask)
        assert_exact_to_rounding(ours, exact, stock=theirs, what=what)
    elif method == "route":
        # int8's product quantizes its input (through fp16): rounding that is part of the function, which so has no
        # float64 version; the reference is the quantized base's fp32 logits. Each row is quantized by its own absmax,
        # so a row's int8 product does not depend on the rows stacked with it; only the fp32 products around them
        # change shape (attention's, the head's), each rounding within a few eps of its output: 8 eps of the
        # logits' magnitude for each layer and the head. (Measured: bitwise on an Intel Xeon under every kernel
        # setting of scripts/test_kernels.sh; nf4's dequantized products, which do change shape, < 1 eps.)
        ulps = 8.0 * (base.config.num_hidden_layers + 1)
        assert_exact_to_rounding(ours, theirs.double(), stock=None, ulps=ulps, what=what)
    else:
        assert torch.equal(ours, theirs), f"{arch_name} {kind} {method}"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_training_leaves_the_quantized_weights_as_stored(kind, method):
    base = quantized("llama-biases", kind)
    model = scale(base, method)
    before = quantized_state(model)
    assert len(before) == (2 if kind == "nf4" else 1) * 7 * base.config.num_hidden_layers
    train(model)
    after = quantized_state(model)
    assert all(torch.equal(after[n], before[n]) for n in before), "a quantized weight changed"
    w12 = model.model.layers[2].self_attn.q_proj.w12
    assert (w12 is not None and w12.abs().max() > 0) == (method != "preserve"), "W12 trains exactly where it is used"
    assert model.model.layers[0].self_attn.q_proj.w21.grad is None  # zeroed by the optimizer: trained
    if method == "preserve":  # the original stream is the quantized base's after training too
        ids, mask = token_batch(True, seed=2, rows=3, length=9, pads=(4, 1))
        with torch.no_grad():
            ours = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            theirs = base(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        d = base.config.hidden_size
        assert torch.equal(ours[..., :d], theirs)  # the quantized modules' own products on the same values: bitwise


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_reloads_bitwise_on_the_base_quantized_again(kind, tmp_path):
    make_model("qwen2-qkv-bias").save_pretrained(tmp_path / "base")
    dense = type(make_model("qwen2-qkv-bias")).from_pretrained(tmp_path / "base").eval()
    model = scale(quantize_base(dense, kind), "route")
    train(model, steps=2)
    model.save_pretrained(tmp_path / "ckpt")
    reloaded = load(tmp_path / "ckpt").eval()  # names the base folder; quantizes it as recorded
    assert quantized_kind(reloaded) == kind
    ids, mask = token_batch(True, seed=3, rows=3, length=9, pads=(4, 1))
    assert torch.equal(logits(reloaded, ids, mask), logits(model, ids, mask))
    with pytest.raises(ValueError, match="quantized"):
        model.save_pretrained(tmp_path / "full", full=True)
    assert not (tmp_path / "full").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_lora_on_the_quantized_base_is_peft_qlora(kind):
    model = prepare(make_model("llama-gqa2-tied"), "lora", rank=4, base_quant=kind)
    q = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert type(q).__module__ == "peft.tuners.lora.bnb" and is_quantized(q.base_layer)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    match = ScaleConfig(hidden_up=32, ffn_up=32, method="route", preserve_layers=1)
    matched = prepare(make_model("llama-gqa2-tied"), "lora", rank="match", match=match, base_quant=kind)
    dense = prepare(make_model("llama-gqa2-tied"), "lora", rank="match", match=match)
    assert matched.peft_config["default"].r == dense.peft_config["default"].r  # shapes, not packed weights


def test_what_cannot_work_is_refused():
    for method in ("fft", "freeze", "llama_pro"):
        with pytest.raises(ValueError, match=f"{method} trains them"):
            prepare(make_model("llama-mqa"), method, base_quant="nf4")
    with pytest.raises(ValueError, match="unknown base_quant"):
        MethodSettings(base_quant="int4")
    with pytest.raises(ValueError, match="fft trains them"):
        MethodSettings(base_quant="int8").validate(make_model("llama-mqa").config, ["scale_route", "fft"])
    with pytest.raises(ValueError, match="cannot grow on a quantized base"):
        GrowthSettings(growth="per_task").check_methods(["fft", "lora"], "nf4")
    GrowthSettings(growth="once").check_methods(["lora", "scale_route"], "nf4")  # grow once: fine
    base = quantized("llama-mqa", "nf4")
    with pytest.raises(ValueError, match="quantized already"):
        quantize_base(base, "int8")
    model = scale(base, "adapt")
    with pytest.raises(ValueError, match="quantize the base model before upscaling"):
        quantize_base(model, "nf4")
    with pytest.raises(ValueError, match="quantized base again"):
        upscale(model, ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=32, method="adapt"))
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "ScaleLinear", "nothing changed"
    with pytest.raises(ValueError, match="no dense block matrix"):
        model.model.layers[1].self_attn.q_proj.merged_weight()
