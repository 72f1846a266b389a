"""The confidence routers: weigh the experts by how sure each is at the position it predicts, alone
(``"confidence"``: ``w_t = softmax_j(prior_j + c_j,t / T)``) or beside the prefix posterior of the likelihood routers
(``"hybrid"``: ``softmax_j(prior_j + r_j,t + c_j,t / T)``), with ``c = -H(p_j,t)`` (``router_confidence`` entropy) or
``ln max_v p_j,t(v)`` (top). Why the expected log-probability of the unread token stands in for it, and what that
assumes: docs/design.md §2, "The confidence routers". One formula for every form of experts (Route's paths,
Preserve's ``Z`` and ``Z + alpha Z_up``, a grown model's stages): `scale_cl.tuner.routing.posterior.posterior_mix`.
"""

from __future__ import annotations

from scale_cl.tuner.routing.posterior import MixtureRouter
from scale_cl.tuner.routing.router import register_router


class ConfidenceRouter(MixtureRouter):
    """The module doc's confidence router: the experts weighed by their confidence at each position alone."""

    name = "confidence"
    reads = ("router_prior", "router_confidence", "router_temperature")
    prefix = False
    confident = True


class HybridRouter(MixtureRouter):
    """The module doc's hybrid: the prefix posterior of the likelihood routers and each expert's confidence."""

    name = "hybrid"
    reads = ("router_prior", "router_decay", "router_confidence", "router_temperature")
    confident = True


register_router(ConfidenceRouter())
register_router(HybridRouter())
