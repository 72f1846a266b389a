"""Model surgery: widen a transformers causal LM in place (DESIGN.md §1), and switch its method.

`upscale` swaps every attention/FFN linear for a `ScaleLinear`, every FFN for a `ScaleMLP` (its
activation applied per part), every norm for a `SplitNorm`, the embedding and LM head for their
widened versions, rewrites the model's config so it states
the widened sizes, records what it did under ``config.scale_cl``, and gives the model a class
that adds `set_method`, `save_pretrained` (only the new weights) and a parameter summary.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from scale_cl.arch import ArchSpec, spec_for
from scale_cl.config import ScaleConfig, check_method
from scale_cl.init import expansion_blocks, top_singular_all
from scale_cl.layers import (
    W12_ALL,
    W12_OFF,
    W12_SECOND_HALF,
    ScaleEmbedding,
    ScaleHead,
    ScaleLinear,
    ScaleMLP,
    SplitNorm,
)
from scale_cl.route import stack_paths_hook

ROUTE_SHARE_KEY = "route_preserve_share"


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


def base_dims(config: Any, spec: ArchSpec) -> Dims:
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
    if cfg.preserve_layers > dims.layers:
        raise ValueError(f"preserve_layers={cfg.preserve_layers} exceeds the model's {dims.layers} decoder layers")


def growth(cfg: ScaleConfig, dims: Dims) -> dict[str, int]:
    """How much each growth unit of `scale_cl.arch.spec.GROWTHS` adds under ``cfg``."""
    u = cfg.hidden_up
    return {"hidden": u, "q": u, "kv": u // dims.group, "qkv": 3 * u, "ffn": cfg.ffn_up}


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return getattr(model, model.config.scale_cl["arch"]).layers


def weight_fingerprint(model: nn.Module) -> str:
    """A cheap hash of a strided sample of the base weights, to tell one base checkpoint from another."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("weight", "bias"):
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            digest.update(name.encode())
            digest.update(flat[::step].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _base_record(model: PreTrainedModel, dims: Dims) -> dict[str, Any]:
    config = model.config
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    return {
        "name_or_path": getattr(config, "_name_or_path", "") or "",
        "gguf_file": quant.get("gguf_file") if quant.get("quant_method") == "gguf" else None,
        "class": type(model).__name__,
        "config": config.to_dict(),
        "dims": asdict(dims),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "fingerprint": weight_fingerprint(model),
    }


def upscale(model: PreTrainedModel, config: ScaleConfig) -> PreTrainedModel:
    """Width-upscale ``model`` in place with ``config`` and return it.

    The returned model computes exactly the base model's logits until W12 or the LM head's new
    columns change (Theorem 3.1). Every original parameter is frozen; which new ones train is
    decided by ``config.method`` (see `set_method`). Randomness is seeded by ``config.seed``.
    """
    if not isinstance(config, ScaleConfig):
        raise TypeError(f"config must be a ScaleConfig, got {type(config).__name__}")
    spec = spec_for(model)
    dims = base_dims(model.config, spec)
    check_fits(config, dims)
    base = _base_record(model, dims)
    grow = growth(config, dims)
    u = config.hidden_up

    backbone = getattr(model, spec.backbone)
    param = next(model.parameters())
    devices = [param.device] if param.device.type != "cpu" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=param.device.type):
        torch.manual_seed(config.seed)
        embedding = model.get_input_embeddings()
        std = embedding.weight.detach().float().std().item()
        model.set_input_embeddings(
            ScaleEmbedding(embedding, torch.randn(embedding.num_embeddings, u, device=param.device) * std)
        )
        head = model.get_output_embeddings()
        model.set_output_embeddings(ScaleHead(head, u))
        eps = getattr(model.config, spec.config_norm_eps)
        _set(backbone, spec.final_norm, SplitNorm(backbone.get_submodule(spec.final_norm), spec.norm_kind, u, eps))
        singular = itertools.repeat(None)
        if "svd" in (config.w21_init, config.w22_init):  # the slow part: computed in parallel on a CPU, in order
            work = [
                (layer.get_submodule(lin.path).weight, grow[lin.grow_out])
                for layer in backbone.layers
                for lin in spec.linears
            ]
            singular = top_singular_all(work, [config.seed * 1_000_003 + position for position in range(len(work))])
        for index, layer in enumerate(backbone.layers):
            for path in spec.layer_norms:
                _set(layer, path, SplitNorm(layer.get_submodule(path), spec.norm_kind, u, eps))
            for lin in spec.linears:
                old = layer.get_submodule(lin.path)
                in_up, out_up = grow[lin.grow_in], grow[lin.grow_out]
                blocks = (old.weight, out_up, in_up, config.w21_init, config.w22_init, next(singular))
                w21, w22 = expansion_blocks(*blocks)
                collaborative = index >= config.preserve_layers and lin.module in config.collab_modules
                _set(layer, lin.path, ScaleLinear(old, in_up, out_up, w21, w22, collaborative, lin.module))
            mlp = spec.mlp
            _set(layer, mlp.path, ScaleMLP(layer.get_submodule(mlp.path), mlp.gate, mlp.up, mlp.down, mlp.act))
            layer.register_forward_pre_hook(stack_paths_hook, with_kwargs=True)

    _widen_config(model.config, spec, dims, config)
    model.config.scale_cl = {"arch": spec.backbone, "config": config.to_dict(), "base": base}
    ignore = list(getattr(model.config, "keys_to_ignore_at_inference", None) or [])
    model.config.keys_to_ignore_at_inference = [*ignore, ROUTE_SHARE_KEY]
    model.register_forward_hook(_route_share_hook, with_kwargs=True)
    model.__class__ = _scale_class(type(model))
    set_method(model, config.method)
    return model


def _widen_config(hf_config: Any, spec: ArchSpec, dims: Dims, cfg: ScaleConfig) -> None:
    new_heads = cfg.hidden_up // dims.head_dim
    setattr(hf_config, spec.config_hidden, dims.hidden + cfg.hidden_up)
    setattr(hf_config, spec.config_ffn, dims.ffn + cfg.ffn_up)
    setattr(hf_config, spec.config_heads, dims.heads + new_heads)
    if spec.config_kv_heads:
        setattr(hf_config, spec.config_kv_heads, dims.kv_heads + new_heads // dims.group)
        hf_config.head_dim = dims.head_dim


def scale_config_of(model: nn.Module) -> ScaleConfig:
    """The ScaleConfig an upscaled model was built with (its current method included)."""
    state = getattr(getattr(model, "config", None), "scale_cl", None)
    if not state:
        raise ValueError("this model is not upscaled by scale_cl; call scale_cl.upscale(model, config) first")
    return ScaleConfig.from_dict(state["config"])


def set_method(model: nn.Module, method: str) -> nn.Module:
    """Switch a live upscaled model to ``"preserve"``, ``"adapt"`` or ``"route"``; no reload.

    Sets how every W12 block is applied and resets trainability: every original parameter frozen,
    every new parameter trainable except W12, which trains only for adapt/route and only in
    collaborative linears (layer >= preserve_layers, module in collab_modules).
    """
    cfg = replace(scale_config_of(model), method=check_method(method))
    layers = decoder_layers(model)
    stacked = method == "route" and cfg.preserve_layers < len(layers)
    # The original stream is constant (depends on no trainable parameter) below the first layer
    # whose W12 is used; there, the modules skip the gradient through the frozen products.
    first_w12 = len(layers) if method == "preserve" else cfg.preserve_layers
    for module in model.modules():
        if isinstance(module, (ScaleLinear, SplitNorm, ScaleHead)):
            module.constant_input = first_w12 >= len(layers)
    for index, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(module, (ScaleLinear, SplitNorm)):
                module.constant_input = index < first_w12
        first = cfg.preserve_layers
        layer.scale_stack_paths = None if not stacked or index < first else "start" if index == first else "continue"
        for module in layer.modules():
            if isinstance(module, ScaleLinear):
                if not module.collaborative or method == "preserve":
                    module.w12_scope = W12_OFF
                else:
                    module.w12_scope = W12_ALL if method == "adapt" else W12_SECOND_HALF
    head = model.get_output_embeddings()
    head.route, head.stacked, head.route_tau = method == "route", stacked, cfg.route_tau
    head.last_route_mask = None

    for param in model.parameters():
        param.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, (ScaleLinear, SplitNorm, ScaleEmbedding, ScaleHead)):
            for name, param in module.named_parameters(recurse=False):
                if name == "w12":
                    param.requires_grad_(module.w12_scope != W12_OFF)
                elif name not in ("weight", "bias"):
                    param.requires_grad_(True)
    model.config.scale_cl["config"] = cfg.to_dict()
    return model


def _route_share_hook(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Put the share of (non-padding) tokens routed to the preserve path into the output."""
    head = model.get_output_embeddings()
    mask = head.last_route_mask
    if not head.route or mask is None or not isinstance(output, ModelOutput):
        return None
    attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    routed = mask.float()
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == mask.shape:
        weights = attention_mask.to(routed.dtype)
        share = (routed * weights).sum() / weights.sum().clamp_min(1)
    else:
        share = routed.mean()
    output[ROUTE_SHARE_KEY] = share
    return output


class ScaleModelMixin:
    """Added to an upscaled model's class: the SCALE methods next to the usual HF ones."""

    is_scale_upscaled = True

    @property
    def scale_config(self) -> ScaleConfig:
        return scale_config_of(self)

    def set_method(self, method: str) -> nn.Module:
        return set_method(self, method)

    def save_pretrained(self, save_directory: str, full: bool = False, **kwargs: Any) -> None:
        """Save the new parameters (safetensors) and a JSON config naming the base model.

        ``full=True`` also stores the frozen base weights, so loading needs nothing else. Reload
        with `scale_cl.load`. Of transformers' own keyword arguments, ``is_main_process`` and
        ``state_dict`` are honoured and the others are ignored.
        """
        from scale_cl.io import save

        if kwargs.get("is_main_process", True):
            save(self, save_directory, full=full, state_dict=kwargs.get("state_dict"))

    def _reorder_cache(self, past_key_values: Any, beam_idx: torch.Tensor) -> Any:
        """Beam search: layers that hold the stacked route paths (2n rows) reorder both halves alike."""
        start = next((i for i, layer in enumerate(decoder_layers(self)) if layer.scale_stack_paths == "start"), None)
        if start is None:
            past_key_values.reorder_cache(beam_idx)
            return past_key_values
        both = torch.cat((beam_idx, beam_idx + beam_idx.numel()))
        for index, layer in enumerate(past_key_values.layers):
            layer.reorder_cache(both if index >= start else beam_idx)
        return past_key_values

    def scale_summary(self) -> Any:
        from scale_cl.summary import parameter_summary

        return parameter_summary(self)

    def print_trainable_parameters(self) -> None:
        print(self.scale_summary())


_CLASSES: dict[type, type] = {}


def _scale_class(cls: type) -> type:
    """``Scale<Base>``: a subclass of the model's own class (isinstance checks keep working)."""
    if cls not in _CLASSES:
        name = f"Scale{cls.__name__}"
        _CLASSES[cls] = type(name, (ScaleModelMixin, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = _CLASSES[cls]
    return _CLASSES[cls]
