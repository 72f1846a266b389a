"""SCALE-Route (paper Eq. 5) in one forward pass.

The preserve path is the same network with W12 taken as zero, so the layers below
``preserve_layers`` are identical on both paths and run once. At the first collaborative layer a
forward pre-hook (`stack_paths_hook`) stacks the batch as ``[preserve path; adapt path]`` (2B
rows); from there on each collaborative `ScaleLinear` adds its W12 product to the second half only,
and the `ScaleHead` splits the halves again and combines them per token:

    cos(Z_p, Z_a) > tau  ->  (Z_p + Z_a) / 2 + Z_p_up      (routed to the preserve path)
    otherwise            ->  Z_a + Z_a_up

The routing decision is a hard, non-differentiable choice per token, as in the paper. Everything
route mode needs to know lives in one `RouteState` per model, which `set_method` switches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.routing.likelihood import RouterMemory, likelihood_mix

# The key of the routing share in a route model's output (left out of Trainer's evaluation outputs).
ROUTE_SHARE_KEY = "route_preserve_share"

# Keyword arguments of a decoder layer that carry a batch dimension and must be stacked too.
_BATCHED_KWARGS = ("attention_mask", "position_ids", "position_embeddings")


# Copied to export/modeling_scale.py (route_mask): change both (tests/test_export_copies.py).
def route_cosine(z_p: torch.Tensor, z_a: torch.Tensor) -> torch.Tensor:
    """``cos(Z_p, Z_a)`` per token over the vocabulary (float32, no gradient): what Eq. 5 compares with tau.

    The dot products are one batched matrix product: ``(p * a).sum(-1)`` would write a (B, T, V) product first,
    the size of the logits, for a number per token (measured: 0.4 s of a 15 s SmolLM2 step)."""
    with torch.no_grad():
        p, a = z_p.float(), z_a.float()
        norms = p.norm(dim=-1) * a.norm(dim=-1)
        return (p.unsqueeze(-2) @ a.unsqueeze(-1))[..., 0, 0] / norms.clamp_min(1e-8)


# Copied to export/modeling_scale.py (RouteHead): change both (tests/test_export_copies.py).
def route_logits(
    x: torch.Tensor,
    x_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_up: torch.Tensor,
    tau: float,
    weight_new: torch.Tensor | None = None,
    *,
    up_scale: float = 1.0,
    exact: bool = False,
    keep_preserve: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 from the stacked ``[preserve; adapt]`` head input ``[x; x_up]`` (2B rows): (logits, cosine per token).

    ``up_scale`` weighs the new stream's logits (``Z + alpha Z_up`` in both branches, `ScaleConfig.up_logit_scale`);
    ``exact`` (`ScaleConfig.route_exact`) gives a routed token the preserve path's ``Z_p`` alone, the base
    model's logits exactly, instead of ``(Z_p + Z_a) / 2 + Z_p_up``. ``keep_preserve`` is handed the preserve
    path's logits ``Z_p`` (the base model's, detached) before they are combined: the free teacher of
    `scale_cl.train.distill` (they are then not overwritten in place).

    The package's one implementation of Eq. 5 (the exported model's `modeling_scale.RouteHead` keeps a
    standalone copy, tested equal). ``weight_new``: an extended vocabulary's new token rows
    (`scale_cl.tuner.vocab`); their logits are appended to both paths' and combined alike, and the cosine reads
    the original vocabulary's logits alone, so a token routes as it would without the extension.

    Tensors over the vocabulary (B, T, V) dominate the head's time and memory, so they are few and
    touched only by in-place elementwise passes: no boolean gather / ``index_put`` (slow, and their
    backward scatters into zero-filled full-size tensors), no fresh full-size temporaries.

    - ``Z_up = W_up x_up`` is linear, so picking ``Z_p_up`` or ``Z_a_up`` per token is picking
      ``x_up`` per token: W_up runs on B rows instead of 2B.
    - ``(Z_p + Z_a) / 2`` is ``Z_a / 2 + Z_p / 2`` bitwise (halving is exact), so the combination is
      ``c * Z_a + (routed ? Z_p / 2 : 0)`` with ``c`` 1/2 or 1 per token, written into Z_a's buffer
      (``masked_fill`` rather than a multiply by 0, so a non-finite Z_p of an unrouted token stays out).
    - Without new rows the preserve path's original logits depend on no trainable parameter (its stream
      never meets W12, and every original weight is frozen): no gradient is taken for them. New rows feed
      the original stream of both paths, so then the preserve path keeps its gradient.
    """
    half = x.shape[0] // 2
    x_p, x_a = x[:half], x[half:]
    with torch.set_grad_enabled(torch.is_grad_enabled() and weight_new is not None):
        z_p = F.linear(x_p, weight, bias)
    z_a = F.linear(x_a, weight, bias)
    cosine = route_cosine(z_p, z_a)
    if keep_preserve is not None:
        keep_preserve(z_p.detach())
    if weight_new is not None:
        z_p = torch.cat((z_p, F.linear(x_p, weight_new)), dim=-1)
        z_a = torch.cat((z_a, F.linear(x_a, weight_new)), dim=-1)
    keep = (cosine > tau)[..., None]
    preserve_part = z_p.masked_fill(~keep, 0) if keep_preserve is not None else z_p.masked_fill_(~keep, 0)
    if exact:  # routed: 0 + Z_p + alpha W_up 0 = Z_p exactly; otherwise Z_a + 0 + alpha Z_a_up
        x_up = x_up[half:].masked_fill(keep, 0)
        logits = z_a.masked_fill_(keep, 0).add_(preserve_part)
    else:
        x_up = torch.where(keep, x_up[:half], x_up[half:])
        scale = torch.where(keep, 0.5, 1.0).to(z_a.dtype)
        logits = z_a.mul_(scale).add_(preserve_part, alpha=0.5)
    return logits.add_(F.linear(x_up, weight_up), alpha=up_scale), cosine


# Copied to export/modeling_scale.py (_stack): change both (tests/test_export_copies.py).
def _stack(value: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and batch > 1:
        return torch.cat((value, value))
    if isinstance(value, tuple):
        return tuple(_stack(v, batch) for v in value)
    return value


class RouteState:
    r"""SCALE-Route's state on one upscaled model: the one object every part of route mode reads.

    `upscale` creates it (``model.scale_route``) and hands it to the modules that act on it: the
    decoder layers' stacking pre-hooks (`stack_paths_hook`), the collaborative `ScaleLinear`\ s (W12
    on the adapt half only), the `ScaleHead` (Eq. 5) and the model's output hook
    (`route_share_hook`). `set_method` switches it on (``"route"``) and off (any other method);
    while off, every module behaves as if route did not exist.

    Attributes:
        settings: the model's ``config.scale_cl``, whose ``ScaleConfig`` holds ``route_tau``: tau's one home,
            so the threshold routing uses is the one saved, reloaded and exported (`tau`).
        active: route mode is on.
        first_stacked: the first collaborative decoder layer, from which the batch runs as
            ``[preserve path; adapt path]`` (2B rows); None when no layer is collaborative (both paths
            are one network and nothing is stacked).
        last_mask: the routing decision of the last forward pass (tokens sent to the preserve path).
        last_cosine: ``cos(Z_p, Z_a)`` per token of the last forward pass (what calibrating tau reads,
            `scale_cl.train.route_calibration`).
        capture_base: while set, the head keeps the base model's logits of each forward pass in
            ``base_logits`` (SCALE-Preserve's ``Z``, SCALE-Route's ``Z_p``; the free teacher of
            `scale_cl.train.distill`, which sets and clears it).
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.active = False
        self.first_stacked: int | None = None
        self.last_mask: torch.Tensor | None = None
        self.last_cosine: torch.Tensor | None = None
        self.capture_base = False
        self.base_logits: torch.Tensor | None = None
        # the likelihood router (`scale_cl.tuner.routing.likelihood`): this call's tokens, the previous call's memory
        self.inputs: dict[str, Any] = {}
        self.memory: RouterMemory | None = None
        self.eos_ids: tuple[int, ...] = ()

    def mix(self, base_logits: torch.Tensor, new_logits: torch.Tensor) -> torch.Tensor:
        """The likelihood router's mixture of the two paths for this call's tokens (`likelihood_mix`); keeps its
        memory for the next call and the base path's weight per token in ``last_mask`` (a float, for the share)."""
        ids = self.inputs.get("input_ids")
        if ids is None:
            raise ValueError(
                "the likelihood router reads the input token ids (it weighs the paths by how well each predicted "
                "them): call the model with input_ids, not inputs_embeds"
            )
        config = self.settings["config"]
        logits, weight, self.memory = likelihood_mix(
            base_logits,
            new_logits,
            ids,
            prior=config["router_prior"],
            decay=config["router_decay"],
            eos_ids=self.eos_ids,
            attention_mask=self.inputs.get("attention_mask"),
            memory=self.memory,
        )
        self.last_cosine, self.last_mask = None, weight
        return logits

    def keep_base(self, logits: torch.Tensor) -> None:
        """The head's hand-over of the base model's logits (kept only while ``capture_base`` is set)."""
        if self.capture_base:
            self.base_logits = logits.detach()

    @property
    def tau(self) -> float:
        """The cosine threshold of Eq. 5: the model's ``ScaleConfig.route_tau``."""
        return self.settings["config"]["route_tau"]

    @tau.setter
    def tau(self, value: float) -> None:
        config = ScaleConfig.from_dict({**self.settings["config"], "route_tau": value})  # checked there
        self.settings["config"] = config.to_dict()

    def switch(self, active: bool, first_stacked: int | None) -> None:
        self.active = active
        self.first_stacked = first_stacked if active else None
        self.last_mask = self.last_cosine = None

    def record(self, cosine: torch.Tensor) -> torch.Tensor:
        """Keep a forward pass's cosines and its routing decision (``cosine > tau``); returns the decision."""
        self.last_cosine, self.last_mask = cosine, cosine > self.tau
        return self.last_mask

    @property
    def stacked(self) -> bool:
        """Whether the head receives the stacked ``[preserve; adapt]`` batch."""
        return self.active and self.first_stacked is not None


# Copied to export/modeling_scale.py (stack_paths): change both (tests/test_export_copies.py).
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


# Copied to export/modeling_scale.py (capture_router_inputs): change both (tests/test_export_copies.py).
def capture_inputs_hook(model: nn.Module, args: tuple, kwargs: dict, *, state: RouteState) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the model: the likelihood router's view of the call (its token ids, the attention mask
    of its positions) and, for a call that starts new sequences (no KV cache yet), a fresh router memory.

    The router reads every position's logits (each is evidence for the next), so a call that asks for the last
    positions' only (``logits_to_keep``, as ``generate()``'s prefill does) gets all of them.
    """
    if not state.active or state.settings["config"].get("router", "cosine") != "likelihood":
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask[:, -ids.shape[1] :]  # generation passes the mask of the cached positions too
    state.inputs = {"input_ids": ids, "attention_mask": mask if isinstance(mask, torch.Tensor) else None}
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 names it cache
    if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
        state.memory = None
    if kwargs.get("logits_to_keep", 0) != 0:
        return args, {**kwargs, "logits_to_keep": 0}
    return None


def route_share_hook(
    model: nn.Module, args: tuple, kwargs: dict, output: Any, *, state: RouteState
) -> ModelOutput | None:
    """Forward hook of the model: put the share of (non-padding) tokens routed to the preserve path into its output."""
    mask = state.last_mask
    if not state.active or mask is None or not isinstance(output, ModelOutput):
        return None
    attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    routed = mask.float()
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == mask.shape:
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
