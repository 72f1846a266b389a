"""The nested-stage router (issue 40): a model grown k times holds k + 1 experts in one forward pass.

SCALE-Preserve grown once per task keeps every earlier model's function exactly (Theorem 3.1 at every stage), and
its LM head reads the stages' streams side by side: with ``x = [x_0; x_1; ...; x_k]`` (the base's features, then
each stage's) and the head's columns split alike, the cumulative sums

    Z_0 = W_0 x_0,   Z_0 + Z_1,   ...,   Z_0 + ... + Z_k (alpha on the current stage's)

are the logits of the base, of the model after stage 1, ..., of the model now: nested experts, for the cost of
splitting one product. The router mixes their distributions by the posterior over experts of the document so far,
the likelihood router's rule (`scale_cl.tuner.routing.likelihood`) with k + 1 hypotheses instead of two::

    r_j,t = decay * r_j,t-1 + ln p_j(x_t | x_<t)       (r = 0 at a document start)
    w_t = softmax_j(prior_j + r_j,t)                     (prior_0 = router_prior, the others 0)
    p(x_t+1 | x_<=t) = sum_j w_j,t p_j(x_t+1 | x_<=t)

With one stage (a model upscaled once) it is the likelihood router exactly (tested). The experts are exact where
every later stage preserves (SCALE-Preserve grown per task); where a later stage's W12 wrote into earlier streams
(SCALE-Adapt), ``Z_0 + ... + Z_j`` reads stream j as the later stages left it, which is no earlier model's logits.
``last_mask`` holds the base's weight ``w_0`` (the share a route model reports); ``last_weights`` every expert's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from scale_cl.tuner.routing.likelihood import document_starts, padding_free, running_ratio
from scale_cl.tuner.routing.mixing import expert_confidence, log_normalisers, mixture_log_probs
from scale_cl.tuner.routing.router import HeadPaths, Router, register_router

if TYPE_CHECKING:
    from scale_cl.tuner.routing.state import RouteState


@dataclass
class NestedMemory:
    """What a generation step hands the next: each expert's running ratio and last position's log-probabilities."""

    ratio: torch.Tensor  # (E, B)
    last_log_probs: torch.Tensor  # (E, B, V)

    def reorder(self, index: torch.Tensor) -> None:
        self.ratio = self.ratio.index_select(1, index.to(self.ratio.device))
        self.last_log_probs = self.last_log_probs.index_select(1, index.to(self.last_log_probs.device))


# Copied to export/modeling_scale.py (nested_mix): change both (tests/test_export_copies.py).
def nested_mix(
    expert_logits: Sequence[torch.Tensor],
    input_ids: torch.Tensor | None,
    *,
    prior: float,
    decay: float,
    eos_ids: tuple[int, ...],
    attention_mask: torch.Tensor | None = None,
    memory: NestedMemory | None = None,
    increments: bool = False,
    confidence: str | None = None,
    temperature: float = 1.0,
    prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, NestedMemory | None]:
    """The mixture's log-probabilities (as logits), each expert's weight (E, B, T) and the memory for the next call.

    ``expert_logits``: E tensors (B, T, V), the base's first; ``input_ids`` (B, T) the tokens of those positions.
    ``increments``: each tensor after the first is what its expert adds to the one before (a grown model's stages,
    `nested_logits`), never summed as a whole tensor. ``confidence`` (``"entropy"`` or ``"top"``, `scale_cl.tuner.
    routing.confidence`): each expert's confidence at the position, over ``temperature``, joins its log-weight.
    ``prefix`` False: no running ratio (``r = 0``; the ids are not read and no memory is returned).
    """
    norms = log_normalisers(expert_logits, increments)  # (E, B, T): expert - norm are log-probabilities
    experts, rows, length = norms.shape
    with torch.no_grad():
        priors = torch.zeros(experts, device=norms.device)
        priors[0] = prior
        score = priors[:, None, None].expand(experts, rows, length)
        if prefix:
            ids = input_ids.to(norms.device)
            evidence = torch.zeros(experts, rows, length, device=norms.device)
            if length > 1:
                nxt = ids[:, 1:, None]
                chosen = torch.stack([z[:, :-1].gather(-1, nxt).squeeze(-1).float() for z in expert_logits])
                chosen = chosen.cumsum(0) if increments else chosen
                evidence[:, :, 1:] = chosen - norms[:, :, :-1]
            if memory is not None:
                first = ids[None, :, :1].expand(experts, -1, -1)
                evidence[:, :, :1] = memory.last_log_probs.gather(-1, first)
            evidence = padding_free(evidence, attention_mask)
            starts = document_starts(ids, eos_ids)
            initial = None if memory is None else memory.ratio.reshape(-1)
            ratio = running_ratio(evidence.reshape(-1, length), starts.repeat(experts, 1), decay, initial)
            ratio = ratio.view(experts, rows, length)
            score = score + ratio
        if confidence is not None:
            score = score + expert_confidence(expert_logits, norms, confidence, increments) / temperature
        log_w = torch.log_softmax(score, dim=0)
    mixed = mixture_log_probs(expert_logits, list(log_w - norms), increments)
    next_memory = None
    if prefix:
        last = torch.stack([z[:, -1].float() for z in expert_logits])
        last_log_probs = (last.cumsum(0) if increments else last) - norms[:, :, -1, None]
        next_memory = NestedMemory(ratio[:, :, -1].detach(), last_log_probs.detach())
    return mixed.to(expert_logits[-1].dtype), log_w.exp(), next_memory


# Copied to export/modeling_scale.py (RouteHead._nested): change both (tests/test_export.py).
def nested_logits(paths: HeadPaths, widths: Sequence[int]) -> list[torch.Tensor]:
    """The experts' logits from the head's input as increments: the base's ``Z_0``, then each stage's columns'
    product ``Z_j`` (the module doc's cumulative sums are the experts), the current stage's ``alpha Z_up`` last."""
    parts = paths.x.split(tuple(widths), dim=-1)
    columns = paths.weight.split(tuple(widths), dim=1)
    experts = [F.linear(parts[0], columns[0], paths.bias)]
    experts.extend(F.linear(x, w) for x, w in zip(parts[1:], columns[1:], strict=True))
    experts.append(paths.scaled_up_logits(paths.x_up))
    return experts


class NestedRouter(Router):
    """The module doc's mixture of a grown model's nested experts (SCALE-Preserve; one path)."""

    name = "nested"
    settings = ("router_prior", "router_decay")
    reads_tokens = True
    one_path = True

    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        if paths.stacked or paths.weight_new is not None:
            raise ValueError(
                "the nested router reads one path and the original vocabulary: SCALE-Preserve without an extended "
                "vocabulary"
            )
        experts = nested_logits(paths, state.stage_widths())
        state.keep_base(experts[0])
        ids = state.inputs.get("input_ids")
        if ids is None:
            raise ValueError("the nested router reads the input token ids: call the model with input_ids")
        logits, weights, state.memory = nested_mix(
            experts,
            ids,
            prior=state.setting("router_prior"),
            decay=state.setting("router_decay"),
            eos_ids=state.eos_ids,
            attention_mask=state.inputs.get("attention_mask"),
            memory=state.memory,
            increments=True,
        )
        state.last_cosine, state.last_mask, state.last_weights = None, weights[0], weights
        return logits


register_router(NestedRouter())
