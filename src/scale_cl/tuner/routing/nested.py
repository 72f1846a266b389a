"""The nested-stage router: a model grown k times holds k + 1 experts in one forward pass.

SCALE-Preserve grown once per task keeps every earlier model's function exactly (Theorem 3.1 at every stage), and
its LM head reads the stages' streams side by side: with ``x = [x_0; x_1; ...; x_k]`` (the base's features, then
each stage's) and the head's columns split alike, the cumulative sums

    Z_0 = W_0 x_0,   Z_0 + Z_1,   ...,   Z_0 + ... + Z_k (alpha on the current stage's)

are the logits of the base, of the model after stage 1, ..., of the model now: nested experts, for the cost of
splitting one product (`scale_cl.tuner.routing.posterior.nested_logits`). The router mixes them by the posterior
over experts of the document so far, the likelihood router's rule with k + 1 hypotheses instead of two
(`scale_cl.tuner.routing.posterior`); on a model upscaled once it is the likelihood router.

The experts are exact where every later stage preserves (SCALE-Preserve grown per task); where a later stage's W12
wrote into earlier streams (SCALE-Adapt), ``Z_0 + ... + Z_j`` reads stream j as the later stages left it, which is
no earlier model's logits. Its reading holds every expert's weight (``weights``) and the base's ``w_0`` (the share
a route model reports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scale_cl.tuner.routing.posterior import MixtureRouter
from scale_cl.tuner.routing.router import HeadPaths, register_router

if TYPE_CHECKING:
    import torch

    from scale_cl.tuner.routing.state import RouteState


class NestedRouter(MixtureRouter):
    """The module doc's mixture of a grown model's nested experts (SCALE-Preserve; one path)."""

    name = "nested"
    reads = ("router_prior", "router_decay")

    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        if paths.stacked or paths.weight_new is not None:
            raise ValueError(
                "the nested router reads one path and the original vocabulary: SCALE-Preserve without an extended "
                "vocabulary"
            )
        return super().combine(paths, state)


register_router(NestedRouter())
