"""SCALE-Preserve / -Adapt / -Route: width upscaling with `scale_cl.tuner.upscale` (the paper's methods)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from torch import nn

from scale_cl.methods import SCALE_METHOD_NAMES, method_spec
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.upscale import upscale
from scale_cl.tuner.vocab import split_vocab

# the ScaleConfig fields accepted as options (the method comes from the method name)
SCALE_FIELDS = tuple(f.name for f in fields(ScaleConfig) if f.name != "method")
SCALE_OPTIONS = ("scale", *SCALE_FIELDS)


def prepare_scale(model: nn.Module, method: str, **options: Any) -> nn.Module:
    """Width-upscale ``model`` with SCALE and the method of ``method`` (``"scale_preserve"``, ...).

    Why: SCALE adds width inside every linear while freezing all pre-trained weights; preserve keeps
    the base function exactly, adapt lets the new width feed the base stream (W12) in upper layers,
    route picks per token between both (Section 4).

    Options: ``scale=ScaleConfig(...)`` (its ``method`` is replaced by the method name), and/or
    ScaleConfig fields as keywords (``hidden_up=..., ffn_up=..., preserve_layers=...``), which
    override the fields of ``scale`` when both are given. Without ``scale``, ``hidden_up`` and
    ``ffn_up`` are required (as in ScaleConfig: no silent default width). An extended vocabulary's new
    rows (`scale_cl.tuner.vocab`) train beside SCALE's new parameters; its original rows stay frozen.
    """
    spec = method_spec(method)
    if not spec.is_scale:
        raise ValueError(f"not a SCALE method: {method!r}; one of {SCALE_METHOD_NAMES}")
    if "method" in options:
        raise ValueError(f"{method}: the SCALE method comes from the method name, do not pass method=")
    unknown = sorted(set(options) - set(SCALE_OPTIONS))
    if unknown:
        raise ValueError(f"{method}: unknown options {unknown}; it accepts {list(SCALE_OPTIONS)}")
    scale = options.pop("scale", None)
    if scale is None:
        missing = [name for name in ("hidden_up", "ffn_up") if name not in options]
        if missing:
            raise ValueError(
                f"{method}: give scale=ScaleConfig(...) or the ScaleConfig fields as options; missing {missing}"
            )
        cfg = ScaleConfig(method=spec.scale_method, **options)
    elif isinstance(scale, ScaleConfig):
        cfg = replace(scale, method=spec.scale_method, **options)
    else:
        raise ValueError(f"{method}: scale must be a ScaleConfig, got {type(scale).__name__}")
    return upscale(split_vocab(model), cfg)


def describe_scale(model: nn.Module, options: dict) -> str:
    """The bench's one-line description of the prepared model (``options["scale"]``: its ScaleConfig)."""
    sc: ScaleConfig = options["scale"]
    if sc.method == "preserve":
        return f"+{sc.hidden_up} hidden, +{sc.ffn_up} FFN, W12 never computed"
    collaborative = model.config.num_hidden_layers - sc.preserve_layers
    return f"+{sc.hidden_up} hidden, +{sc.ffn_up} FFN, top {collaborative} collaborative"
