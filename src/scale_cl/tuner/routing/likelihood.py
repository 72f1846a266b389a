"""The likelihood router (issue 28, beside Eq. 5's cosine router): route by which path explains the document so far.

The output mixes the two paths' next-token distributions, ``p = w p_base + (1 - w) p_new``, where ``p_base`` is
the base model's (SCALE-Route's preserve path ``Z_p``; SCALE-Preserve's ``Z``, and Route's without a collaborative
layer: the base's logits exactly, from the same pass) and ``p_new`` the model's own (the adapt path ``Z_a + alpha
Z_a_up``; ``Z + alpha Z_up`` on one path). ``w`` is the posterior that the document is
the base's, from the running log-likelihood ratio of the tokens read so far::

    r_t = decay * r_{t-1} + ln p_base(x_t | x_<t) - ln p_new(x_t | x_<t)     (r = 0 at a document start)
    w_t = sigmoid(prior + r_t)                                                 (mixes the prediction of x_{t+1})

so ``w_t`` reads the tokens up to ``x_t`` and never the token it predicts. A document starts at the start of a
sequence and after each EOS token (``r`` is reset there). Padding (attention mask 0) adds no evidence, nor does
the first real token of a left-padded row (its prediction came from a pad position). ``w`` is a
decision, as Eq. 5's is: no gradient flows through it (each path learns where it is given weight).

In ``generate()`` with a KV cache each call sees only the new tokens: `RouterMemory` carries ``r`` and the last
position's ``ln p_base - ln p_new`` (over the vocabulary) to the next call, which reads its first token's evidence
from it; a call with an empty cache starts afresh. Beam search reorders the memory with the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from scale_cl.tuner.routing.mixing import log_normalisers, mixture_log_probs
from scale_cl.tuner.routing.router import HeadPaths, Router, register_router

if TYPE_CHECKING:
    from scale_cl.tuner.routing.state import RouteState


@dataclass
class RouterMemory:
    """What a generation step hands the next: the ratio ``r`` per row and the last position's log-ratio row."""

    ratio: torch.Tensor  # (B,)
    last_log_ratio: torch.Tensor  # (B, V): ln p_base - ln p_new of the last position, over the vocabulary

    def reorder(self, index: torch.Tensor) -> None:
        self.ratio = self.ratio.index_select(0, index.to(self.ratio.device))
        self.last_log_ratio = self.last_log_ratio.index_select(0, index.to(self.last_log_ratio.device))


# Copied to export/modeling_scale.py (running_ratio): change both (tests/test_export_copies.py).
def running_ratio(
    evidence: torch.Tensor, starts: torch.Tensor, decay: float, initial: torch.Tensor | None = None, chunk: int = 64
) -> torch.Tensor:
    """``r_t = decay r_{t-1} + e_t``, set to 0 where ``starts`` (B, T) is true; ``initial``: ``r_{-1}`` per row.

    Computed ``chunk`` positions at a time (T / chunk sequential steps, not T): within a chunk ``r_t = sum_s
    decay^(t-s) e_s`` over the positions of ``t``'s own document (a start's own evidence dropped), plus the carried
    ``decay^(t-c+1) r_(c-1)`` where no document starts between the chunk's first position ``c`` and ``t``."""
    ratio = torch.zeros(evidence.shape[0], device=evidence.device) if initial is None else initial.float()
    evidence = evidence.masked_fill(starts, 0.0)
    steps = torch.arange(chunk, device=evidence.device)
    lag = steps[:, None] - steps[None, :]
    powers = torch.where(lag >= 0, decay ** lag.clamp_min(0).to(evidence.dtype), 0.0)  # decay^(t-s), s <= t
    carry = decay ** (steps + 1).to(evidence.dtype)
    out = torch.empty_like(evidence)
    for first in range(0, evidence.shape[1], chunk):
        n = min(chunk, evidence.shape[1] - first)
        document = starts[:, first : first + n].cumsum(1)  # which document of the chunk each position is in
        weights = powers[:n, :n] * (document[:, :, None] == document[:, None, :])
        local = (weights @ evidence[:, first : first + n, None]).squeeze(-1)
        out[:, first : first + n] = local + carry[:n] * ratio[:, None] * (document == 0)
        ratio = out[:, first + n - 1]
    return out


def padding_free(evidence: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``evidence`` (..., B, T) with no evidence from a padded token or one whose prediction came from padding."""
    if attention_mask is None:
        return evidence
    mask = attention_mask.to(evidence.device, evidence.dtype)
    evidence = evidence * mask
    evidence[..., 1:] *= mask[:, :-1]
    return evidence


def document_starts(ids: torch.Tensor, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Where a document starts (B, T): at each EOS token (the running ratio is reset there)."""
    starts = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for eos in eos_ids:
        starts |= ids == eos
    return starts


# Copied to export/modeling_scale.py (likelihood_mix): change both (tests/test_export_copies.py).
def likelihood_mix(
    base_logits: torch.Tensor,
    new_logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    prior: float,
    decay: float,
    eos_ids: tuple[int, ...],
    attention_mask: torch.Tensor | None = None,
    memory: RouterMemory | None = None,
    increment: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, RouterMemory]:
    """The mixture's log-probabilities (as logits), ``w`` per position (B, T), and the memory for the next call.

    ``input_ids`` (B, T) are the tokens whose positions the logits (B, T, V) belong to; ``memory``: the previous
    call's (generation with a KV cache), or None at the start of the sequences. ``increment``: ``new_logits`` is
    what the new path adds to the base's (one path: ``alpha Z_up``), never summed as a whole tensor.
    """
    experts = (base_logits, new_logits)
    norm_base, norm_new = log_normalisers(experts, increment)
    ids = input_ids.to(base_logits.device)
    evidence = torch.zeros(ids.shape, device=base_logits.device)
    with torch.no_grad():
        if ids.shape[1] > 1:
            nxt = ids[:, 1:, None]
            base_next = base_logits[:, :-1].gather(-1, nxt).squeeze(-1).float()
            new_next = new_logits[:, :-1].gather(-1, nxt).squeeze(-1).float() + (base_next if increment else 0)
            evidence[:, 1:] = (base_next - norm_base[:, :-1]) - (new_next - norm_new[:, :-1])
        if memory is not None:
            evidence[:, 0] = memory.last_log_ratio.gather(-1, ids[:, :1]).squeeze(-1)
        evidence = padding_free(evidence, attention_mask)
        ratio = running_ratio(evidence, document_starts(ids, eos_ids), decay, None if memory is None else memory.ratio)
        score = prior + ratio
    mixed = mixture_log_probs(experts, (F.logsigmoid(score) - norm_base, F.logsigmoid(-score) - norm_new), increment)
    last_base = base_logits[:, -1].float()
    last_new = new_logits[:, -1].float() + (last_base if increment else 0)
    last_log_ratio = last_base - norm_base[:, -1, None] - (last_new - norm_new[:, -1, None])
    next_memory = RouterMemory(ratio[:, -1].detach(), last_log_ratio.detach())
    return mixed.to(new_logits.dtype), torch.sigmoid(score), next_memory


class LikelihoodRouter(Router):
    """The module doc's mixture: the preserve path's ``Z_p`` (the base's logits; ``Z`` on one path: SCALE-Preserve,
    or Route without a collaborative layer) and the adapt path's ``Z_a + alpha Z_a_up`` (``Z + alpha Z_up``),
    weighed by the document's running likelihood ratio. Its
    memory across ``generate()`` calls and the base path's weight per token (``last_mask``, a float) live in the
    model's `RouteState`."""

    name = "likelihood"
    settings = ("router_prior", "router_decay")
    reads_tokens = True
    one_path = True

    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        if paths.stacked:
            half = paths.x.shape[0] // 2
            with torch.set_grad_enabled(torch.is_grad_enabled() and paths.weight_new is not None):
                base = paths.original_logits(paths.x[:half])
            adapt = paths.original_logits(paths.x[half:])
            new = torch.add(adapt, paths.up_logits(paths.x_up[half:]), alpha=paths.alpha)
        else:  # one path (SCALE-Preserve, or no collaborative layer): its original stream is the base's
            base, new = paths.original_logits(paths.x), paths.scaled_up_logits(paths.x_up)  # new: the increment
        state.keep_base(base[..., : paths.vocab])
        ids = state.inputs.get("input_ids")
        if ids is None:
            raise ValueError(
                "the likelihood router reads the input token ids (it weighs the paths by how well each predicted "
                "them): call the model with input_ids, not inputs_embeds"
            )
        logits, weight, state.memory = likelihood_mix(
            base,
            new,
            ids,
            prior=state.setting("router_prior"),
            decay=state.setting("router_decay"),
            eos_ids=state.eos_ids,
            attention_mask=state.inputs.get("attention_mask"),
            memory=state.memory,
            increment=not paths.stacked,
        )
        state.last_cosine, state.last_mask = None, weight
        return logits


register_router(LikelihoodRouter())
