"""Repeated upscaling: an upscaled, trained model frozen into a plain, wider base that `upscale` grows again.

`freeze_stage` replaces every SCALE module by the stock module computing what it computes now under its
method: a `ScaleLinear` by an ``nn.Linear`` holding its block matrix (W12 where the method used it, zero where
not), the embedding by ``[E, E_up]``, the head by ``[W_out, alpha W_out_up]``, the SCALE FFN by the stock FFN
arithmetic (`FrozenMLP`). The norms cannot be merged (each group keeps its own statistic), so each `SplitNorm`
stays as it is, frozen, and the next stage's `SplitNorm` normalises the whole previous width with it: the
norms split into groups ``d, u1, u2, ...`` (docs/design.md §2, "Growing again").

Everything trained so far is then frozen and is the new base, and the next stage's `upscale` computes exactly
that base until its own W12 or head columns change (Theorem 3.1 at every step). The merged products round
differently from the split ones (floating-point tolerance, not bitwise).

A SCALE-Route model is refused: its function routes each token between two paths of the same weights, which no
single set of frozen weights computes. A model with an extended vocabulary is refused too (its new token rows
would have to be frozen into the base and recorded apart).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scale_cl.tuner.arch import SPECS
from scale_cl.tuner.layers import INNER, ScaleEmbedding, ScaleHead, ScaleLinear, ScaleMLP, SplitNorm, is_new_parameter
from scale_cl.tuner.routing.state import ROUTE_SHARE_KEY
from scale_cl.tuner.scale_state import StageRecord, decoder_layers, scale_config_of, scale_state_of
from scale_cl.tuner.streams import stock_class

# Where a checkpoint lists a grown model's earlier stages (`scale_cl.tuner.io`; the current one is its config).
STAGES_KEY = "stages"


class FrozenMLP(nn.Module):
    """The stock FFN arithmetic (``down(act(gate(x)) * up(x))``, or ``down(act(up(x)))`` ungated) on plain linears:
    what a `ScaleMLP` becomes in a frozen stage. It keeps the base MLP's child names, so the next `ScaleMLP` and
    checkpoints find them where they were."""

    def __init__(self, mlp: ScaleMLP) -> None:
        super().__init__()
        self.names = mlp.names
        for name in mlp.names:
            if name is not None:
                self.add_module(name, mlp.get_submodule(name))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up, down, act = (None if name is None else getattr(self, name) for name in self.names)
        inner = act(up(hidden)) if gate is None else act(gate(hidden)) * up(hidden)
        return down(inner)


def stage_count(model: nn.Module) -> int:
    """How many times ``model`` was upscaled (0 for a model never upscaled)."""
    state = getattr(model, "scale_state", None)
    return 0 if state is None else len(state.stages) + 1


def check_growable(model: nn.Module) -> None:
    """Raise a ValueError, before anything changes, when an upscaled ``model`` cannot be frozen into a new base."""
    cfg = scale_config_of(model)
    if cfg.method == "route":
        raise ValueError(
            "cannot grow a SCALE-Route model again: it routes every token between two paths of the same weights, "
            "which no frozen base computes. Grow it under the method you deploy it with (set_method(model, "
            "'adapt') or 'preserve' first), or keep training the same blocks (grow once)"
        )
    if scale_state_of(model).base_quant != "none":
        raise ValueError(
            "cannot grow a model on a quantized base again: its frozen block matrices would have to be stored dense "
            "(or quantized anew, which changes them): keep training the same blocks (grow once)"
        )
    if getattr(model.get_input_embeddings(), "weight_new", None) is not None:
        raise ValueError(
            "cannot grow a model with an extended vocabulary again (its new token rows would be frozen into the "
            "base, and its checkpoint could not record them): keep training the same blocks (grow once)"
        )


def _plain_linear(module: ScaleLinear) -> nn.Linear:
    weight, bias = module.merged_weight()
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _plain_embedding(module: ScaleEmbedding) -> nn.Embedding:
    weight = torch.cat((module.weight, module.weight_up), dim=1).detach()
    embedding = nn.Embedding(*weight.shape, padding_idx=module.padding_idx, device="meta")
    embedding.weight = nn.Parameter(weight, requires_grad=False)
    return embedding


def _plain_head(module: ScaleHead) -> nn.Linear:
    alpha = module.setting("up_logit_scale", 1.0)  # Z + alpha Z_up = [W_out, alpha W_out_up] [x; x_up]
    weight_up = module.weight_up if alpha == 1 else module.weight_up * alpha
    weight = torch.cat((module.weight, weight_up), dim=1).detach()
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        head.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
    return head


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def freeze_stage(model: nn.Module) -> StageRecord:
    """Freeze the upscaled ``model`` in place into a plain base of its current width; returns the stage's record.

    Afterwards ``model`` is an instance of its stock class again (every parameter frozen), its config states the
    widened sizes, its `ScaleState` (``model.scale_state``) holds the earlier stages (``stages``) and the original
    base model's record (``base``), and `upscale` grows it. The record: the stage's `ScaleConfig` (its method
    included), the sizes of the model it grew and how many parameters it added.
    """
    check_growable(model)
    state = scale_state_of(model)
    record = StageRecord(scale_config_of(model), state.dims, added_parameters(model))
    spec = SPECS[state.base_class]
    with torch.no_grad():
        for layer in decoder_layers(model):
            for lin in spec.linears:
                _set(layer, lin.path, _plain_linear(layer.get_submodule(lin.path)))
            _set(layer, spec.mlp.path, FrozenMLP(layer.get_submodule(spec.mlp.path)))
            layer.__class__ = stock_class(type(layer))  # plain linears: the stock layer (`scale_cl.tuner.streams`)
        model.set_input_embeddings(_plain_embedding(model.get_input_embeddings()))
        model.set_output_embeddings(_plain_head(model.get_output_embeddings()))
    for module in model.modules():
        if isinstance(module, SplitNorm):
            module.constant_input = False
    for param in model.parameters():
        param.requires_grad_(False)
    model.scale_route.remove_hooks()  # the next stage registers its own
    model.config.tie_word_embeddings = False  # [W_out, W_out_up] is not [E, E_up]
    ignore = [k for k in (model.config.keys_to_ignore_at_inference or []) if k != ROUTE_SHARE_KEY]
    model.config.keys_to_ignore_at_inference = ignore
    del model.scale_route
    model.__class__ = type(model).__bases__[1]  # Scale<Base> -> <Base> (`scale_cl.tuner.modes.scale_class`)
    state.stages = [*state.stages, record]
    return record


def added_parameters(model: nn.Module) -> int:
    """How many parameters the current stage of an upscaled ``model`` added: all it has now less all the model it
    grew had (recorded by `upscale`). A grown model whose original base ties its head to the embedding also pays
    for the head's own copy: ``[W_out, W_out_up]`` is no longer ``[E, E_up]``."""
    return sum(p.numel() for p in model.parameters()) - scale_state_of(model).grew_from_parameters


# ---------------------------------------------------------------------------------------------------
# A grown model's checkpoint: its frozen tensors are the original base's, widened by the earlier stages.


def hub_shapes(base: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The original base model's parameter shapes, by name, from its record (a model built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # the tuner's one use: a grown model's checkpoint

    fields = {k: v for k, v in base["config"].items() if k != "quantization_config"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}  # tied ones too


def original_name(name: str) -> str:
    """A grown model's parameter name as the original base model names it (its norms nest the earlier ones)."""
    while f".{INNER}." in name:
        name = name.replace(f".{INNER}.", ".", 1)
    return name


def frozen_parts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A grown model's frozen tensors as (the original base's, under its names; what the earlier stages added).

    An earlier stage widened each merged tensor on the right and at the bottom: ``original = t[:r, :c]``,
    ``t[:r, c:]`` is kept as ``<name>@right`` and ``t[r:, :]`` as ``<name>@bottom`` (a 1-D tensor's tail as
    ``<name>@tail``), so `assemble_frozen` rebuilds ``t`` bitwise from the original base and these.
    """
    shapes = hub_shapes(scale_state_of(model).base)
    original, added = {}, {}
    for name, param in model.named_parameters():
        if is_new_parameter(name):
            continue  # saved as such (an earlier stage's norm gains too)
        hub = original_name(name)
        tensor = param.detach()
        shape = shapes[hub]
        original[hub] = tensor[tuple(slice(0, n) for n in shape)]
        for key, part in _frame(tensor, shape).items():
            added[f"{name}@{key}"] = part
    return original, added


def _frame(tensor: torch.Tensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    if tuple(tensor.shape) == shape:
        return {}
    if tensor.dim() == 1:
        return {"tail": tensor[shape[0] :]}
    rows, cols = shape
    return {"right": tensor[:rows, cols:], "bottom": tensor[rows:]}


def assemble_frozen(model: nn.Module, added: dict[str, torch.Tensor]) -> None:
    """Write what the earlier stages added (`frozen_parts`) into a rebuilt grown model's frozen tensors, whose
    original-base corner already holds the original base's values."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, part in added.items():
            name, _, where = key.rpartition("@")
            param = params[name]
            if where == "tail":
                param[param.shape[0] - part.shape[0] :].copy_(part)
            elif where == "right":
                param[: part.shape[0], param.shape[1] - part.shape[1] :].copy_(part)
            else:
                param[param.shape[0] - part.shape[0] :].copy_(part)


__all__ = [
    "STAGES_KEY",
    "FrozenMLP",
    "added_parameters",
    "assemble_frozen",
    "check_growable",
    "freeze_stage",
    "frozen_parts",
    "hub_shapes",
    "original_name",
    "stage_count",
]
