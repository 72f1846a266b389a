"""SCALE-Route (paper Eq. 5) in one forward pass.

The preserve path is the same network with W12 taken as zero, so the layers below
``preserve_layers`` are identical on both paths and run once. At the first collaborative layer a
forward pre-hook (`stack_paths_hook`) stacks the batch as ``[preserve path; adapt path]`` (2B rows); from there on each
collaborative `ScaleLinear` adds its W12 product to the second half only, and the `ScaleHead`
splits the halves again and combines them per token:

    cos(Z_p, Z_a) > tau  ->  (Z_p + Z_a) / 2 + Z_p_up      (routed to the preserve path)
    otherwise            ->  Z_a + Z_a_up

The routing decision is a hard, non-differentiable choice per token, as in the paper.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Keyword arguments of a decoder layer that carry a batch dimension and must be stacked too.
_BATCHED_KWARGS = ("attention_mask", "position_ids", "position_embeddings")


def route_logits(
    z_p: torch.Tensor, z_a: torch.Tensor, z_p_up: torch.Tensor, z_a_up: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 from the original (``z``) and added (``z_up``) logit parts of the preserve and adapt paths.

    Returns the logits (B, T, V) and the mask of tokens routed to the preserve path. The vocabulary
    axis is large, so the work is kept to one pass over it per branch: the adapt branch for every
    token, then the preserve branch for the routed tokens only, written over it.
    """
    with torch.no_grad():
        p, a = z_p.float(), z_a.float()
        norms = p.norm(dim=-1) * a.norm(dim=-1)
        to_preserve = (p * a).sum(-1) / norms.clamp_min(1e-8) > tau
    logits = z_a + z_a_up
    if to_preserve.any():
        routed = (z_p[to_preserve] + z_a[to_preserve]) / 2 + z_p_up[to_preserve]
        logits = logits.index_put((to_preserve,), routed)
    return logits, to_preserve


def _stack(value: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and batch > 1:
        return torch.cat((value, value))
    if isinstance(value, tuple):
        return tuple(_stack(v, batch) for v in value)
    return value


def stack_paths_hook(
    layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of every decoder layer; acts in route mode from the first collaborative one.

    ``layer.scale_stack_paths`` is ``"start"`` at the first collaborative layer (stack the hidden
    states and the batched keyword arguments), ``"continue"`` above it (the hidden states arrive
    stacked; the model hands every layer its batched arguments afresh, so stack those again), and
    unset elsewhere. Tensors whose batch dimension is 1 broadcast and are left alone.
    """
    stage = getattr(layer, "scale_stack_paths", None)
    if stage is None:
        return None
    if args:
        hidden, args = args[0], args[1:]
    else:
        hidden = kwargs.pop("hidden_states")
    if stage == "start":
        batch, hidden = hidden.shape[0], torch.cat((hidden, hidden))
    else:
        batch = hidden.shape[0] // 2
    kwargs = {k: (_stack(v, batch) if k in _BATCHED_KWARGS else v) for k, v in kwargs.items()}
    return (hidden, *args), kwargs
