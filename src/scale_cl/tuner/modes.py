"""An upscaled model's class and its method switch: what `upscale` adds to a transformers causal LM.

`set_method` is the one place that decides, for the current method, which W12 blocks are used,
which parameters train, where the original stream is constant, and whether route mode is on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from scale_cl.tuner.arch import SPECS, ArchSpec
from scale_cl.tuner.config import ScaleConfig, check_method
from scale_cl.tuner.io import save, saved_names
from scale_cl.tuner.layers import ScaleEmbedding, ScaleLinear, SplitInput, SplitNorm
from scale_cl.tuner.routing import route_settings, router_named
from scale_cl.tuner.routing.state import reorder_cache
from scale_cl.tuner.scale_state import decoder_layers, scale_config_of, scale_state_of
from scale_cl.tuner.summary import ParamSummary, parameter_summary
from scale_cl.tuner.vocab.rows import resize_token_rows


def set_method(model: nn.Module, method: str, tau: float | None = None) -> nn.Module:
    """Switch a live upscaled model to ``"preserve"``, ``"adapt"`` or ``"route"``; no reload.

    Sets how every W12 block is applied and resets trainability: every original parameter frozen,
    every new parameter trainable except W12, which trains only for adapt/route and only in
    collaborative linears (layer >= preserve_layers, module in collab_modules), where it is allocated (at zero) on
    first use: switch before building the optimizer, which holds only what exists then; a grown model's earlier
    stages stay frozen (`scale_cl.tuner.stages`). ``tau`` (with ``"route"`` only: refused otherwise) sets
    SCALE-Route's threshold of Eq. 5 (a cosine in [-1, 1]; by default the model keeps its own): it is
    the model's ``ScaleConfig.route_tau``, so what routing uses is what is saved, reloaded and exported;
    it is set as `set_live_settings` sets it (``route_tau=``), tau's one setter.
    """
    method = check_method(method)
    if tau is not None:
        if method != "route":
            raise ValueError(
                f"tau is SCALE-Route's threshold (Eq. 5): set_method(model, {method!r}) does not route; drop tau, or "
                "set it with set_method(model, 'route', tau=...)"
            )
        set_live_settings(model, route_tau=tau)  # checked there: a refused tau changes nothing
    cfg = replace(scale_state_of(model).config, method=method)
    layers = decoder_layers(model)
    # The original stream is constant (depends on no trainable parameter) below the first layer
    # whose W12 is used; there, the modules skip the gradient through the frozen products.
    # An extended vocabulary's new embedding rows train (`.vocab`): the stream depends on them from the start.
    new_rows = getattr(model.get_input_embeddings(), "weight_new", None) is not None
    first_w12 = 0 if new_rows else len(layers) if method == "preserve" else cfg.preserve_layers
    # Route stacks [preserve; adapt] from the first collaborative layer on; the preserve half's
    # original stream never meets W12, so it is constant there too (unless new rows feed it).
    stacked_from = cfg.preserve_layers if cfg.preserve_layers < len(layers) else None
    for module in model.modules():
        if isinstance(module, SplitInput):
            module.constant_input = first_w12 >= len(layers)
            module.constant_half = False
    for index, layer in enumerate(layers):
        stacked_half = method == "route" and stacked_from is not None and index >= stacked_from and not new_rows
        for module in layer.modules():
            if isinstance(module, SplitInput):
                module.constant_input = index < first_w12
                module.constant_half = stacked_half
            if isinstance(module, ScaleLinear):
                module.use_w12 = module.collaborative and method != "preserve"
                if module.use_w12:
                    module.add_w12()
        heads_constant = index < first_w12
        if index == first_w12 and not new_rows:  # what reads this layer's input is constant, what W12 reaches not
            spec = SPECS[scale_state_of(model).base_class]
            heads_constant = _first_w12_layer(layer, spec, bool(getattr(model.config, spec.parallel_residual or "", 0)))
        for module in layer.modules():
            if hasattr(module, "scale_heads"):  # the attention's original heads (`scale_cl.tuner.attention`)
                module.scale_heads.constant = heads_constant
                module.scale_heads.constant_half = stacked_half
    scale_state_of(model).config = cfg  # the method and tau, read by save, export and route
    _switch_routing(model, stacked_from)

    for param in model.parameters():
        param.requires_grad_(False)
    earlier = {id(m) for norm in model.modules() if isinstance(norm, SplitNorm) for m in norm.earlier_stages()}
    for module in model.modules():
        if isinstance(module, (SplitInput, ScaleEmbedding)) and id(module) not in earlier:
            for name, param in module.named_parameters(recurse=False):
                if name == "w12":
                    param.requires_grad_(module.use_w12)
                elif name not in ("weight", "bias"):
                    param.requires_grad_(True)
    return model


def _switch_routing(model: nn.Module, stacked_from: int | None) -> None:
    """Turn the model's route state (created by `upscale`) on where a router makes the logits
    (`ScaleConfig.routed`); only SCALE-Route stacks its two paths (SCALE-Preserve's base logits are its own ``Z``)."""
    cfg = scale_state_of(model).config
    reads_tokens = router_named(cfg.router).reads_tokens
    model.scale_route.switch(cfg.routed, stacked_from if cfg.method == "route" else None, reads_tokens)


def _first_w12_layer(layer: nn.Module, spec: ArchSpec, parallel: bool) -> bool:
    """Mark the constant inputs of the first layer whose W12 is used; returns whether its attention's original heads
    are constant.

    The layer's input is the base model's stream there, so what reads it is constant: the attention's norm and its
    q/k/v (and, with a parallel residual, the FFN's norm and its gate/up); what a W12 of this layer reaches is not.
    """
    uses = {kind: any(layer.get_submodule(lin.path).use_w12 for lin in spec.linears if lin.module == kind)
            for kind in ("attn", "ffn")}  # fmt: skip
    ffn_input = parallel or not uses["attn"]  # the FFN reads the layer's input, or attention's original output
    for path, constant in zip(spec.layer_norms, (True, ffn_input), strict=True):
        layer.get_submodule(path).constant_input = constant
    for lin in spec.linears:
        reads_input = lin.grow_in == "hidden"  # q/k/v, gate/up; o and down read their own block's output
        constant = (
            reads_input or not uses["attn"] if lin.module == "attn" else ffn_input and (reads_input or not uses["ffn"])
        )
        layer.get_submodule(lin.path).constant_input = constant
    return not uses["attn"]


def live_settings() -> tuple[str, ...]:
    """The `ScaleConfig` fields the head reads at every forward: ``up_logit_scale`` and the route settings
    (``router`` and what each registered router reads, `scale_cl.tuner.routing.route_settings`)."""
    return ("up_logit_scale", *route_settings())


def set_live_settings(model: nn.Module, **changes: Any) -> nn.Module:
    """Change `ScaleConfig` fields a live upscaled model reads at every forward (`live_settings`); returns it.

    They live in the model's `ScaleState` only, so the head uses, `save_pretrained` saves and the export writes
    one value; each is checked as `ScaleConfig` checks it, and a refused value changes nothing. Fields that shape
    the model (widths, norms, initialisers) are refused: they are fixed by `upscale`.
    """
    live = live_settings()
    fixed = sorted(set(changes) - set(live))
    if fixed:
        raise ValueError(f"{fixed} cannot change on a live model (fixed by upscale); live settings: {live}")
    scale_state_of(model).with_config(**changes)
    if "router" in changes:  # SCALE-Preserve is routed by the likelihood router alone
        _switch_routing(model, model.scale_route.first_stacked)
    return model


def set_up_logit_scale(model: nn.Module, alpha: float) -> nn.Module:
    """Weigh the new stream's logits, ``Z + alpha Z_up``, on a live upscaled model; returns it.

    ``alpha`` is the model's `ScaleConfig.up_logit_scale` (0 or more; 1 is the paper's), so the head uses,
    `save_pretrained` saves and the export merges (into ``W_out_up``) one value. Evaluating one trained model
    at several ``alpha`` traces a learning-forgetting frontier without retraining (docs/design.md §2): at 0,
    SCALE-Preserve's logits are the base model's.
    """
    return set_live_settings(model, up_logit_scale=alpha)


class ScaleModelMixin:
    """Added to an upscaled model's class: the SCALE methods next to the usual HF ones."""

    is_scale_upscaled = True

    @property
    def scale_config(self) -> ScaleConfig:
        return scale_config_of(self)

    def set_method(self, method: str, tau: float | None = None) -> nn.Module:
        return set_method(self, method, tau)

    def set_up_logit_scale(self, alpha: float) -> nn.Module:
        return set_up_logit_scale(self, alpha)

    def save_pretrained(self, save_directory: str, full: bool = False, **kwargs: Any) -> None:
        """Save the new parameters (safetensors) and a JSON config naming the base model.

        ``full=True`` also stores the frozen base weights, so loading needs nothing else. Reload
        with `scale_cl.load`. Of transformers' own keyword arguments, ``is_main_process`` and
        ``state_dict`` are honoured and the others are ignored.
        """
        if kwargs.get("is_main_process", True):
            save(self, save_directory, full=full, state_dict=kwargs.get("state_dict"))

    @property
    def _keys_to_ignore_on_save(self) -> set[str]:
        """The state-dict keys `save_pretrained` leaves out: the frozen ones (the base's, an earlier stage's).

        The stock ``Trainer`` resuming from its checkpoint loads the saved file with ``strict=False`` and warns of
        missing keys unless they are exactly these, so it resumes an upscaled model quietly (`scale_cl.tuner.io`).
        """
        saved = set(saved_names(self))
        return {key for key in self.state_dict(keep_vars=True) if key not in saved}

    @_keys_to_ignore_on_save.setter
    def _keys_to_ignore_on_save(self, value: Any) -> None:
        """Ignored: what is left out follows from the model (transformers sets its own before upscaling)."""

    def _reorder_cache(self, past_key_values: Any, beam_idx: torch.Tensor) -> Any:
        return reorder_cache(self.scale_route, past_key_values, beam_idx)

    def scale_summary(self) -> ParamSummary:
        return parameter_summary(self)

    def print_trainable_parameters(self) -> None:
        print(self.scale_summary())

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Module:
        """Grow the vocabulary with `.vocab.resize_token_rows`: the original rows stay frozen, the new ones
        train (each the mean of the original rows; ``mean_resizing`` is ignored). Shrinking is refused."""
        return resize_token_rows(self, new_num_tokens, pad_to_multiple_of)


_CLASSES: dict[type, type] = {}


def scale_class(cls: type) -> type:
    """``Scale<Base>``: a subclass of the model's own class (isinstance checks keep working)."""
    if cls not in _CLASSES:
        name = f"Scale{cls.__name__}"
        _CLASSES[cls] = type(name, (ScaleModelMixin, cls), {"__module__": __name__, "__qualname__": name})
    return _CLASSES[cls]


def __getattr__(name: str) -> type:
    """``scale_cl.tuner.modes.Scale<Base>`` resolves to the class made for ``<Base>`` (so pickle finds it)."""
    for made in _CLASSES.values():
        if made.__name__ == name:
            return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
