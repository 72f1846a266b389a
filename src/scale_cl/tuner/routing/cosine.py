"""Eq. 5, the paper's router: each token goes to the preserve path when its two paths' logits agree.

    cos(Z_p, Z_a) > tau  ->  (Z_p + Z_a) / 2 + Z_p_up      (routed to the preserve path)
    otherwise            ->  Z_a + Z_a_up

(with ``route_exact`` a routed token gets ``Z_p`` alone, the base model's logits). The decision is hard and
non-differentiable per token, as in the paper. tau is the model's ``ScaleConfig.route_tau``, set on a live model
with `scale_cl.tuner.modes.set_live_settings` (or ``set_method(model, "route", tau=...)``, which calls it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from scale_cl.tuner.routing.router import HeadPaths, Router, register_router
from scale_cl.tuner.routing.state import Reading, RouteState


# Copied to export/modeling_scale.py (route_mask): change both (tests/export/test_export_copies.py).
def route_cosine(z_p: torch.Tensor, z_a: torch.Tensor) -> torch.Tensor:
    """``cos(Z_p, Z_a)`` per token over the vocabulary (float32, no gradient): what Eq. 5 compares with tau.

    The dot products are one batched matrix product, not a (B, T, V) elementwise product (docs/design.md §1.4)."""
    with torch.no_grad():
        p, a = z_p.float(), z_a.float()
        norms = p.norm(dim=-1) * a.norm(dim=-1)
        return (p.unsqueeze(-2) @ a.unsqueeze(-1))[..., 0, 0] / norms.clamp_min(1e-8)


# Copied to export/modeling_scale.py (RouteHead): change both (tests/export/test_export_copies.py).
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


@dataclass(frozen=True)
class CosineReading(Reading):
    """Eq. 5's reading: ``cosine`` ``cos(Z_p, Z_a)`` per token (what calibrating tau reads,
    `scale_cl.train.route_calibration`) and ``routed`` (``cosine > tau``), the tokens sent to the preserve path."""

    cosine: torch.Tensor
    routed: torch.Tensor


def decide(state: RouteState, cosine: torch.Tensor) -> torch.Tensor:
    """Eq. 5's decision from the cosines (``cosine > route_tau``), kept as the model's reading; returns it."""
    routed = cosine > state.setting("route_tau")
    state.last = CosineReading(routed.float(), cosine, routed)
    return routed


class CosineRouter(Router):
    """Eq. 5 (module doc): `route_logits` on the stacked paths; without a collaborative layer both paths are one
    network and both branches ``Z + Z_up`` (or ``Z`` alone for a routed token with ``route_exact``)."""

    name = "cosine"
    reads = ("route_tau", "route_exact")

    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        exact = state.setting("route_exact")
        if not paths.stacked:
            z, z_up = paths.original_logits(paths.x), paths.up_logits(paths.x_up)
            state.keep_base(z[..., : paths.vocab])
            keep = decide(state, route_cosine(z, z))
            return torch.add(z, z_up.masked_fill(keep[..., None], 0) if exact else z_up, alpha=paths.alpha)
        logits, cosine = route_logits(
            paths.x,
            paths.x_up,
            paths.weight,
            paths.bias,
            paths.weight_up,
            state.setting("route_tau"),
            paths.weight_new,
            up_scale=paths.alpha,
            exact=exact,
            keep_preserve=state.keep_base if state.capture_base else None,
        )
        decide(state, cosine)
        return logits

    def mixture(self, setting: Callable[[str], Any]) -> None:
        """None: the export computes Eq. 5 itself, from ``route_tau`` and ``route_exact``."""
        return None


register_router(CosineRouter())
