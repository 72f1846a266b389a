"""A quantized frozen base (``--options.base_quant``): the original linears stored in 8 or 4 bits, frozen.

What QLoRA does for LoRA: the pre-trained ``W`` of every attention and FFN linear is kept by bitsandbytes in
8 bits (``int8``: LLM.int8 row-wise absmax) or 4 bits (``nf4``: NormalFloat-4 in blocks of 64, the QLoRA data
type), and only what a method adds trains, in full precision. bitsandbytes because it stores 4-bit weights packed
on the CPU as on a GPU (torchao's packed int4 needs CUDA kernels; its CPU int4 keeps one byte per value), and it is
the library PEFT's QLoRA runs on, so LoRA on the same quantized base is QLoRA itself. The embedding, the norms and
the LM head stay as they are (as in QLoRA).

The preservation promise is restated against the quantized base: an upscaled model whose base was quantized
computes the *quantized* base model's function exactly until W12 or the head's new columns change (its original
products are the quantized modules' own, on the same inputs; Theorem 3.1 with ``W`` the dequantized weight).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from scale_cl.tuner.arch import spec_for
from scale_cl.tuner.layers import is_quantized

BASE_QUANTS = ("none", "int8", "nf4")  # `--options.base_quant`
# bitsandbytes warns at import, on an AVX512-bf16 CPU, that it cannot fetch a CPU kernel from the Hub (the
# `kernels` package): the kernel serves the repacked CPU layout, which `_quantized_linear` switches off. Quiet.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def check_base_quant(kind: str) -> None:
    """Raise a ValueError for an unknown kind or a missing library (which methods can take a quantized base:
    `scale_cl.methods.check_quantizable`)."""
    if kind not in BASE_QUANTS:
        raise ValueError(f"unknown base_quant {kind!r}; valid: {', '.join(BASE_QUANTS)}")
    if kind == "none":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"base_quant {kind!r} needs bitsandbytes: pip install bitsandbytes (or pip install -e '.[quant]' in "
            "scale-cl's checkout)"
        )


def quantized_kind(model: nn.Module) -> str:
    """The base_quant kind of ``model``'s linears ("none" when none is quantized)."""
    for module in model.modules():
        if is_quantized(module):
            return "nf4" if type(module).__name__ == "Linear4bit" else "int8"
    return "none"


def _quantized_linear(linear: nn.Linear, kind: str) -> nn.Linear:
    import bitsandbytes as bnb

    dtype, device = linear.weight.dtype, linear.weight.device
    bias = linear.bias is not None
    if kind == "nf4":
        module = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=bias, compute_dtype=dtype, quant_type="nf4", device="meta"
        )
        module.weight = bnb.nn.Params4bit(linear.weight.detach().clone(), requires_grad=False, quant_type="nf4")
        # Off: on an AVX512-bf16 CPU bitsandbytes repacks the stored weight in place at the first inference call
        # (for its CPU kernel; output rows a multiple of its block only), so inference and training would multiply
        # by differently laid out weights, and the frozen tensor would not stay as stored.
        module.support_avx512bf16_for_cpu = False
    else:
        module = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False, threshold=0.0, device="meta"
        )
        module.weight = bnb.nn.Int8Params(linear.weight.detach().clone(), requires_grad=False, has_fp16_weights=False)
    if bias:
        module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    module.dense_dtype = dtype  # what it computes in, and what `dense_weight` gives back
    # the linear's mode: bitsandbytes' int8 product differs between training and evaluation
    return module.to(device).train(linear.training)  # bitsandbytes quantizes on the move to a device


def quantize_base(model: nn.Module, kind: str) -> nn.Module:
    """Store every attention and FFN linear of ``model`` (a base model, not yet prepared) quantized and frozen, in
    place; returns it. ``kind``: one of `BASE_QUANTS` ("none" returns ``model`` unchanged)."""
    check_base_quant(kind)
    if kind == "none":
        return model
    if getattr(model, "is_scale_upscaled", False):
        raise ValueError("quantize the base model before upscaling it (its original linears are inside SCALE's)")
    if quantized_kind(model) != "none":
        raise ValueError(f"the model's linears are quantized already ({quantized_kind(model)}): load it unquantized")
    spec = spec_for(model)
    for layer in getattr(model, spec.backbone).layers:
        for lin in spec.linears:
            parent, _, name = lin.path.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            setattr(owner, name, _quantized_linear(getattr(owner, name), kind))
    # what transformers sets on a model it loads in 8 or 4 bits: PEFT then wraps these linears in its bitsandbytes
    # LoRA layers (QLoRA's, which also merge correctly), not its dense ones
    model.is_loaded_in_8bit, model.is_loaded_in_4bit = kind == "int8", kind == "nf4"
    return model


def dense_weight(module: nn.Linear) -> torch.Tensor:
    """The weight ``module`` multiplies by, dense (a quantized one dequantized): what initialisers read."""
    if not is_quantized(module):
        return module.weight
    import bitsandbytes.functional as bnbf

    weight, dtype = module.weight, getattr(module, "dense_dtype", torch.float32)
    if type(module).__name__ == "Linear4bit":
        return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    scale = weight.SCB if weight.SCB is not None else module.state.SCB  # moved to its state at the first call
    return (weight.data.float() * scale.float()[:, None] / 127).to(dtype)  # LLM.int8's row-wise absmax


__all__ = [
    "BASE_QUANTS",
    "check_base_quant",
    "dense_weight",
    "is_quantized",
    "quantize_base",
    "quantized_kind",
]
