"""The likelihood router, beside Eq. 5's cosine router: route by which path explains the document so far.

The output mixes the two paths' next-token distributions, ``p = w p_base + (1 - w) p_new``, where ``p_base`` is
the base model's (SCALE-Route's preserve path ``Z_p``; SCALE-Preserve's ``Z``, and Route's without a collaborative
layer: the base's logits exactly, from the same pass) and ``p_new`` the model's own (the adapt path ``Z_a + alpha
Z_a_up``; ``Z + alpha Z_up`` on one path). ``w`` is the posterior that the document is the base's, from the
running log-likelihood ratio of the tokens read so far::

    r_t = decay * r_{t-1} + ln p_base(x_t | x_<t) - ln p_new(x_t | x_<t)     (r = 0 at a document start)
    w_t = sigmoid(prior + r_t)                                                 (mixes the prediction of x_{t+1})

the posterior mixture of `scale_cl.tuner.routing.posterior` with its prefix evidence and two experts. On a model
grown per task its experts are the nested router's (`scale_cl.tuner.routing.nested`).
"""

from __future__ import annotations

from scale_cl.tuner.routing.posterior import MixtureRouter
from scale_cl.tuner.routing.router import register_router


class LikelihoodRouter(MixtureRouter):
    """The module doc's mixture, weighed by the document's running likelihood ratio."""

    name = "likelihood"
    reads = ("router_prior", "router_decay")


register_router(LikelihoodRouter())
