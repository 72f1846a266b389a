"""SCALE-Route's two paths in one forward pass, and the state every part of route mode reads.

The preserve path is the same network with W12 taken as zero, so the layers below
``preserve_layers`` are identical on both paths and run once. At the first collaborative layer a
forward pre-hook (`stack_paths_hook`) stacks the batch as ``[preserve path; adapt path]`` (2B
rows); from there on each collaborative `ScaleLinear` adds its W12 product to the second half only,
and the `ScaleHead` hands both halves to the model's router (`scale_cl.tuner.routing.router`: Eq. 5's
cosine router by default, `scale_cl.tuner.routing.cosine`), which combines them per token. Everything
route mode needs to know lives in one `RouteState` per model, which `set_method` switches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.utils import ModelOutput

# The key of the routing share in a route model's output (left out of Trainer's evaluation outputs).
ROUTE_SHARE_KEY = "route_preserve_share"

# Keyword arguments of a decoder layer that carry a batch dimension and must be stacked too.
_BATCHED_KWARGS = ("attention_mask", "position_ids", "position_embeddings")


# Copied to export/modeling_scale.py (_stack): change both (tests/export/test_export_copies.py).
def _stack(value: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and batch > 1:
        return torch.cat((value, value))
    if isinstance(value, tuple):
        return tuple(_stack(v, batch) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a router decided in the model's last forward pass (``RouteState.last``); each router's own subclass adds
    what else it read. ``base_weight`` (B, T): each token's weight on the base's logits (SCALE-Route's preserve
    path), in [0, 1]: Eq. 5's decision as 0 or 1, a mixture's ``w_0``."""

    base_weight: torch.Tensor


class ScaleReadout(Protocol):
    """What route mode reads of the model's `scale_cl.tuner.scale_state.ScaleState` (which sits above the routers,
    whose names its `ScaleConfig` checks): the current config and the head's widths by stage."""

    config: Any

    def stage_widths(self) -> tuple[int, ...]: ...


class RouteState:
    r"""SCALE-Route's state on one upscaled model: the one object every part of route mode reads.

    `upscale` creates it (``model.scale_route``) and hands it to the modules that act on it: the
    decoder layers' stacking pre-hooks (`stack_paths_hook`), the collaborative `ScaleLinear`\ s (W12
    on the adapt half only), the `ScaleHead` (Eq. 5) and the model's output hook
    (`route_share_hook`). `set_method` switches it on (``"route"``) and off (any other method);
    while off, every module behaves as if route did not exist.

    Attributes:
        scale: the model's `ScaleState`, whose ``config`` holds ``route_tau`` and every router setting: their one
            home, so what routing uses is what is saved, reloaded and exported (`setting`).
        active: route mode is on.
        first_stacked: the first collaborative decoder layer, from which the batch runs as
            ``[preserve path; adapt path]`` (2B rows); None when no layer is collaborative (both paths
            are one network and nothing is stacked).
        last: the router's `scale_cl.tuner.routing.router.Reading` of the last forward pass (its own type: Eq. 5's
            cosines and decision, a mixture's weights), None before one.
        capture_base: while set, the head keeps the base model's logits of each forward pass in
            ``base_logits`` (SCALE-Preserve's ``Z``, SCALE-Route's ``Z_p``; the free teacher of
            `scale_cl.train.distill`, which sets and clears it).
        evidence: while a list, a mixing router appends what each forward pass gave it to weigh (the experts'
            `scale_cl.tuner.routing.calibrated.Evidence`; what the calibrated router's gate is fitted on).
        handles: the hooks `upscale` registered for route mode (removed when a stage is frozen,
            `scale_cl.tuner.stages.freeze_stage`).
    """

    def __init__(self, scale: ScaleReadout) -> None:
        self.scale = scale
        self.handles: list[RemovableHandle] = []
        self.active = False
        self.first_stacked: int | None = None
        self.last: Reading | None = None
        self.capture_base = False
        self.base_logits: torch.Tensor | None = None
        self.evidence: list | None = None
        # a router's view of the call and its memory across calls (the likelihood router's: this call's tokens and
        # a `scale_cl.tuner.routing.posterior.ExpertMemory`, which has ``reorder(beam_idx)`` for beam search)
        self.inputs: dict[str, Any] = {}
        self.memory: Any = None
        self.keep = 0  # the last positions the call's caller reads (``logits_to_keep``; 0: every position)
        self.eos_ids: tuple[int, ...] = ()
        self.reads_tokens = False  # the model's router weighs by the input ids (set with it: `switch`)

    def keep_base(self, logits: torch.Tensor) -> None:
        """The head's hand-over of the base model's logits (kept only while ``capture_base`` is set)."""
        if self.capture_base:
            self.base_logits = logits.detach()

    def setting(self, name: str) -> Any:
        """A `ScaleConfig` field as the model holds it now (its `ScaleState`: the one home, saved and exported;
        changed on a live model by `scale_cl.tuner.modes.set_live_settings` alone)."""
        return getattr(self.scale.config, name)

    def remove_hooks(self) -> None:
        """Remove the hooks `upscale` registered for route mode (``handles``)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def tau(self) -> float:
        """The cosine threshold of Eq. 5: the model's ``ScaleConfig.route_tau``."""
        return self.setting("route_tau")

    @tau.setter
    def tau(self, value: float) -> None:
        raise AttributeError(
            "tau is set in one way: scale_cl.tuner.modes.set_live_settings(model, route_tau=...) "
            "(or set_method(model, 'route', tau=...))"
        )

    def switch(self, active: bool, first_stacked: int | None, reads_tokens: bool = False) -> None:
        self.active, self.reads_tokens = active, active and reads_tokens
        self.first_stacked = first_stacked if active else None
        self.last = None

    def stage_widths(self) -> tuple[int, ...]:
        """The widths of the head's original input by stage (`ScaleState.stage_widths`)."""
        return self.scale.stage_widths()

    @property
    def stacked(self) -> bool:
        """Whether the head receives the stacked ``[preserve; adapt]`` batch."""
        return self.active and self.first_stacked is not None


# Copied to export/modeling_scale.py (stack_paths): change both (tests/export/test_export_copies.py).
def stack_paths_hook(
    layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, state: RouteState, index: int
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of decoder layer ``index``; acts in route mode from the first collaborative layer on.

    At ``state.first_stacked`` it stacks the hidden states and the batched keyword arguments; above
    it the hidden states arrive stacked, and the model hands every layer its batched arguments
    afresh, so those are stacked again. Tensors whose batch dimension is 1 broadcast and are left alone.
    """
    if not state.stacked or index < state.first_stacked:
        return None
    if args:
        hidden, args = args[0], args[1:]
    else:
        hidden = kwargs.pop("hidden_states")
    if index == state.first_stacked:
        batch, hidden = hidden.shape[0], torch.cat((hidden, hidden))
    else:
        batch = hidden.shape[0] // 2
    kwargs = {k: (_stack(v, batch) if k in _BATCHED_KWARGS else v) for k, v in kwargs.items()}
    return (hidden, *args), kwargs


# Copied to export/modeling_scale.py (capture_router_inputs): change both (tests/export/test_export_copies.py).
def capture_inputs_hook(model: nn.Module, args: tuple, kwargs: dict, *, state: RouteState) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the model: the likelihood router's view of the call (its token ids, the attention mask
    of its positions) and, for a call that starts new sequences (no KV cache yet), a fresh router memory.

    The router reads every position's logits (each is evidence for the next), so a call that asks for the last
    positions' only (``logits_to_keep``, as ``generate()``'s prefill does) has the head compute all of them; the
    router mixes the last ``keep`` alone (an index tensor: every position).
    """
    state.keep = 0  # a router reading no tokens sees the kept positions alone (the model slices them off)
    if not state.reads_tokens:
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask[:, -ids.shape[1] :]  # generation passes the mask of the cached positions too
    state.inputs = {"input_ids": ids, "attention_mask": mask if isinstance(mask, torch.Tensor) else None}
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 names it cache
    if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
        state.memory = None
    keep = kwargs.get("logits_to_keep", 0)
    state.keep = keep if isinstance(keep, int) else 0
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        return args, {**kwargs, "logits_to_keep": 0}
    return None


def route_share_hook(
    model: nn.Module, args: tuple, kwargs: dict, output: Any, *, state: RouteState
) -> ModelOutput | None:
    """Forward hook of the model: put the share of (non-padding) tokens routed to the preserve path into its output."""
    if not state.active or state.last is None or not isinstance(output, ModelOutput):
        return None
    attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    routed = state.last.base_weight.float()
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == routed.shape:
        weights = attention_mask.to(routed.dtype)
        share = (routed * weights).sum() / weights.sum().clamp_min(1)
    else:
        share = routed.mean()
    return _output_with_share(type(output))(**output, **{ROUTE_SHARE_KEY: share})


@functools.cache
def _output_with_share(output_type: type[ModelOutput]) -> type[ModelOutput]:
    """``output_type`` with the routing share as a declared field. A key merely set on the output would be lost where
    the output is taken apart and rebuilt from its fields (DDP with ``find_unused_parameters``, the Trainer's
    default, rebuilds it through torch's pytree): ``CausalLMOutputWithPast(route_preserve_share=...)`` raises."""
    field = (ROUTE_SHARE_KEY, torch.Tensor | None, dataclasses.field(default=None))
    return dataclasses.make_dataclass(
        f"{output_type.__name__}WithRouteShare", [field], bases=(output_type,), namespace={"__module__": __name__}
    )


def reorder_cache(state: RouteState, past_key_values: Any, beam_idx: torch.Tensor) -> Any:
    """Beam search: layers that hold the stacked route paths (2n rows) reorder both halves alike (and the likelihood
    router's memory its rows)."""
    if state.memory is not None:
        state.memory.reorder(beam_idx)
    if not state.stacked:
        past_key_values.reorder_cache(beam_idx)
        return past_key_values
    both = torch.cat((beam_idx, beam_idx + beam_idx.numel()))
    for index, layer in enumerate(past_key_values.layers):
        layer.reorder_cache(both if index >= state.first_stacked else beam_idx)
    return past_key_values
