"""The mixing routers' one formula: experts' next-token distributions weighed by the posterior over experts.

::

    r_j,t = decay * r_j,t-1 + ln p_j(x_t | x_<t)       (r = 0 at a document start: a sequence start, after each EOS)
    w_t = softmax_j(prior_j + r_j,t + c_j,t / T)       p(x_t+1 | x_<=t) = sum_j w_j,t p_j(x_t+1 | x_<=t)

A router is this formula with the prefix evidence ``r`` and the confidence ``c`` on or off (`MixtureRouter`);
`ExpertMemory` carries ``r`` from one ``generate()`` call to the next. Padding, EOS, the experts and an extended
vocabulary's missing rows: docs/design.md §2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from scale_cl.tuner.routing.mixing import (
    CONFIDENCES,
    expert_confidence,
    expert_statistics,
    log_normalisers,
    mixture_log_probs,
)
from scale_cl.tuner.routing.router import HeadPaths, Router
from scale_cl.tuner.routing.state import Reading, RouteState

# A token of an extended vocabulary has no row in the base: the base gives it this logit below its least, a
# probability of about e^-10000 (finite, so that masked evidence stays a number: -inf x 0 would be NaN).
MISSING_ROW_LOGIT_GAP = 1e4


# Copy in export/modeling_scale.py (with_missing_rows): the same code (tests/export/test_export_copies.py).
def with_missing_rows(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``logits`` (..., V) widened to ``vocab`` entries: each missing one `MISSING_ROW_LOGIT_GAP` below the least."""
    if logits.shape[-1] == vocab:
        return logits
    floor = logits.amin(dim=-1, keepdim=True) - MISSING_ROW_LOGIT_GAP
    return torch.cat((logits, floor.expand(*floor.shape[:-1], vocab - logits.shape[-1])), dim=-1)


# Copy in export/modeling_scale.py (running_ratio): the same code (tests/export/test_export_copies.py).
def running_ratio(
    evidence: torch.Tensor, starts: torch.Tensor, decay: float, initial: torch.Tensor | None = None, chunk: int = 64
) -> torch.Tensor:
    """``r_t = decay r_{t-1} + e_t``, set to 0 where ``starts`` (B, T) is true; ``initial``: ``r_{-1}`` per row.

    Computed ``chunk`` positions at a time (T / chunk sequential steps, not T): within a chunk ``r_t = sum_s
    decay^(t-s) e_s`` over the positions of ``t``'s own document (a start's own evidence dropped), plus the carried
    ``decay^(t-c+1) r_(c-1)`` where no document starts between the chunk's first position ``c`` and ``t``."""
    zeros = torch.zeros(evidence.shape[0], dtype=evidence.dtype, device=evidence.device)
    ratio = zeros if initial is None else initial.to(evidence.dtype)
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


# Copy in export/modeling_scale.py (padding_free): the same code (tests/export/test_export_copies.py).
def padding_free(evidence: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``evidence`` (..., B, T) with no evidence from a padded token or one whose prediction came from padding."""
    if attention_mask is None:
        return evidence
    mask = attention_mask.to(evidence.device, evidence.dtype)
    evidence = evidence * mask
    evidence[..., 1:] *= mask[:, :-1]
    return evidence


# Copy in export/modeling_scale.py (document_starts): the same code (tests/export/test_export_copies.py).
def document_starts(ids: torch.Tensor, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Where a document starts (B, T): at each EOS token (the running ratio is reset there)."""
    starts = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for eos in eos_ids:
        starts |= ids == eos
    return starts


# Copy in export/modeling_scale.py (ExpertMemory): the same code (tests/export/test_export_copies.py).
@dataclass
class ExpertMemory:
    """What a generation step hands the next: each expert's running ratio and last position's log-probabilities."""

    ratio: torch.Tensor  # (E, B)
    last_log_probs: torch.Tensor  # (E, B, V)

    def reorder(self, index: torch.Tensor) -> None:
        self.ratio = self.ratio.index_select(1, index.to(self.ratio.device))
        self.last_log_probs = self.last_log_probs.index_select(1, index.to(self.last_log_probs.device))


# Copied to export/modeling_scale.py (posterior_mix): change both (tests/export/test_export_copies.py).
def posterior_mix(
    expert_logits: Sequence[torch.Tensor],
    input_ids: torch.Tensor | None,
    *,
    prior: float,
    decay: float,
    eos_ids: tuple[int, ...],
    attention_mask: torch.Tensor | None = None,
    memory: ExpertMemory | None = None,
    increments: bool = False,
    confidence: str | None = None,
    temperature: float = 1.0,
    prefix: bool = True,
    keep: int = 0,
    prefix_weight: float = 1.0,
    entropy_weight: float = 0.0,
    top_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, ExpertMemory | None]:
    """The mixture's log-probabilities (as logits), each expert's weight (E, B, T) and the memory for the next call.

    ``expert_logits``: E tensors (B, T, V), the base's first; ``input_ids`` (B, T) the tokens of those positions.
    ``increments``: each tensor after the first is what its expert adds to the one before (SCALE-Preserve's ``alpha
    Z_up``, a grown model's stages), never summed as a whole tensor. ``confidence`` (``"entropy"`` or ``"top"``):
    each expert's confidence at the position, over ``temperature``, joins its log-weight. ``prefix`` False: no
    running ratio (``r = 0``; the ids are not read and no memory is returned). A fitted gate (the calibrated router)
    weighs its evidence instead: the running ratio by ``prefix_weight`` (1: the posterior's), the negative entropy
    by ``entropy_weight`` and the log top probability by ``top_weight``. ``keep`` > 0: the mixture of the last
    ``keep`` positions alone (B, keep, V), for a caller that reads those (``generate()``'s prefill asks for the last
    position's logits): every position's evidence takes its expert's normaliser, not its whole mixed distribution.
    """
    if confidence is not None and confidence not in CONFIDENCES:
        raise ValueError(f"an expert's confidence is one of {CONFIDENCES}, got {confidence!r}")
    weighed = {"entropy": entropy_weight, "top": top_weight}
    read = {kind for kind in CONFIDENCES if kind == confidence or weighed[kind] != 0}  # the confidences it reads
    measures = {}  # each expert's confidence by kind (E, B, T)
    if not read or (torch.is_grad_enabled() and any(z.requires_grad for z in expert_logits)):
        norms = log_normalisers(expert_logits, increments)  # (E, B, T): expert - norm are log-probabilities
        measures = {kind: expert_confidence(expert_logits, norms, kind, increments) for kind in sorted(read)}
    else:  # the normalisers and both confidences in one pass over the logits
        norms, measures = expert_statistics(expert_logits, increments)
    experts, rows, length = norms.shape
    dtype = norms.dtype  # fp32, or float64 for float64 logits
    with torch.no_grad():
        priors = torch.zeros(experts, dtype=dtype, device=norms.device)
        priors[0] = prior
        score = priors[:, None, None].expand(experts, rows, length)
        if prefix:
            ids = input_ids.to(norms.device)
            evidence = torch.zeros(experts, rows, length, dtype=dtype, device=norms.device)
            if length > 1:
                nxt = ids[:, 1:, None]
                chosen = torch.stack([z[:, :-1].gather(-1, nxt).squeeze(-1).to(dtype) for z in expert_logits])
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
            score = score + prefix_weight * ratio  # x 1 is exact: the posterior's r as it is
        if confidence is not None:
            score = score + measures[confidence] / temperature
        for kind, weight in (("entropy", entropy_weight), ("top", top_weight)):
            if weight != 0:
                score = score + weight * measures[kind]
        log_w = torch.log_softmax(score, dim=0)
    mixed, shifts = expert_logits, list(log_w - norms)
    if keep:  # the caller reads the last positions alone: the others' normalisers were all their evidence needed
        mixed, shifts = [z[..., -keep:, :] for z in expert_logits], [s[..., -keep:] for s in shifts]
    mixed = mixture_log_probs(mixed, shifts, increments)
    next_memory = None
    if prefix:
        last = torch.stack([z[:, -1].to(dtype) for z in expert_logits])
        last_log_probs = (last.cumsum(0) if increments else last) - norms[:, :, -1, None]
        next_memory = ExpertMemory(ratio[:, :, -1].detach(), last_log_probs.detach())
    return mixed.to(expert_logits[-1].dtype), log_w.exp(), next_memory


@dataclass(frozen=True)
class Evidence:
    """What the experts tell a mixing router at every position of a batch (E experts, the base first), in float32
    (float64 for float64 logits), without their whole distributions: what the calibrated router's gate is fitted on
    (`scale_cl.tuner.routing.calibrated`).

    ``next_log_probs`` (E, B, T): ``ln p_j,t(x_t+1)``, each expert's log-probability of the token that follows
    position t (0 at the last position, which predicts no token of the batch); ``neg_entropy`` and ``top`` (E, B, T):
    ``-H(p_j,t)`` and ``ln max p_j,t``; ``ids`` (B, T) the tokens; ``attention_mask`` (B, T) or None."""

    next_log_probs: torch.Tensor
    neg_entropy: torch.Tensor
    top: torch.Tensor
    ids: torch.Tensor
    attention_mask: torch.Tensor | None

    def prefix_evidence(self) -> torch.Tensor:
        """(E, B, T) ``ln p_j,t-1(x_t)``: what `posterior_mix` adds to each expert's running sum at position t (0 at
        the first position, none from padding)."""
        evidence = torch.zeros_like(self.next_log_probs)
        evidence[:, :, 1:] = self.next_log_probs[:, :, :-1]
        return padding_free(evidence, self.attention_mask)

    def predicted(self) -> torch.Tensor:
        """(B, T) the positions whose next token is in the batch and real: where a mixture's likelihood is read."""
        mask = self.attention_mask
        real = torch.ones_like(self.ids, dtype=torch.bool) if mask is None else mask.bool()
        predicted = torch.zeros_like(real)
        predicted[:, :-1] = real[:, :-1] & real[:, 1:]
        return predicted


def expert_evidence(
    expert_logits: Sequence[torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    increments: bool = False,
) -> Evidence:
    """The `Evidence` of ``expert_logits`` (as `posterior_mix` takes them) on ``input_ids``."""
    with torch.no_grad():
        experts = [z.detach() for z in expert_logits]
        norms, measures = expert_statistics(experts, increments)
        ids = input_ids.to(norms.device)
        next_log_probs = torch.zeros_like(norms)
        if ids.shape[1] > 1:
            chosen = torch.stack([z[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).to(norms.dtype) for z in experts])
            next_log_probs[:, :, :-1] = (chosen.cumsum(0) if increments else chosen) - norms[:, :, :-1]
        return Evidence(
            next_log_probs,
            measures["entropy"],
            measures["top"],
            ids,
            None if attention_mask is None else attention_mask.to(norms.device),
        )


# Copied to export/modeling_scale.py (RouteHead.experts): change both (tests/export/test_export.py).
def nested_logits(paths: HeadPaths, widths: Sequence[int]) -> list[torch.Tensor]:
    """A grown model's experts as increments: the base's ``Z_0``, then each stage's columns' product ``Z_j`` (the
    experts are their cumulative sums, `scale_cl.tuner.routing.nested`), the current stage's ``alpha Z_up`` last."""
    parts = paths.x.split(tuple(widths), dim=-1)
    columns = paths.weight.split(tuple(widths), dim=1)
    experts = [F.linear(parts[0], columns[0], paths.bias)]
    experts.extend(F.linear(x, w) for x, w in zip(parts[1:], columns[1:], strict=True))
    experts.append(paths.scaled_up_logits(paths.x_up))
    return experts


# Copied to export/modeling_scale.py (RouteHead.experts): change both (tests/export/test_export.py).
def path_experts(paths: HeadPaths, widths: Sequence[int]) -> tuple[list[torch.Tensor], bool]:
    """The experts' logits from the head's input, and whether they are given as increments (`posterior_mix`): the
    two stacked paths' (Route), the base's ``Z`` and ``alpha Z_up`` (one path, upscaled once), or a grown model's
    nested experts (``widths``: the head's original input by stage). With an extended vocabulary the experts are
    whole logits, every row included (`MixtureRouter` then takes the new tokens' mass from the base)."""
    if paths.stacked:
        half = paths.x.shape[0] // 2
        with torch.set_grad_enabled(torch.is_grad_enabled() and paths.weight_new is not None):
            base = paths.original_logits(paths.x[:half])
        adapt = paths.original_logits(paths.x[half:])
        return [base, torch.add(adapt, paths.up_logits(paths.x_up[half:]), alpha=paths.alpha)], False
    if len(widths) > 1:
        if paths.weight_new is not None:
            raise ValueError("a grown model's nested experts are read without an extended vocabulary")
        return nested_logits(paths, widths), True
    base = paths.original_logits(paths.x)
    if paths.weight_new is None:
        return [base, paths.scaled_up_logits(paths.x_up)], True
    return [base, torch.add(base, paths.up_logits(paths.x_up), alpha=paths.alpha)], False


@dataclass(frozen=True)
class MixtureReading(Reading):
    """A mixing router's reading: every expert's weight per token, ``weights`` (E, B, T), the base's first."""

    weights: torch.Tensor


class MixtureRouter(Router):
    """The module doc's mixture of the head's experts (`path_experts`); a subclass declares which evidence it reads.

    Attributes:
        prefix: the running ratio of the document so far (the router reads the input token ids).
        confident: each expert's confidence at the position (``router_confidence`` over ``router_temperature``).
    """

    prefix: ClassVar[bool] = True
    confident: ClassVar[bool] = False
    one_path = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.reads_tokens = cls.prefix

    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        experts, increments = path_experts(paths, state.stage_widths())
        state.keep_base(experts[0][..., : paths.vocab])
        if paths.weight_new is not None:  # the base has no row for an extended vocabulary's new tokens
            experts[0] = with_missing_rows(experts[0][..., : paths.weight.shape[0]], experts[0].shape[-1])
        ids = state.inputs.get("input_ids")
        if state.evidence is not None:  # what the calibrated router's gate is fitted on
            state.evidence.append(expert_evidence(experts, ids, state.inputs.get("attention_mask"), increments))
        if self.prefix and ids is None:
            raise ValueError(
                f"the {self.name} router reads the input token ids (it weighs the experts by how well each predicted "
                "them): call the model with input_ids, not inputs_embeds"
            )
        logits, weights, state.memory = posterior_mix(
            experts,
            ids if self.prefix else None,
            eos_ids=state.eos_ids,
            attention_mask=state.inputs.get("attention_mask"),
            memory=state.memory if self.prefix else None,
            increments=increments,
            keep=state.keep,
            **self.mixture(state.setting),
        )
        state.last = MixtureReading(weights[0], weights)
        return logits

    def mixture(self, setting: Callable[[str], Any]) -> dict[str, Any]:
        """`posterior_mix`'s settings for this router from the model's (``setting(name)``): what the export writes."""
        found = {"prefix": self.prefix, "prior": setting("router_prior"), "decay": 1.0, "confidence": None}
        if self.prefix:
            found["decay"] = setting("router_decay")
        if self.confident:
            found.update(confidence=setting("router_confidence"), temperature=setting("router_temperature"))
        return found


__all__ = [
    "MISSING_ROW_LOGIT_GAP",
    "Evidence",
    "ExpertMemory",
    "MixtureReading",
    "MixtureRouter",
    "document_starts",
    "expert_evidence",
    "nested_logits",
    "padding_free",
    "path_experts",
    "posterior_mix",
    "running_ratio",
    "with_missing_rows",
]
