"""The base model's sizes and what a `ScaleConfig` adds to them (docs/design.md §1).

The one place that decides whether a config fits a model: `upscale`, parameter matching and the
experiments' settings all call `check_fits` / `resolve` with the same `Dims`, so a config that
passes here is one the model accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from scale_cl.tuner.arch import ArchSpec, spec_for_config
from scale_cl.tuner.config import ScaleConfig


@dataclass(frozen=True)
class Dims:
    """The base model's sizes that decide the expansion's shapes."""

    hidden: int
    ffn: int
    head_dim: int
    heads: int
    kv_heads: int
    layers: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def base_dims(config: Any, spec: ArchSpec | None = None) -> Dims:
    """The sizes of a (not yet upscaled) model from its HF config; ``spec`` defaults to the config's family."""
    spec = spec or spec_for_config(config)
    heads = getattr(config, spec.config_heads)
    hidden = getattr(config, spec.config_hidden)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, spec.config_kv_heads) if spec.config_kv_heads else heads
    return Dims(
        hidden=hidden,
        ffn=getattr(config, spec.config_ffn),
        head_dim=head_dim,
        heads=heads,
        kv_heads=kv_heads or heads,
        layers=config.num_hidden_layers,
    )


def check_fits(cfg: ScaleConfig, dims: Dims) -> None:
    """Raise a ValueError when ``cfg`` cannot be applied to a model of these sizes."""
    unit = dims.head_dim * dims.group
    if cfg.hidden_up % unit:
        raise ValueError(
            f"hidden_up={cfg.hidden_up} must add whole attention heads: a multiple of head_dim x GQA group "
            f"= {dims.head_dim} x {dims.group} = {unit} (valid values: {unit}, {2 * unit}, {3 * unit}, ...)"
        )
    if not -dims.layers <= cfg.preserve_layers <= dims.layers:
        raise ValueError(
            f"preserve_layers={cfg.preserve_layers} does not fit the model's {dims.layers} decoder layers: give "
            f"0..{dims.layers}, or -1..-{dims.layers} to count the collaborative layers from the top"
        )


def resolve(cfg: ScaleConfig, dims: Dims) -> ScaleConfig:
    """``cfg`` checked against ``dims``, with a negative ``preserve_layers`` (counted from the top) made concrete."""
    check_fits(cfg, dims)
    if cfg.preserve_layers < 0:
        return replace(cfg, preserve_layers=dims.layers + cfg.preserve_layers)
    return cfg


def growth(cfg: ScaleConfig, dims: Dims) -> dict[str, int]:
    """How much each growth unit of `scale_cl.tuner.arch.spec.GROWTHS` adds under ``cfg``."""
    u = cfg.hidden_up
    return {"hidden": u, "q": u, "kv": u // dims.group, "qkv": 3 * u, "ffn": cfg.ffn_up}
