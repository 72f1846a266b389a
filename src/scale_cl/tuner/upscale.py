"""Model surgery: widen a transformers causal LM in place (docs/design.md §1).

`upscale` swaps every attention/FFN linear for a `ScaleLinear`, every FFN for a `ScaleMLP` (its
activation applied per part), every norm for a `SplitNorm`, the embedding and LM head for their
widened versions, rewrites the model's config so it states the widened sizes, records what it did
in the model's `ScaleState` (``model.scale_state``), gives the model its `RouteState` and a class with `set_method`,
`save_pretrained` (only the new weights) and a parameter summary (`scale_cl.tuner.modes`).
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from scale_cl.tuner import attention
from scale_cl.tuner.arch import SPECS, ArchSpec, spec_for
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.init import expansion_blocks, top_singular_all
from scale_cl.tuner.layers import ScaleEmbedding, ScaleHead, ScaleLinear, ScaleMLP, SplitNorm
from scale_cl.tuner.modes import scale_class, set_method
from scale_cl.tuner.provenance import base_record
from scale_cl.tuner.quant import dense_weight
from scale_cl.tuner.routing.state import (
    ROUTE_SHARE_KEY,
    RouteState,
    capture_inputs_hook,
    route_share_hook,
    stack_paths_hook,
)
from scale_cl.tuner.scale_state import ScaleState, scale_state_of
from scale_cl.tuner.sliced_loss import use_sliced_loss
from scale_cl.tuner.stages import check_growable, freeze_stage
from scale_cl.tuner.streams import streams_apart_class
from scale_cl.tuner.vocab.rows import split_vocab
from scale_cl.tuner.widths import Dims, base_dims, growth, resolve


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def upscale(model: PreTrainedModel, config: ScaleConfig) -> PreTrainedModel:
    """Width-upscale ``model`` in place with ``config`` and return it.

    The returned model computes exactly the base model's logits until W12 or the LM head's new
    columns change (Theorem 3.1). Every original parameter is frozen; which new ones train is
    decided by ``config.method`` (see `set_method`). Randomness is seeded by ``config.seed``.

    An upscaled model is grown again: everything it has (trained under its current method) is frozen into
    the new base (`scale_cl.tuner.stages.freeze_stage`) and ``config`` adds to its whole width, so the result
    computes exactly that model at start. A config the model cannot take is refused before anything changes.
    """
    if not isinstance(config, ScaleConfig):
        raise TypeError(f"config must be a ScaleConfig, got {type(config).__name__}")
    again = getattr(model, "is_scale_upscaled", False)  # grow an upscaled model again (`scale_cl.tuner.stages`)
    if again:
        check_growable(model)
        spec = SPECS[scale_state_of(model).base_class]
    else:
        spec = spec_for(model)
        model = split_vocab(model)  # a reloaded extended vocabulary: its new rows train, its original rows do not
    dims = base_dims(model.config, spec)
    config = resolve(config, dims)  # refused before anything changes
    before = sum(p.numel() for p in model.parameters())
    if again:
        freeze_stage(model)  # everything trained so far: the new, frozen base
        base, stages = model.scale_state.base, model.scale_state.stages
    else:
        base, stages = base_record(model, dims), []
    grow = growth(config, dims)
    u = config.hidden_up

    backbone = getattr(model, spec.backbone)
    # the original base model, the sizes this stage grows, the earlier stages and this stage's config
    state = ScaleState(spec.backbone, config, base, dims, before, stages)
    route = RouteState(state)
    param = next(model.parameters())
    devices = [param.device] if param.device.type != "cpu" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=param.device.type):
        torch.manual_seed(config.seed)
        embedding = model.get_input_embeddings()
        std = embedding.weight.detach().float().std().item()
        embed_up = torch.randn(embedding.num_embeddings, u, device=param.device) * std
        if config.embed_up_init == "zero":  # drawn all the same, so every later initialiser draws the same numbers
            embed_up = torch.zeros_like(embed_up)
        model.set_input_embeddings(ScaleEmbedding(embedding, embed_up))
        head = model.get_output_embeddings()
        model.set_output_embeddings(ScaleHead(head, u))
        model.get_output_embeddings().route = route
        eps = getattr(model.config, spec.config_norm_eps)
        norm = partial(SplitNorm, norm_kind=spec.norm_kind, hidden_up=u, eps=eps, up_norm=config.up_norm)
        _set(backbone, spec.final_norm, norm(backbone.get_submodule(spec.final_norm)))
        singular = itertools.repeat(None)
        if "svd" in (config.w21_init, config.w22_init):  # the slow part: computed in parallel on a CPU, in order
            work = [
                (dense_weight(layer.get_submodule(lin.path)), grow[lin.grow_out])
                for layer in backbone.layers
                for lin in spec.linears
            ]
            singular = top_singular_all(work, [config.seed * 1_000_003 + position for position in range(len(work))])
        for index, layer in enumerate(backbone.layers):
            for path in spec.layer_norms:
                _set(layer, path, norm(layer.get_submodule(path)))
            for lin in spec.linears:
                old = layer.get_submodule(lin.path)
                in_up, out_up = grow[lin.grow_in], grow[lin.grow_out]
                blocks = (dense_weight(old), out_up, in_up, config.w21_init, config.w22_init, next(singular))
                w21, w22 = expansion_blocks(*blocks)
                collaborative = index >= config.preserve_layers and lin.module in config.collab_modules
                linear = ScaleLinear(old, in_up, out_up, w21, w22, collaborative, lin.module)
                linear.route = route
                _set(layer, lin.path, linear)
            mlp = spec.mlp
            _set(layer, mlp.path, ScaleMLP(layer.get_submodule(mlp.path), mlp.gate, mlp.up, mlp.down, mlp.act))
            attention.install(layer.get_submodule(spec.attention), model.config, dims.heads, dims.kv_heads)
            layer.__class__ = streams_apart_class(type(layer), spec.layer_apart)
            hook = partial(stack_paths_hook, state=route, index=index)
            route.handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))

    _widen_config(model.config, spec, dims, config)
    model.scale_state = state
    ignore = list(getattr(model.config, "keys_to_ignore_at_inference", None) or [])
    model.config.keys_to_ignore_at_inference = [*ignore, ROUTE_SHARE_KEY]
    model.scale_route = route
    route.handles.append(model.register_forward_hook(partial(route_share_hook, state=route), with_kwargs=True))
    route.handles.append(model.register_forward_pre_hook(partial(capture_inputs_hook, state=route), with_kwargs=True))
    eos = getattr(model.config, "eos_token_id", None)
    route.eos_ids = tuple(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])
    model.__class__ = scale_class(type(model))
    use_sliced_loss(model)  # its forward returns the sliced loss when it trains on labels
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
