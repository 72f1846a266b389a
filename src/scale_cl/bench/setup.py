"""Each method's options for a shape, and building a method's model from the shared random base.

The SCALE widths come from the shape; scale_adapt has its top ``adapt_top`` layers collaborative
and scale_route its top ``route_top`` (the issue's targets: top 3 and top 1). LoRA's rank and
LLaMA Pro's blocks are matched ('match') to the trainable parameters of one SCALE config
(``BenchConfig.match``, SCALE-Route's by default, the project's convention in `MethodSettings`).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from scale_cl.bench.config import BenchConfig, split_method
from scale_cl.bench.shapes import Shape
from scale_cl.experiments.settings import MethodSettings
from scale_cl.methods import method_spec, prepare
from scale_cl.tuner.config import ScaleConfig


def scale_configs(shape: Shape, cfg: BenchConfig) -> dict[str, ScaleConfig]:
    """The ScaleConfig of scale_preserve / scale_adapt / scale_route for ``shape``."""
    layers = shape.layers
    for name in ("adapt_top", "route_top"):
        if getattr(cfg, name) > layers:
            raise ValueError(f"{name}={getattr(cfg, name)} exceeds the {layers} layers of shape {shape.name}")
    base = ScaleConfig(
        hidden_up=shape.hidden_up, ffn_up=shape.ffn_up, w21_init=cfg.w21_init, w22_init=cfg.w22_init, seed=cfg.seed
    )
    return {
        # preserve never computes W12, so its L_fp changes nothing; it shares adapt's for the record
        "preserve": replace(base, method="preserve", preserve_layers=layers - cfg.adapt_top),
        "adapt": replace(base, method="adapt", preserve_layers=layers - cfg.adapt_top),
        "route": replace(base, method="route", preserve_layers=layers - cfg.route_top),
    }


def method_options(shape: Shape, cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    """``{row: options of scale_cl.prepare}`` for every row of ``cfg.methods`` (a method, or METHOD+KIND on a
    quantized base)."""
    scale = scale_configs(shape, cfg)
    settings = MethodSettings(scale=scale["route"], freeze_layers=shape.freeze_layers)
    options: dict[str, dict[str, Any]] = {}
    for name in cfg.methods:
        method, kind = split_method(name)
        spec = method_spec(method)
        quant = {"base_quant": kind} if kind != "none" else {}
        if spec.is_scale:
            options[name] = {"scale": scale[spec.scale_method], **quant}
            continue
        opts = settings.prepare_options(method, cfg.seed)
        if "match" in opts:
            opts["match"] = scale[cfg.match]
        options[name] = {**opts, **quant}
    return options


def describe(name: str, model: nn.Module, options: dict[str, Any], cfg: BenchConfig) -> str:
    """A short human-readable statement of the row's settings, as built."""
    method, kind = split_method(name)
    setting = method_spec(method).describe_function()(model, options)
    if "match" in options:
        setting += f" (matched to scale_{cfg.match})"
    return setting if kind == "none" else f"{setting}; base linears {kind} (bitsandbytes), frozen"


def build_method(
    base: nn.Module,
    method: str,
    options: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    copy_base: bool = True,
) -> nn.Module:
    """``base`` (a copy of it unless ``copy_base`` is false) on ``device``/``dtype``, prepared for ``method`` (a
    bench row: METHOD+KIND quantizes the base first, through ``options``).

    The model is moved before `prepare`, so SCALE's upscale (and its SVD) runs on the device too.
    """
    model = (copy.deepcopy(base) if copy_base else base).to(device=device, dtype=dtype)
    return prepare(model, split_method(method)[0], **options)


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())
