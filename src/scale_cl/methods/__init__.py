"""The seven methods of the paper's comparison behind one registry, and `prepare(model, method, **options)`.

::

    from scale_cl.methods import prepare
    model = prepare(model, "scale_route", hidden_up=256, ffn_up=1024, preserve_layers=3)
    model = prepare(model, "lora", rank="match", match=ScaleConfig(hidden_up=256, ffn_up=1024))

`REGISTRY` is the one list of methods every experiment, the sweep and the bench read; a method's module is imported
only when it is prepared. Each method's options: docs/design.md §0.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from scale_cl.methods.matching import (
    llama_pro_trainable_count,
    lora_trainable_count,
    match_llama_pro_blocks,
    match_lora_rank,
    scale_trainable_count,
    trainable_parameter_count,
)
from scale_cl.tuner.config import METHODS as SCALE_CONFIG_METHODS
from scale_cl.tuner.quant import BASE_QUANTS, check_base_quant, quantize_base
from scale_cl.tuner.routing import route_settings


@dataclass(frozen=True)
class MethodSpec:
    """One method: its name, where its functions live, and the traits its callers ask instead of its name.

    Attributes:
        name: the method's name (``--methods``, configs, results, output folders).
        title: its name in prose, tables and figures (``SCALE-Route``); a SCALE method's ``ScaleConfig.method``
            is ``scale_method`` (``route``): the three spellings, mapped here alone (docs/design.md §0).
        prepare: ``"module:function"`` of its prepare function, imported on first use.
        describe: ``"module:function"`` of its one-line description of a prepared model (the bench's rows).
        scale_method: ``ScaleConfig.method`` of a SCALE method, None for a baseline.
        trains_everything: every weight of the model trains (full fine-tuning): every product takes its input's
            and its weight's gradient, which is its FLOP floor (`scale_cl.bench.floor`).
        quantizable_base: the base's linears can be stored quantized and frozen (`--options.base_quant`).
        wise_ft: the trained model has the base's architecture and nothing added, so WiSE-FT reads it along the
            line between the base's weights and its own.
        grows_again: with ``growth per_task`` it adds to itself before every later task (a SCALE stage, a LoRA
            adapter); a method that adds width but cannot grow again is refused there.
        base_logits_exact: one forward pass of the trained model also yields the base model's logits exactly
            (SCALE-Preserve's Z; SCALE-Route's preserve path).
        two_paths: it trains two paths through the same weights and routes each token along one (SCALE-Route's
            preserve and adapt paths): its readings are the router's, and its base logits are exact only while
            the two paths are stacked (route mode). Not `ScaleConfig.routed`, which says whether a router makes a
            model's logits (SCALE-Preserve's too, with a one-path router).
        adapter: it is saved, loaded and grown as a PEFT adapter over the base (LoRA).
        match_option: the option of its prepare function whose value ``"match"`` sizes it to SCALE-Route's
            trainable count (with ``match=`` the ScaleConfig to match).
        reads: the experiments' method settings it reads (`scale_cl.experiments.settings.MethodSettings`
            fields, dotted below ``options``): a sweep axis over another does not re-run it, only these are checked
            against the model for it, and the model card states the ``scale.*`` ones.
        prepare_settings: (option of its prepare function, the method setting that gives it) pairs, beside
            ``base_quant`` (a SCALE method takes the whole ``scale``).
    """

    name: str
    title: str
    prepare: str
    describe: str
    scale_method: str | None = None
    trains_everything: bool = False
    quantizable_base: bool = False
    wise_ft: bool = False
    grows_again: bool = False
    base_logits_exact: bool = False
    two_paths: bool = False
    adapter: bool = False
    match_option: str | None = None
    reads: tuple[str, ...] = ()
    prepare_settings: tuple[tuple[str, str], ...] = ()

    @property
    def is_scale(self) -> bool:
        return self.scale_method is not None

    def prepare_function(self) -> Callable[..., nn.Module]:
        return _function(self.prepare)

    def describe_function(self) -> Callable[..., str]:
        return _function(self.describe)


def _function(path: str) -> Callable[..., Any]:
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


# The method settings every method reads (base_quant: refused by the methods that train the original weights), then
# what SCALE-Preserve reads and what SCALE-Adapt reads beside them; SCALE-Route reads the route settings too.
_EVERY_METHOD_SETTINGS = ("base_quant", "distill_weight", "distill_temperature", "distill_new_tokens")
_PRESERVE_SETTINGS = (
    "scale.hidden_up",
    "scale.ffn_up",
    "scale.w21_init",
    "scale.w22_init",
    "scale.embed_up_init",
    "scale.up_norm",
    "scale.up_logit_scale",
)
_ADAPT_SETTINGS = (
    "scale.preserve_layers",
    "scale.collab_modules",
    "w12_lr_ratio",
    "auto_layers",
    "auto_layers_budget",
    "auto_layers_steps",
)
_SCALE_SETTINGS = {
    "preserve": (*_EVERY_METHOD_SETTINGS, *_PRESERVE_SETTINGS),
    "adapt": (*_EVERY_METHOD_SETTINGS, *_PRESERVE_SETTINGS, *_ADAPT_SETTINGS),
    "route": (
        *_EVERY_METHOD_SETTINGS,
        *_PRESERVE_SETTINGS,
        *_ADAPT_SETTINGS,
        *(f"scale.{name}" for name in route_settings()),  # the routers' own declarations (scale_cl.tuner.routing)
        "route_share",
        "route_calibrate_every",
        "route_calibration_sequences",
    ),
}


def _scale_spec(variant: str) -> MethodSpec:
    return MethodSpec(
        f"scale_{variant}",
        f"SCALE-{variant.capitalize()}",
        "scale_cl.methods.scale:prepare_scale",
        "scale_cl.methods.scale:describe_scale",
        scale_method=variant,
        quantizable_base=True,
        grows_again=variant != "route",  # two paths of the same weights: no frozen base computes them
        base_logits_exact=variant in ("preserve", "route"),
        two_paths=variant == "route",
        reads=_SCALE_SETTINGS[variant],
    )


REGISTRY: dict[str, MethodSpec] = {
    "fft": MethodSpec(
        "fft",
        "FFT",
        "scale_cl.methods.fft:prepare_fft",
        "scale_cl.methods.fft:describe_fft",
        trains_everything=True,
        wise_ft=True,
        reads=_EVERY_METHOD_SETTINGS,
    ),
    "lora": MethodSpec(
        "lora",
        "LoRA",
        "scale_cl.methods.lora:prepare_lora",
        "scale_cl.methods.lora:describe_lora",
        quantizable_base=True,
        grows_again=True,
        adapter=True,
        match_option="rank",
        reads=(*_EVERY_METHOD_SETTINGS, "lora_rank"),
        prepare_settings=(("rank", "lora_rank"),),
    ),
    "freeze": MethodSpec(
        "freeze",
        "Freeze",
        "scale_cl.methods.freeze:prepare_freeze",
        "scale_cl.methods.freeze:describe_freeze",
        wise_ft=True,
        reads=(*_EVERY_METHOD_SETTINGS, "freeze_layers"),
        prepare_settings=(("layers", "freeze_layers"),),
    ),
    "llama_pro": MethodSpec(
        "llama_pro",
        "LLaMA Pro",
        "scale_cl.methods.llama_pro:prepare_llama_pro",
        "scale_cl.methods.llama_pro:describe_llama_pro",
        match_option="blocks",
        reads=(*_EVERY_METHOD_SETTINGS, "llama_pro_blocks"),
        prepare_settings=(("blocks", "llama_pro_blocks"),),
    ),
    **{f"scale_{variant}": _scale_spec(variant) for variant in SCALE_CONFIG_METHODS},
}
METHOD_NAMES = tuple(REGISTRY)
SCALE_METHOD_NAMES = tuple(name for name, spec in REGISTRY.items() if spec.is_scale)
QUANTIZABLE_METHODS = tuple(name for name, spec in REGISTRY.items() if spec.quantizable_base)


def method_spec(method: str) -> MethodSpec:
    """The registry entry of ``method``, or a ValueError naming the valid methods."""
    if method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHOD_NAMES)}")
    return REGISTRY[method]


def scale_spec(scale_method: str) -> MethodSpec:
    """The SCALE method whose `ScaleConfig.method` is ``scale_method`` (an upscaled model's record), or a ValueError."""
    for spec in REGISTRY.values():
        if spec.scale_method == scale_method:
            return spec
    raise ValueError(f"unknown SCALE method {scale_method!r}; valid: {', '.join(SCALE_CONFIG_METHODS)}")


def check_methods(methods: list[str]) -> None:
    """Raise a ValueError unless ``methods`` is a non-empty list of known method names."""
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown or not methods:
        raise ValueError(f"unknown methods {unknown}; valid methods: {', '.join(METHOD_NAMES)}")


def check_quantizable(method: str, base_quant: str) -> None:
    """Raise a ValueError for an unknown ``base_quant``, or one that ``method`` cannot train on (it trains the
    weights a quantized base keeps frozen), or a missing bitsandbytes."""
    if base_quant in BASE_QUANTS and base_quant != "none" and not method_spec(method).quantizable_base:
        raise ValueError(
            f"base_quant {base_quant!r} keeps the original weights frozen in {base_quant}, but {method} trains them: "
            f"use it with {', '.join(QUANTIZABLE_METHODS)} (or base_quant 'none')"
        )
    check_base_quant(base_quant)


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
    and frozen first (`scale_cl.tuner.quant`); LoRA on it is QLoRA.
    """
    spec = method_spec(method)
    base_quant = options.pop("base_quant", "none")
    check_quantizable(method, base_quant)
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
    "QUANTIZABLE_METHODS",
    "REGISTRY",
    "SCALE_METHOD_NAMES",
    "MethodSpec",
    "check_methods",
    "check_quantizable",
    "llama_pro_trainable_count",
    "lora_trainable_count",
    "match_llama_pro_blocks",
    "match_lora_rank",
    "method_options",
    "method_spec",
    "prepare",
    "scale_spec",
    "scale_trainable_count",
    "trainable_parameter_count",
]
