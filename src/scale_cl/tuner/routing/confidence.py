"""The confidence routers: weigh the experts by how sure each is at the position it predicts, alone
(``"confidence"``) or beside the prefix posterior of the likelihood routers (``"hybrid"``).

The likelihood routers' posterior reads the tokens before a position. Where the old and new domains share their
text up to the answer (the biography benchmark's questions share one template), the prefix cannot tell them apart,
but each expert's own distribution at the answer can: an expert that knows the answer is sure of it. The hybrid is
the posterior over experts once the next token is counted too::

    ln w_j,t = prior_j + r_j,t + ln p_j(x_t+1 | x_<=t) + const          (the posterior after reading x_t+1)

``x_t+1`` is what the mixture predicts, so it cannot be read. Under the hypothesis that expert j is the document's,
and that each expert is *calibrated on its own domain* (there ``x_t+1 ~ p_j``), the term's expected value is
``E_{x ~ p_j} ln p_j(x) = -H(p_j,t)``: the negative entropy of its own prediction. The hybrid puts that expectation
in the term's place, tempered::

    w_t = softmax_j(prior_j + r_j,t + c_j,t / T),   c_j,t = -H(p_j,t)  (router_confidence "entropy")
                                                    c_j,t = ln max_v p_j,t(v)  ("top": the log-probability of
                                                            its own top guess, the value the term takes when
                                                            the token is the one expert j expects most)

``T`` (``router_temperature``) weighs the expected evidence against the observed: ``T = 1`` counts it as one
token's, a smaller ``T`` trusts it more (``T -> 0``: the surest expert alone). The confidence router is the same
posterior with no prefix (``r = 0``): ``w_t = softmax_j(prior_j + c_j,t / T)`` (the probe's ``exp(-3 H)`` is
``T = 1/3``). What it assumes: each expert is calibrated where it is right, and *less* sure where it is not (an
expert out of its domain that is confidently wrong wins the position); the expected term is not carried to the
next position (there the observed ``ln p_j(x_t+1)`` joins ``r`` instead). Both are causal (position t reads the
experts' distributions at t and the tokens up to x_t), normalised (a softmax over experts) and, for the hybrid,
reset at EOS as ``r`` is; ``w`` is a decision (no gradient flows through it).

The experts are the likelihood router's two (SCALE-Route's preserve path ``Z_p`` and adapt path; SCALE-Preserve's
``Z``, the base's logits, and ``Z + alpha Z_up``) or, on a model grown k times, the nested router's k + 1 (the
base and each stage's model, `scale_cl.tuner.routing.nested`): one formula, `scale_cl.tuner.routing.posterior.
posterior_mix`, for every form.
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
