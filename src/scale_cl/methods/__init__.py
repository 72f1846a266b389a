"""One entry point for every training method of the paper's comparison: `prepare(model, method, **options)`.

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
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from scale_cl.methods.fft import prepare_fft
from scale_cl.methods.freeze import prepare_freeze
from scale_cl.methods.llama_pro import prepare_llama_pro
from scale_cl.methods.lora import prepare_lora
from scale_cl.methods.matching import (
    llama_pro_trainable_count,
    lora_trainable_count,
    match_llama_pro_blocks,
    match_lora_rank,
    scale_trainable_count,
    trainable_parameter_count,
)
from scale_cl.methods.scale import SCALE_METHODS, SCALE_OPTIONS, prepare_scale

METHOD_NAMES = ("fft", "lora", "freeze", "llama_pro", "scale_preserve", "scale_adapt", "scale_route")

_PREPARE: dict[str, Callable[..., nn.Module]] = {
    "fft": prepare_fft,
    "lora": prepare_lora,
    "freeze": prepare_freeze,
    "llama_pro": prepare_llama_pro,
    **{name: partial(prepare_scale, method=name) for name in SCALE_METHODS},
}


def method_options(method: str) -> tuple[str, ...]:
    """The option names ``method`` accepts."""
    _check_method(method)
    if method in SCALE_METHODS:
        return SCALE_OPTIONS
    params = inspect.signature(_PREPARE[method]).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def prepare(model: nn.Module, method: str, /, **options: Any) -> nn.Module:
    """Prepare ``model`` for training with ``method`` (one of `METHOD_NAMES`) and return it.

    Modifies ``model`` in place; LoRA returns the PEFT wrapper around it. Unknown methods or
    options, and invalid option values, raise a ValueError that names what is accepted.
    """
    accepted = method_options(method)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"it accepts {list(accepted)}" if accepted else "it takes no options"
        raise ValueError(f"{method}: unknown options {unknown}; {takes}")
    return _PREPARE[method](model, **options)


def _check_method(method: str) -> None:
    if method not in METHOD_NAMES:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHOD_NAMES)}")


__all__ = [
    "METHOD_NAMES",
    "llama_pro_trainable_count",
    "lora_trainable_count",
    "match_llama_pro_blocks",
    "match_lora_rank",
    "method_options",
    "prepare",
    "scale_trainable_count",
    "trainable_parameter_count",
]
