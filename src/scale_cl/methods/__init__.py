"""The seven methods of the paper's comparison behind one registry, and `prepare(model, method, **options)`.

One module per method, each a function that modifies the model in place (or wraps it, LoRA) and
sets ``requires_grad`` to exactly what the method trains::

    from scale_cl.methods import prepare
    model = prepare(model, "scale_route", hidden_up=256, ffn_up=1024, preserve_layers=3)
    model = prepare(model, "lora", rank="match", match=ScaleConfig(hidden_up=256, ffn_up=1024))
    model = prepare(model, "llama_pro", blocks=4)

=================  ==========================================================================
``fft``            everything trains (no options)
``lora``           PEFT LoRA: ``rank`` (int or "match"), ``alpha``, ``dropout``, ``target_modules``, ``match``
``freeze``         embedding + bottom ``layers`` decoder layers frozen, the rest trains
``llama_pro``      ``blocks`` identity-initialised block copies (int, "match"), ``match``; only they train
``scale_*``        `scale_cl.upscale` with preserve / adapt / route: ``scale`` or ScaleConfig fields
=================  ==========================================================================

`REGISTRY` is the one list of methods every experiment, the sweep and the bench read. A method's
module is imported only when the method is prepared, so importing this package pulls in no
baseline (PEFT included).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from scale_cl.config import METHODS as SCALE_CONFIG_METHODS
from scale_cl.methods.matching import (
    llama_pro_trainable_count,
    lora_trainable_count,
    match_llama_pro_blocks,
    match_lora_rank,
    scale_trainable_count,
    trainable_parameter_count,
)
from scale_cl.quant import check_base_quant, quantize_base


@dataclass(frozen=True)
class MethodSpec:
    """One method: its name and where its prepare function lives.

    Attributes:
        name: the method's name (``--methods``, results, output folders).
        prepare: ``"module:function"`` of its prepare function, imported on first use.
        scale_method: ``ScaleConfig.method`` of a SCALE method, None for a baseline.
        trains_everything: every weight of the model trains (full fine-tuning): every product takes its input's
            and its weight's gradient, which is its FLOP floor (`scale_cl.bench.floor`).
    """

    name: str
    prepare: str
    scale_method: str | None = None
    trains_everything: bool = False

    @property
    def is_scale(self) -> bool:
        return self.scale_method is not None

    def prepare_function(self) -> Callable[..., nn.Module]:
        module, _, function = self.prepare.partition(":")
        return getattr(importlib.import_module(module), function)


REGISTRY: dict[str, MethodSpec] = {
    "fft": MethodSpec("fft", "scale_cl.methods.fft:prepare_fft", trains_everything=True),
    "lora": MethodSpec("lora", "scale_cl.methods.lora:prepare_lora"),
    "freeze": MethodSpec("freeze", "scale_cl.methods.freeze:prepare_freeze"),
    "llama_pro": MethodSpec("llama_pro", "scale_cl.methods.llama_pro:prepare_llama_pro"),
    **{
        f"scale_{variant}": MethodSpec(f"scale_{variant}", "scale_cl.methods.scale:prepare_scale", variant)
        for variant in SCALE_CONFIG_METHODS
    },
}
METHOD_NAMES = tuple(REGISTRY)
SCALE_METHOD_NAMES = tuple(name for name, spec in REGISTRY.items() if spec.is_scale)


def method_spec(method: str) -> MethodSpec:
    """The registry entry of ``method``, or a ValueError naming the valid methods."""
    if method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHOD_NAMES)}")
    return REGISTRY[method]


def check_methods(methods: list[str]) -> None:
    """Raise a ValueError unless ``methods`` is a non-empty list of known method names."""
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown or not methods:
        raise ValueError(f"unknown methods {unknown}; valid methods: {', '.join(METHOD_NAMES)}")


def method_options(method: str) -> tuple[str, ...]:
    """The option names ``method`` accepts."""
    spec = method_spec(method)
    if spec.is_scale:
        from scale_cl.methods.scale import SCALE_OPTIONS

        return SCALE_OPTIONS
    params = inspect.signature(spec.prepare_function()).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def prepare(model: nn.Module, method: str, /, **options: Any) -> nn.Module:
    """Prepare ``model`` for training with ``method`` (one of `METHOD_NAMES`) and return it.

    Modifies ``model`` in place; LoRA returns the PEFT wrapper around it. Unknown methods or
    options, and invalid option values, raise a ValueError that names what is accepted.

    ``base_quant`` ("none", "int8", "nf4"; LoRA and the SCALE methods): store the base model's linears quantized
    and frozen first (`scale_cl.quant`); LoRA on it is QLoRA.
    """
    spec = method_spec(method)
    base_quant = options.pop("base_quant", "none")
    check_base_quant(base_quant, method)
    accepted = method_options(method)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"it accepts {list(accepted)}" if accepted else "it takes no options"
        raise ValueError(f"{method}: unknown options {unknown}; {takes}")
    model = quantize_base(model, base_quant)
    if spec.is_scale:
        return spec.prepare_function()(model, method, **options)
    return spec.prepare_function()(model, **options)


__all__ = [
    "METHOD_NAMES",
    "REGISTRY",
    "SCALE_METHOD_NAMES",
    "MethodSpec",
    "check_methods",
    "llama_pro_trainable_count",
    "lora_trainable_count",
    "match_llama_pro_blocks",
    "match_lora_rank",
    "method_options",
    "method_spec",
    "prepare",
    "scale_trainable_count",
    "trainable_parameter_count",
]
