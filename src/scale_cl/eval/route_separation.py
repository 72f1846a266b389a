"""Whether a mixing router (likelihood, confidence, hybrid, nested) tells old questions from new ones:
the base path's weight ``w`` at the position that predicts each answer, and the AUROC of old against new.

The weight at a prompt's last token is the one the answer's first token is predicted with (hard first-token
accuracy reads the same position), so it is what decides the router's answer: 1 = the base model's
distribution, 0 = the new path's. An AUROC of 1 means every old question gets more base weight than every new one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from scale_cl.tuner.routing.router import router_named


def mixes_experts(model: nn.Module) -> bool:
    """Whether ``model``'s head mixes the base's and its own distributions with a weight per position (the
    likelihood, confidence and hybrid routers: SCALE-Route's two paths, or SCALE-Preserve's ``Z`` and ``Z + alpha
    Z_up``; the nested router, and those on a grown model: its experts, the base's weight first), or it is the
    two-model control (`ModelMixture`)."""
    if hasattr(model, "last_base_weight"):
        return True
    state = getattr(model, "scale_route", None)
    return bool(state is not None and state.active and router_named(state.setting("router")).one_path)


def routes_by_eq5(model: nn.Module) -> bool:
    """Whether ``model`` is SCALE-Route read with Eq. 5's cosine router: its reading's ``base_weight`` is the decision
    per position (1: the preserve path), which `collect_base_weights` reads as the base's weight."""
    state = getattr(model, "scale_route", None)
    return bool(state is not None and state.active and state.setting("router") == "cosine")


def base_weight_of(model: nn.Module) -> torch.Tensor:
    """The base's weight per position ([B, T]) in ``model``'s last forward pass (`mixes_experts`)."""
    if hasattr(model, "last_base_weight"):
        weight = model.last_base_weight
    else:
        last = model.scale_route.last
        weight = None if last is None else last.base_weight
    if weight is None:
        raise RuntimeError("the router has no weights yet: they exist after a forward pass")
    return weight


@contextmanager
def collect_base_weights(model: nn.Module, every_position: bool = False) -> Iterator[list[torch.Tensor]]:
    """While open, each forward pass of ``model`` appends the base's weight at every row's last position
    (left-padded prompts: the position that predicts the answer) to the list it yields; ``every_position``: the
    weights of every position ([B, T]). For SCALE-Route read by Eq. 5 (`routes_by_eq5`) the weight is its decision,
    1 where a position goes to the preserve path."""
    if not (mixes_experts(model) or routes_by_eq5(model)):
        raise ValueError(
            "the base's weight exists only for a SCALE-Route or SCALE-Preserve model read with a mixing router "
            "(likelihood, nested, confidence, hybrid) or Eq. 5's, or for a ModelMixture"
        )
    collected: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple, output: object) -> None:
        weight = base_weight_of(model).detach().float().cpu()
        collected.append(weight if every_position else weight[:, -1])

    handle = model.register_forward_hook(keep)
    try:
        yield collected
    finally:
        handle.remove()


def auroc(positive: Sequence[float] | torch.Tensor, negative: Sequence[float] | torch.Tensor) -> float:
    """``P(a positive scores above a negative)``, ties counted half: the Mann-Whitney U statistic over
    ``n_pos n_neg`` (the area under the ROC curve)."""
    pos = torch.as_tensor(positive, dtype=torch.float64).flatten()
    neg = torch.as_tensor(negative, dtype=torch.float64).flatten()
    if not len(pos) or not len(neg):
        raise ValueError(f"AUROC needs scores of both classes, got {len(pos)} positive and {len(neg)} negative")
    scores = torch.cat((pos, neg))
    sorted_scores, order = scores.sort()
    # ranks from 1 in sorted order; tied scores share the mean of their ranks
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = mean_rank[inverse]
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


@contextmanager
def base_weights(model: nn.Module, weights: dict[str, torch.Tensor], name: str) -> Iterator[None]:
    """While open, a model read by a mixing router (`mixes_experts`) keeps its base weight per
    token of the passes made into ``weights[name]``; any other model, nothing."""
    if not mixes_experts(model):
        yield
        return
    with collect_base_weights(model, every_position=True) as collected:
        yield
    weights[name] = torch.cat([w.flatten() for w in collected])


def router_separation(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The base's mean weight per set, and per old set the AUROC of its tokens against the held-out new-domain
    tokens by that weight (1: every old token weighs the base more than every new one; 0.5: no separation)."""
    record: dict[str, Any] = {"base_weight": {name: float(w.mean()) for name, w in weights.items()}}
    if "heldout" in weights and len(weights) > 1:
        new = weights["heldout"]
        record["auroc"] = {name: auroc(w, new) for name, w in weights.items() if name != "heldout"}
    return record
