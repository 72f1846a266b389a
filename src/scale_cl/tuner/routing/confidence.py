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
base and each stage's model, `scale_cl.tuner.routing.nested`): one formula, `nested_mix`, for every form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scale_cl.tuner.routing.nested import nested_logits, nested_mix
from scale_cl.tuner.routing.router import HeadPaths, Router, register_router

if TYPE_CHECKING:
    from scale_cl.tuner.routing.state import RouteState


# Copied to export/modeling_scale.py (RouteHead._confident): change both (tests/test_export.py).
def path_experts(paths: HeadPaths, state: RouteState) -> tuple[list[torch.Tensor], bool]:
    """The experts' logits from the head's input, and whether they are given as increments (`nested_mix`): the two
    stacked paths' (Route), the base's ``Z`` and ``alpha Z_up`` (one path, upscaled once: an extended vocabulary's
    new rows on both), or a grown model's nested experts."""
    if paths.stacked:
        half = paths.x.shape[0] // 2
        with torch.set_grad_enabled(torch.is_grad_enabled() and paths.weight_new is not None):
            base = paths.original_logits(paths.x[:half])
        adapt = paths.original_logits(paths.x[half:])
        return [base, torch.add(adapt, paths.up_logits(paths.x_up[half:]), alpha=paths.alpha)], False
    widths = state.stage_widths()
    if len(widths) == 1:
        return [paths.original_logits(paths.x), paths.scaled_up_logits(paths.x_up)], True
    if paths.weight_new is not None:
        raise ValueError("a grown model's nested experts are read without an extended vocabulary")
    return nested_logits(paths, widths), True


class ConfidenceRouter(Router):
    """The module doc's confidence router: the experts weighed by their confidence at each position alone."""

    name = "confidence"
    settings = ("router_prior", "router_confidence", "router_temperature")
    one_path = True
    prefix = False  # the hybrid's running ratio of the prefix

    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        experts, increments = path_experts(paths, state)
        state.keep_base(experts[0][..., : paths.vocab])
        ids = state.inputs.get("input_ids")
        if self.prefix and ids is None:
            raise ValueError(f"the {self.name} router reads the input token ids: call the model with input_ids")
        logits, weights, memory = nested_mix(
            experts,
            ids,
            prior=state.setting("router_prior"),
            decay=state.setting("router_decay"),
            eos_ids=state.eos_ids,
            attention_mask=state.inputs.get("attention_mask"),
            memory=state.memory if self.prefix else None,
            increments=increments,
            confidence=state.setting("router_confidence"),
            temperature=state.setting("router_temperature"),
            prefix=self.prefix,
        )
        state.memory = memory
        state.last_cosine, state.last_mask, state.last_weights = None, weights[0], weights
        return logits


class HybridRouter(ConfidenceRouter):
    """The module doc's hybrid: the prefix posterior of the likelihood routers and each expert's confidence."""

    name = "hybrid"
    settings = ("router_prior", "router_decay", "router_confidence", "router_temperature")
    reads_tokens = True
    prefix = True


register_router(ConfidenceRouter())
register_router(HybridRouter())
