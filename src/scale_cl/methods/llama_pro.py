"""LLaMA Pro (Wu et al. 2024): depth upscaling by interleaved, identity-initialised block copies.

From ``L`` to ``L + N`` blocks: after every group of ``L / N`` original blocks a deep copy of the
group's last block is inserted, with the linears that write into the residual stream zeroed (Llama
family: ``self_attn.o_proj`` and ``mlp.down_proj``; GPT-NeoX: ``attention.dense`` and
``mlp.dense_4h_to_h``, weights and biases), so each copy is the identity at step 0 and the model
computes the base model's logits. Only the copies train. For GPT-NeoX (Pythia) this is the paper's
Section 5.1 adaptation: the same idea with NeoX's own output projections.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from scale_cl.methods.matching import (
    llama_pro_sources,
    llama_pro_valid_blocks,
    match_llama_pro_blocks,
    scale_trainable_count,
)
from scale_cl.tuner.arch import ArchSpec, spec_for
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.vocab import new_row_parameters, split_vocab


def residual_outputs(spec: ArchSpec) -> list[str]:
    """The linears of a block that write into the residual stream: zeroing them makes the block the identity.

    They are the ArchSpec linears whose output is the hidden width (``grow_out == "hidden"``).
    """
    return [lin.path for lin in spec.linears if lin.grow_out == "hidden"]


def default_blocks(num_layers: int) -> int:
    """``L // 4`` when it divides ``L`` (16 -> 4, as in the paper's 16 -> 20), else the smallest valid (1)."""
    quarter = num_layers // 4
    return quarter if quarter >= 1 and num_layers % quarter == 0 else llama_pro_valid_blocks(num_layers)[0]


def prepare_llama_pro(
    model: nn.Module, *, blocks: int | str | None = None, match: ScaleConfig | None = None
) -> nn.Module:
    """Insert ``blocks`` identity-initialised copies of decoder blocks; freeze every original parameter.

    Why: LLaMA Pro adds depth for the new domain while keeping the base blocks intact, the
    depth-upscaling counterpart that the paper contrasts with SCALE's width upscaling.

    ``blocks`` must divide the number of layers ``L`` (default `default_blocks`); ``"match"`` picks
    the valid number whose trainable count is closest to what the SCALE config ``match`` trains.
    Updates ``config.num_hidden_layers``, ``config.layer_types`` (when the config has it; the copy
    gets its source block's type), and every attention's ``layer_idx`` (0 .. L+N-1 in order, the
    KV-cache slots), and records ``config.llama_pro = {"base_layers", "blocks", "inserted"}`` with
    the indices of the new blocks in the expanded model. The copies share the model's config object.
    With an extended vocabulary (`scale_cl.tuner.vocab`) the new tokens' rows (``weight_new``) train too.
    """
    spec = spec_for(model)
    backbone = getattr(model, spec.backbone)
    layers = backbone.layers
    num_layers = len(layers)
    valid = llama_pro_valid_blocks(num_layers)
    if match is not None and not isinstance(match, ScaleConfig):
        raise ValueError(f"llama_pro: match must be a ScaleConfig, got {type(match).__name__}")
    if blocks == "match":
        if match is None:
            raise ValueError("llama_pro: blocks='match' needs match=ScaleConfig(...), the SCALE config to match")
        blocks = match_llama_pro_blocks(model, scale_trainable_count(model, match))
    elif match is not None:
        raise ValueError("llama_pro: match= is only read with blocks='match'")
    elif blocks is None:
        blocks = default_blocks(num_layers)
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks not in valid:
        raise ValueError(
            f"llama_pro: blocks={blocks!r} must divide the model's {num_layers} layers "
            f"(one copy after every L/N blocks); valid values: {valid}"
        )

    split_vocab(model)
    for param in model.parameters():
        param.requires_grad_(False)
    for param in new_row_parameters(model):
        param.requires_grad_(True)
    sources = set(llama_pro_sources(num_layers, blocks))
    configs = {id(c): c for c in (model.config, getattr(backbone, "config", None)) if c is not None}
    layer_types = getattr(model.config, "layer_types", None)
    expanded, types, inserted = [], [], []
    for index, layer in enumerate(layers):
        expanded.append(layer)
        types.append(layer_types[index] if layer_types is not None else None)
        if index in sources:
            inserted.append(len(expanded))
            expanded.append(_identity_copy(layer, spec, memo=dict(configs)))
            types.append(types[-1])

    backbone.layers = nn.ModuleList(expanded)
    for index, layer in enumerate(backbone.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    model.config.num_hidden_layers = len(expanded)
    if layer_types is not None:
        model.config.layer_types = types
    model.config.llama_pro = {"base_layers": num_layers, "blocks": blocks, "inserted": inserted}
    return model


def _identity_copy(layer: nn.Module, spec: ArchSpec, memo: dict[int, object]) -> nn.Module:
    """A trainable deep copy of ``layer`` whose residual-stream outputs are zero (so it is the identity)."""
    new = copy.deepcopy(layer, memo)
    with torch.no_grad():
        for path in residual_outputs(spec):
            linear = new.get_submodule(path)
            linear.weight.zero_()
            if linear.bias is not None:
                linear.bias.zero_()
    for param in new.parameters():
        param.requires_grad_(True)
    return new


def describe_llama_pro(model: nn.Module, options: dict) -> str:
    """The bench's one-line description of the prepared model."""
    record = model.config.llama_pro
    return f"+{record['blocks']} blocks ({record['base_layers']} -> {record['base_layers'] + record['blocks']})"
