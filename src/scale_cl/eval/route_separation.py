"""Whether the likelihood router tells old questions from new ones (issue 28): the base path's weight ``w`` at the
position that predicts each answer, and the AUROC of old against new.

The weight at a prompt's last token is the one the answer's first token is predicted with (hard first-token
accuracy reads the same position), so it is what decides the router's answer: 1 = the base model's
distribution, 0 = the new path's. An AUROC of 1 means every old question gets more base weight than every new one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def routes_by_likelihood(model: nn.Module) -> bool:
    """Whether ``model``'s head mixes the base's and its own logits by the document's likelihood (the likelihood
    router: SCALE-Route's two paths, or SCALE-Preserve's ``Z`` and ``Z + alpha Z_up``; the nested router: a grown
    model's experts, the base's weight first)."""
    state = getattr(model, "scale_route", None)
    return bool(state is not None and state.reads_tokens)


@contextmanager
def collect_base_weights(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, each forward pass of ``model`` appends the base path's weight at every row's last position
    (left-padded prompts: the position that predicts the answer) to the list it yields."""
    if not routes_by_likelihood(model):
        raise ValueError(
            "the base path's weight exists only for a SCALE-Route or SCALE-Preserve model with router='likelihood'"
        )
    state, collected = model.scale_route, []

    def keep(module: nn.Module, args: tuple, output: object) -> None:
        collected.append(state.last_mask[:, -1].detach().float().cpu())

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
