"""The calibrated router: the evidence of the other mixing routers, weighed by a gate fitted to the model and its data.

Each fixed router trusts one kind of evidence by construction: the likelihood router the prefix (which separates
whole documents, not cohorts that share a template), the confidence router each expert's sureness at the position
(which says which expert is sure, not which is right), the hybrid both at a fixed exchange rate. How far each kind of
evidence can be trusted depends on the model and the data, so here the exchange rate is a gate fitted after training::

    s_j,t = prior_j + a_r r_j,t + a_H (-H(p_j,t)) + a_top ln max_v p_j,t(v)      w_t = softmax_j(s_j,t)

with ``r`` the likelihood routers' running log-likelihood (decayed by ``router_decay``, reset at EOS), ``-H`` and
``ln max p`` the confidence routers' two measures, ``prior`` on the base alone, and ``a_r``, ``a_H``, ``a_top`` the
settings ``router_prefix_weight``, ``router_entropy_weight`` and ``router_top_weight``. It holds the other routers as
special cases: ``a_r = 1, a_H = a_top = 0`` the likelihood router, ``a_r = 0`` and one confidence weight ``1 / T``
the confidence router, ``a_r = 1`` with it the hybrid. Linear in the evidence: a log-linear pool of the evidence's
posteriors, few parameters to fit, each a trust that can be read. Causal, normalised and reset at EOS as the hybrid is
(one formula: `scale_cl.tuner.routing.posterior.posterior_mix`); no gradient flows through ``w``. The experts are the
likelihood router's two or, on a grown model, the nested router's k + 1; the export computes it from its declaration.
Unfitted, its settings' defaults are the hybrid's (entropy at ``T = 1/3``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scale_cl.tuner.routing.posterior import MixtureRouter
from scale_cl.tuner.routing.router import register_router

GATE_SETTINGS = ("router_prior", "router_decay", "router_prefix_weight", "router_entropy_weight", "router_top_weight")


class CalibratedRouter(MixtureRouter):
    """The module doc's gate over the prefix's evidence and each expert's confidence."""

    name = "calibrated"
    reads = GATE_SETTINGS

    def mixture(self, setting: Callable[[str], Any]) -> dict[str, Any]:
        return {
            "prefix": True,
            "prior": setting("router_prior"),
            "decay": setting("router_decay"),
            "confidence": None,
            "prefix_weight": setting("router_prefix_weight"),
            "entropy_weight": setting("router_entropy_weight"),
            "top_weight": setting("router_top_weight"),
        }


register_router(CalibratedRouter())
