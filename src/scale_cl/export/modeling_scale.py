"""A SCALE-upscaled causal LM as a stock transformers model: the modeling code of an exported folder.

Written by ``scale-cl export`` (arXiv 2511.03270) next to ``config.json`` and the merged weights, and loaded with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``; it imports only torch and transformers. The
stock classes compute the upscaled model with the split norms swapped into the base model and, for SCALE-Route or a
mixing router (``scale_mixture``), a head that combines two paths or mixes experts per token (`RouteHead`).
transformers' ``generate`` serves every export; vLLM's Transformers backend serves those whose head is one plain
linear (``scale_vllm_servable``: SCALE-Preserve and SCALE-Adapt without a mixing router). The design: scale-cl's
docs/design.md §7, "Exported models merge the blocks".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
)

# Keyword arguments of a decoder layer that carry the batch dimension: stacked with the hidden states.
BATCHED_KWARGS = ("attention_mask", "position_ids", "position_embeddings")


# Copy of scale_cl.tuner.layers.SplitNorm, rewritten standalone;
# tested equal by tests/export/test_export.py::test_grown_models_are_exported.
def norm_groups(width: int, split: int, up_norm: str, earlier: list | None = None) -> list[tuple[int, int, int, int]]:
    """The spans a SCALE norm normalises apart, each with the span whose statistic it takes: ``(start, end,
    ref_start, ref_end)``. First the original stream ``[0, d)`` (its own), then each grown stage's group
    (``earlier``: ``[width, up_norm]`` per earlier stage of a model grown more than once) and last ``x_up``
    ``[split, width)`` with ``up_norm``: ``"own"`` its own statistic, ``"original"`` that of everything before it,
    ``"joint"`` that of everything up to its end."""
    sizes = [(width_j, mode) for width_j, mode in earlier or []]
    d = split - sum(width_j for width_j, _ in sizes)
    groups, start = [(0, d, 0, d)], d
    for size, mode in [*sizes, (width - split, up_norm)]:
        ref = {"own": (start, start + size), "original": (0, start), "joint": (0, start + size)}[mode]
        groups.append((start, start + size, *ref))
        start += size
    return groups


# Copy of scale_cl.tuner.layers.SplitNorm, rewritten standalone;
# tested equal by tests/export/test_export.py::test_scale_export_loads_without_scale_cl_and_matches.
class SplitRMSNormGroups(nn.Module):
    """RMSNorm over ``x`` (the first ``split`` features) and over ``x_up`` (the rest) separately (on a grown model
    over each stage's group, `norm_groups`).

    ``weight`` is the gains concatenated, so the parameter keeps the stock name and shape. The
    arithmetic is transformers' LlamaRMSNorm's on each part (float32 statistics). The class name must not end in
    "RMSNorm": vLLM's Transformers backend replaced every such module with its own RMSNorm over the whole width (its
    newer versions match the computation instead, which this one's per-group statistics do not).
    """

    def __init__(
        self, hidden_size: int, split: int, eps: float = 1e-6, up_norm: str = "own", earlier: list | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.groups, self.variance_epsilon = norm_groups(hidden_size, split, up_norm, earlier), eps

    def _inverse_rms(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = [
            hidden[..., start:end].to(torch.float32) * self._inverse_rms(hidden[..., ref_start:ref_end])
            for start, end, ref_start, ref_end in self.groups
        ]
        return self.weight * torch.cat(parts, dim=-1).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"{'+'.join(str(end - start) for start, end, _, _ in self.groups)}, eps={self.variance_epsilon}"


# Copy of scale_cl.tuner.layers.SplitNorm, rewritten standalone;
# tested equal by tests/export/test_export.py::test_scale_export_loads_without_scale_cl_and_matches.
class SplitLayerNorm(nn.Module):
    """LayerNorm (with bias) over ``x`` (the first ``split`` features) and over ``x_up`` separately (on a grown
    model over each stage's group, `norm_groups`); a group that takes another span's statistic (``up_norm``
    ``"original"`` or ``"joint"``) is divided by that span's standard deviation instead (not centred)."""

    def __init__(
        self, hidden_size: int, split: int, eps: float = 1e-5, up_norm: str = "own", earlier: list | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.groups, self.eps = norm_groups(hidden_size, split, up_norm, earlier), eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = []
        for start, end, ref_start, ref_end in self.groups:
            x, w, b = hidden[..., start:end], self.weight[start:end], self.bias[start:end]
            if (ref_start, ref_end) == (start, end):
                parts.append(F.layer_norm(x, (end - start,), w, b, self.eps))
            else:  # over another span's standard deviation, not centred
                ref = hidden[..., ref_start:ref_end].to(torch.float32)
                scale = torch.rsqrt(ref.var(-1, unbiased=False, keepdim=True) + self.eps)
                parts.append((x.to(torch.float32) * scale).to(x.dtype) * w + b)
        return torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return f"{'+'.join(str(end - start) for start, end, _, _ in self.groups)}, eps={self.eps}"


# Copy of scale_cl.tuner.layers.ScaleLinear, rewritten standalone;
# tested equal by tests/export/test_export.py::test_scale_export_loads_without_scale_cl_and_matches.
class TwoPathLinear(nn.Linear):
    """A linear of a route layer: its input is ``[preserve path; adapt path]`` (2B rows).

    ``weight`` is the block matrix ``[[W, W12], [W21, W22]]``; the adapt half takes all of it, the
    preserve half the same matrix with W12 taken as zero, computed from views of ``weight`` (nothing is
    stored twice): ``[W x; [W21 W22] [x; x_up]]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, original_in: int, original_out: int) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.original_in, self.original_out = original_in, original_out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        half = hidden.shape[0] // 2
        preserve, adapt = hidden[:half], hidden[half:]
        i, o = self.original_in, self.original_out
        top_bias, bottom_bias = (None, None) if self.bias is None else (self.bias[:o], self.bias[o:])
        top = F.linear(preserve[..., :i], self.weight[:o, :i], top_bias)
        bottom = F.linear(preserve, self.weight[o:], bottom_bias)
        return torch.cat((torch.cat((top, bottom), dim=-1), F.linear(adapt, self.weight, self.bias)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, original in={self.original_in}, out={self.original_out}"


# Copy of scale_cl.tuner.routing.cosine.route_cosine, rewritten standalone;
# tested equal by tests/export/test_export.py::test_exported_route_head_is_the_packages_eq5.
def route_mask(z_p: torch.Tensor, z_a: torch.Tensor, tau: float) -> torch.Tensor:
    """Tokens sent to the preserve path: ``cos(Z_p, Z_a) > tau`` over the vocabulary (float32)."""
    p, a = z_p.float(), z_a.float()
    norms = p.norm(dim=-1) * a.norm(dim=-1)
    return (p.unsqueeze(-2) @ a.unsqueeze(-1))[..., 0, 0] / norms.clamp_min(1e-8) > tau


CPU_CHUNK_ELEMENTS = 2**17  # as scale_cl.tuner.routing.mixing's: a CPU chunk's elements per expert
ACCELERATOR_CHUNK_ELEMENTS = 2**24  # a GPU's


# Copy of scale_cl.tuner.routing.mixing.chunk_rows: the same code.
def chunk_rows(vocab: int, device: torch.device) -> int:
    """Positions per chunk of a mixture over ``vocab`` entries on ``device``."""
    elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // vocab)


# Copy of scale_cl.tuner.routing.mixing.log_normalisers: the same code.
def log_normalisers(experts: Sequence[torch.Tensor], increments: bool = False) -> torch.Tensor:
    """Each expert's ``logsumexp`` over the last dimension, stacked (E, ...), in fp32, a CPU chunk of positions at a
    time unless a gradient is needed: ``z_j - log_normalisers(...)[j]`` are expert j's log-probabilities.

    ``increments``: ``experts`` are the first expert's logits and each next one's increment (module doc)."""
    dtype = torch.promote_types(experts[0].dtype, torch.float32)
    if torch.is_grad_enabled() and any(z.requires_grad for z in experts):
        summed = accumulate(z.to(dtype) for z in experts) if increments else (z.to(dtype) for z in experts)
        return torch.stack([torch.logsumexp(z, dim=-1) for z in summed])
    vocab = experts[0].shape[-1]
    flat = [z.reshape(-1, vocab) for z in experts]
    out = torch.empty(len(flat), flat[0].shape[0], dtype=dtype, device=flat[0].device)
    rows = chunk_rows(vocab, out.device)
    for first in range(0, out.shape[1], rows):
        part = slice(first, first + rows)
        running = flat[0][part].to(dtype)
        out[0, part] = torch.logsumexp(running, dim=-1)
        for index, z in enumerate(flat[1:], start=1):
            running = running + z[part] if increments else z[part].to(dtype)
            out[index, part] = torch.logsumexp(running, dim=-1)
    return out.view(len(flat), *experts[0].shape[:-1])


# Copy of scale_cl.tuner.routing.mixing.mixture_log_probs: the same code.
def mixture_log_probs(
    experts: Sequence[torch.Tensor], shifts: Sequence[torch.Tensor], increments: bool = False
) -> torch.Tensor:
    """``log sum_j exp(z_j + shift_j)`` (fp32, the logits' shape) for E >= 2 experts' logits ``z_j`` (..., V) and
    shifts (...): with ``shift_j = log w_j - log_normalisers(...)[j]``, the log of the mixture ``sum_j w_j
    softmax(z_j)``. Summed by ``logaddexp``, so no term under- or overflows and an entry every expert rules out
    stays ``-inf``. ``increments``: ``experts`` are the first expert's logits and each next one's increment."""
    inputs = [*experts, *shifts]
    dtype = torch.promote_types(experts[0].dtype, torch.float32)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        summed = accumulate(z.to(dtype) for z in experts) if increments else (z.to(dtype) for z in experts)
        terms = torch.stack([z + s[..., None] for z, s in zip(summed, shifts, strict=True)])
        return torch.logsumexp(terms, dim=0)
    vocab = experts[0].shape[-1]
    flat = [z.reshape(-1, vocab) for z in experts]
    columns = [s.reshape(-1, 1).to(dtype) for s in shifts]
    out = torch.empty(flat[0].shape, dtype=dtype, device=flat[0].device)
    rows = chunk_rows(vocab, out.device)
    for first in range(0, out.shape[0], rows):
        part = slice(first, first + rows)
        total = out[part]
        if increments:  # z_0 + log(e^(s_0) + e^(s_1 + d_1) + e^(s_2 + d_1 + d_2) + ...): z_0 added last
            running = flat[1][part].to(dtype)
            torch.logaddexp(running + columns[1][part], columns[0][part], out=total)
            for z, shift in zip(flat[2:], columns[2:], strict=True):
                running = running + z[part]
                torch.logaddexp(total, running + shift[part], out=total)
            total.add_(flat[0][part])
        else:
            torch.add(flat[0][part], columns[0][part], out=total)
            for z, shift in zip(flat[1:], columns[1:], strict=True):
                torch.logaddexp(total, z[part].to(dtype) + shift[part], out=total)
    return out.view(experts[0].shape)


# Copy of scale_cl.tuner.routing.posterior.running_ratio: the same code.
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


# Copy of scale_cl.tuner.routing.posterior.padding_free: the same code.
def padding_free(evidence: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``evidence`` (..., B, T) with no evidence from a padded token or one whose prediction came from padding."""
    if attention_mask is None:
        return evidence
    mask = attention_mask.to(evidence.device, evidence.dtype)
    evidence = evidence * mask
    evidence[..., 1:] *= mask[:, :-1]
    return evidence


# Copy of scale_cl.tuner.routing.posterior.document_starts: the same code.
def document_starts(ids: torch.Tensor, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Where a document starts (B, T): at each EOS token (the running ratio is reset there)."""
    starts = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for eos in eos_ids:
        starts |= ids == eos
    return starts


MISSING_ROW_LOGIT_GAP = 1e4  # as scale_cl.tuner.routing.posterior's: a base's logit below its least for a new token


# Copy of scale_cl.tuner.routing.posterior.with_missing_rows: the same code.
def with_missing_rows(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``logits`` (..., V) widened to ``vocab`` entries: each missing one ``MISSING_ROW_LOGIT_GAP`` below the least."""
    if logits.shape[-1] == vocab:
        return logits
    floor = logits.amin(dim=-1, keepdim=True) - MISSING_ROW_LOGIT_GAP
    return torch.cat((logits, floor.expand(*floor.shape[:-1], vocab - logits.shape[-1])), dim=-1)


CONFIDENCES = ("entropy", "top")  # what an expert's confidence at a position is read as (`expert_confidence`)


# Copy of scale_cl.tuner.routing.mixing.expert_confidence: the same code.
def expert_confidence(
    experts: Sequence[torch.Tensor], norms: torch.Tensor, kind: str, increments: bool = False
) -> torch.Tensor:
    """Each expert's confidence at every position (E, ...): ``"entropy"`` its distribution's negative entropy,
    ``"top"`` the log of its top probability. ``norms``: the experts' ``log_normalisers``."""
    if kind not in CONFIDENCES:
        raise ValueError(f"an expert's confidence is one of {CONFIDENCES}, got {kind!r}")
    vocab = experts[0].shape[-1]
    flat = [z.detach().reshape(-1, vocab) for z in experts]
    flat_norms = norms.detach().reshape(len(flat), -1)
    dtype = torch.promote_types(experts[0].dtype, torch.float32)
    out = torch.empty(flat_norms.shape, dtype=dtype, device=flat[0].device)
    rows = chunk_rows(vocab, out.device)
    for first in range(0, out.shape[1], rows):
        part = slice(first, first + rows)
        running = None
        for index, z in enumerate(flat):
            running = running + z[part] if increments and running is not None else z[part].to(dtype)
            if kind == "top":
                out[index, part] = running.amax(dim=-1) - flat_norms[index, part]
            else:
                log_p = running - flat_norms[index, part, None]
                p = log_p.exp()  # a ruled-out entry (p = 0, ln p = -inf) adds 0, not NaN
                out[index, part] = torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)
    return out.view(norms.shape)


# Copy of scale_cl.tuner.routing.mixing.expert_statistics: the same code.
def expert_statistics(
    experts: Sequence[torch.Tensor], increments: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`log_normalisers` and both `expert_confidence` measures (E, ...) in one pass over the logits, no gradient:
    with ``m`` a row's largest logit and ``s = sum_v e^(z_v - m)``, the normaliser is ``m + ln s``, the log top
    probability ``-ln s`` and the negative entropy ``sum_v e^(z_v - m) (z_v - m) / s - ln s``, all from one
    exponential of the row (a chunk of positions at a time, in cache) instead of three passes through memory."""
    vocab = experts[0].shape[-1]
    flat = [z.detach().reshape(-1, vocab) for z in experts]
    dtype = torch.promote_types(experts[0].dtype, torch.float32)
    out = torch.empty(3, len(flat), flat[0].shape[0], dtype=dtype, device=flat[0].device)
    rows = chunk_rows(vocab, out.device)
    for first in range(0, out.shape[2], rows):
        part = slice(first, first + rows)
        running = None
        for index, z in enumerate(flat):
            running = running + z[part] if increments and running is not None else z[part].to(dtype)
            top = running.amax(dim=-1, keepdim=True)
            shifted = running - top
            weights = shifted.exp()
            total = weights.sum(dim=-1)
            log_sum = total.log()
            out[0, index, part] = top.squeeze(-1) + log_sum
            shifted.clamp_min_(torch.finfo(dtype).min)  # a ruled-out entry (weight 0, -inf) adds 0, not NaN
            out[1, index, part] = torch.linalg.vecdot(weights, shifted) / total - log_sum
            out[2, index, part] = -log_sum
    shape = (len(flat), *experts[0].shape[:-1])
    return out[0].view(shape), {"entropy": out[1].view(shape), "top": out[2].view(shape)}


# Copy of scale_cl.tuner.routing.posterior.ExpertMemory: the same code.
@dataclass
class ExpertMemory:
    """What a generation step hands the next: each expert's running ratio and last position's log-probabilities."""

    ratio: torch.Tensor  # (E, B)
    last_log_probs: torch.Tensor  # (E, B, V)

    def reorder(self, index: torch.Tensor) -> None:
        self.ratio = self.ratio.index_select(1, index.to(self.ratio.device))
        self.last_log_probs = self.last_log_probs.index_select(1, index.to(self.last_log_probs.device))


# Copy of scale_cl.tuner.routing.posterior.posterior_mix: the same code.
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
    """``p = sum_j w_j p_j`` over the experts (the base's logits first) as log-probabilities, with ``w_t =
    softmax_j(prior_j + r_j,t + c_j,t / temperature)`` (``prior_0 = prior``, the others 0), ``r_j,t = decay
    r_j,t-1 + ln p_j(x_t)`` (0 at a sequence start and at EOS; no evidence from padding; 0 throughout without
    ``prefix``) and ``c`` each expert's ``confidence`` at the position (none when None), or a fitted gate's
    ``prefix_weight r_j,t - entropy_weight H_j,t + top_weight ln max p_j,t``; returns it, every expert's
    weight (E, B, T) and the memory for the next call (None without ``prefix``). ``increments``: each tensor after
    the first is what its expert adds to the one before. ``keep`` > 0: the mixture of the last ``keep`` positions
    alone (what ``logits_to_keep`` asked for)."""
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


# Copy of scale_cl.tuner.routing.state.capture_inputs_hook, rewritten standalone;
# tested equal by tests/export/test_export.py::test_the_likelihood_router_is_exported.
def capture_router_inputs(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a likelihood-routed model: hands the head this call's token ids and the mask of their
    positions, starts a fresh memory for a call with an empty KV cache, and asks for every position's logits
    (each is evidence for the next); the head mixes the last ``logits_to_keep`` positions alone."""
    head = model.get_output_embeddings()
    ids = kwargs.get("input_ids", args[0] if args else None)
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask[:, -ids.shape[1] :]  # generation passes the mask of the cached positions too
    head.inputs = {"input_ids": ids, "attention_mask": mask if isinstance(mask, torch.Tensor) else None}
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
        head.memory = None
    keep = kwargs.get("logits_to_keep", 0)
    head.keep = keep if isinstance(keep, int) else 0
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        return args, {**kwargs, "logits_to_keep": 0}
    return None


# Copy of scale_cl.tuner.routing.cosine.route_logits, rewritten standalone;
# tested equal by tests/export/test_export.py::test_exported_route_head_is_the_packages_eq5.
class RouteHead(nn.Linear):
    """The LM head of a model that mixes at the logits: Eq. 5 over ``[preserve path; adapt path]`` (2B rows in, B
    rows out), or a mixing router's posterior mixture of experts (``scale_mixture``).

    With ``Z = W_out x`` and ``Z_up = W_out_up x_up`` (``weight`` is ``[W_out, W_out_up]``), per token (Eq. 5)::

        cos(Z_p, Z_a) > tau  ->  (Z_p + Z_a) / 2 + Z_p_up     (Z_p alone with scale_route_exact)
        otherwise            ->  Z_a + Z_a_up

    ``tau`` is the config's ``scale_route_tau`` (read at every forward: one value, the one saved). The cosine
    reads the first ``scale_route_vocab_size`` logits (the vocabulary before an extension; 0: all).
    ``last_mask`` keeps the last decision (True: preserve path). A standalone copy of scale-cl's
    ``route_logits`` (this file must import nothing but torch and transformers), tested equal to it.

    With ``scale_mixture`` (what scale-cl's mixing router declared: its evidence and settings) the experts
    (`experts`) are mixed by `posterior_mix`; ``last_weight`` keeps the base's weight per token. ``stacked=False``
    (SCALE-Preserve, or Route without a collaborative layer): one path, whose ``Z`` is the base's logits.
    """

    def __init__(self, in_features: int, out_features: int, config: Any, stacked: bool = True) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.config = config
        self.split = config.scale_hidden_size
        self.route_vocab_size = config.scale_route_vocab_size or out_features
        self.stacked = stacked
        self.last_mask: torch.Tensor | None = None
        self.last_weight: torch.Tensor | None = None
        self.inputs: dict[str, Any] = {}  # a prefix-reading router's: this call's token ids and mask
        self.memory: ExpertMemory | None = None
        self.keep = 0  # the last positions this call's caller reads (``logits_to_keep``), 0: all

    @property
    def tau(self) -> float:
        return self.config.scale_route_tau

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.scale_mixture is not None:
            return self._mix(hidden)
        half, d = hidden.shape[0] // 2, self.split
        x, x_up = hidden[..., :d], hidden[..., d:]
        w_out, w_up = self.weight[:, :d], self.weight[:, d:]
        z_p, z_a = F.linear(x[:half], w_out), F.linear(x[half:], w_out)
        vocab = self.route_vocab_size
        with torch.no_grad():
            self.last_mask = route_mask(z_p[..., :vocab], z_a[..., :vocab], self.tau)
        keep = self.last_mask[..., None]
        if self.config.scale_route_exact:  # a routed token: the base model's logits exactly
            return torch.where(keep, z_p, z_a + F.linear(x_up[half:], w_up))
        z = torch.where(keep, (z_p + z_a) / 2, z_a)
        return z + F.linear(torch.where(keep, x_up[:half], x_up[half:]), w_up)

    def experts(self, hidden: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
        """Copy of scale_cl.tuner.routing.posterior.path_experts: the experts' logits and whether they are increments:
        the two stacked paths', a grown model's nested experts (the base's, then what each earlier stage's columns
        and the current stage add), or the base's ``Z`` and ``Z_up``; an extended vocabulary's new tokens get no
        mass from the base expert."""
        d, vocab, extended = self.split, self.route_vocab_size, self.route_vocab_size < self.out_features
        x, x_up = hidden[..., :d], hidden[..., d:]
        w_out, w_up = self.weight[:, :d], self.weight[:, d:]
        if self.stacked:
            half = hidden.shape[0] // 2
            base = F.linear(x[:half], w_out)
            new = F.linear(x[half:], w_out) + F.linear(x_up[half:], w_up)
            return [with_missing_rows(base[..., :vocab], self.out_features) if extended else base, new], False
        earlier = [width for width, _ in self.config.scale_norm_groups or []]
        if earlier:
            widths = (d - sum(earlier), *earlier)  # the base's hidden size, then what each earlier stage added
            parts, columns = x.split(widths, dim=-1), w_out.split(widths, dim=1)
            return [*(F.linear(p, w) for p, w in zip(parts, columns, strict=True)), F.linear(x_up, w_up)], True
        base = F.linear(x, w_out)
        if not extended:
            return [base, F.linear(x_up, w_up)], True
        return [with_missing_rows(base[..., :vocab], self.out_features), base + F.linear(x_up, w_up)], False

    def _mix(self, hidden: torch.Tensor) -> torch.Tensor:
        mixture = dict(self.config.scale_mixture)
        prefix = mixture["prefix"]
        ids = self.inputs.get("input_ids")
        if prefix and ids is None:
            raise ValueError(
                f"the {self.config.scale_router} router reads the input token ids: call the model with input_ids"
            )
        eos = self.config.eos_token_id
        experts, increments = self.experts(hidden)
        logits, weights, self.memory = posterior_mix(
            experts,
            ids if prefix else None,
            eos_ids=tuple(eos) if isinstance(eos, list | tuple) else () if eos is None else (eos,),
            attention_mask=self.inputs.get("attention_mask"),
            memory=self.memory if prefix else None,
            increments=increments,
            keep=self.keep,
            **mixture,
        )
        self.last_weight = weights[0]
        return logits

    def extra_repr(self) -> str:
        return f"{self.split}+{self.in_features - self.split} -> {self.out_features}, tau={self.tau}"


# Copy of scale_cl.tuner.routing.state._stack: the same code.
def _stack(value: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and batch > 1:
        return torch.cat((value, value))
    if isinstance(value, tuple):
        return tuple(_stack(v, batch) for v in value)
    return value


# Copy of scale_cl.tuner.routing.state.stack_paths_hook, rewritten standalone;
# tested equal by tests/export/test_export.py::test_scale_export_loads_without_scale_cl_and_matches.
def stack_paths(
    layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, first: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a route layer: the first one duplicates the hidden states (``[preserve; adapt]``);
    every one stacks the batched keyword arguments, which the model hands each layer for B rows."""
    hidden = args[0] if args else kwargs.pop("hidden_states")
    if first:
        batch, hidden = hidden.shape[0], torch.cat((hidden, hidden))
    else:
        batch = hidden.shape[0] // 2
    kwargs = {k: (_stack(v, batch) if k in BATCHED_KWARGS else v) for k, v in kwargs.items()}
    return (hidden, *args[1:]), kwargs


# The route settings below: Eq. 5's as scale_<name>, a mixing router's as it declares them (its MixtureRouter.mixture);
# tested by tests/export/test_export_copies.py::test_the_exported_config_holds_every_route_setting.
@dataclass(kw_only=True, repr=False)
class ScaleFields:
    """What the stock config lacks: the original (pre-upscaling) sizes and the SCALE method's settings."""

    scale_method: str = "preserve"  # "preserve", "adapt" or "route"
    scale_hidden_size: int = 0  # d: the original stream is hidden[..., :d]
    scale_intermediate_size: int = 0  # the original FFN width
    scale_num_attention_heads: int = 0  # the original query heads (new heads come after them)
    scale_num_key_value_heads: int = 0  # the original key/value heads
    scale_preserve_layers: int = 0  # route: the first collaborative layer, where the two paths start
    scale_route_tau: float = 0.5  # route: the cosine threshold of Eq. 5
    scale_route_vocab_size: int = 0  # route: logits the cosine reads (0: all)
    scale_route_exact: bool = False  # route: a token routed to the preserve path gets the base model's logits
    scale_up_norm: str = "own"  # x_up normalised by its own statistic, the original stream's or the whole width's
    scale_norm_groups: list | None = None  # a grown model: [width, up_norm] of each earlier stage's group
    scale_router: str = "cosine"  # the router's name in scale-cl: Eq. 5's "cosine", or a mixing router
    scale_mixture: dict | None = None  # a mixing router: posterior_mix's settings (prefix, prior, decay, ...)
    scale_vllm_servable: bool = True  # not `mixes_logits`: vLLM's Transformers backend can serve it (module doc)


class ScaleLlamaConfig(ScaleFields, LlamaConfig):
    model_type = "scale_llama"


class ScaleMistralConfig(ScaleFields, MistralConfig):
    model_type = "scale_mistral"


class ScaleQwen2Config(ScaleFields, Qwen2Config):
    model_type = "scale_qwen2"


class ScaleGPTNeoXConfig(ScaleFields, GPTNeoXConfig):
    model_type = "scale_gpt_neox"


def mixes_logits(method: str, mixture: dict | None) -> bool:
    """Whether a model's logits are more than one linear over its base model's output: SCALE-Route's (two paths
    combined per token, Eq. 5, or mixed by a router) and SCALE-Preserve's with a mixing router (its base's logits and
    its own mixed per token). vLLM's Transformers backend cannot serve such a model (module doc)."""
    return method == "route" or (method == "preserve" and mixture is not None)


# What vLLM's Transformers backend sets ``config._attn_implementation`` to ("vllm_mla" for MLA) before it builds the
# base model with ``AutoModel.from_config``: a base model whose causal LM mixes logits refuses it (`ScaleModelMixin`).
VLLM_ATTENTION = "vllm"


class ScaleModelMixin:
    """The base model (the decoder ``AutoModel`` loads) of an exported causal LM: the stock one with the split norms
    swapped in and, for SCALE-Route, the two-path layers (`TwoPathLinear`, `stack_paths`) from
    ``scale_preserve_layers`` on. Attention is the stock layers', called through ``ALL_ATTENTION_FUNCTIONS`` with the
    forward's keyword arguments, so an attention backend (vLLM's) can run it (module doc)."""

    final_norm: str  # the attribute of the last norm
    layer_norms: tuple[str, ...]  # each decoder layer's norms
    norm_class: type[nn.Module]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.scale_init(config)

    def original_linears(self, config: Any) -> dict[str, tuple[int, int]]:
        """Each linear of a decoder layer (its path) -> its (in, out) sizes before upscaling."""
        raise NotImplementedError

    def scale_init(self, config: Any) -> None:
        """Called after the stock ``__init__``: the swaps, made before any weight is loaded."""
        if mixes_logits(config.scale_method, config.scale_mixture) and str(config._attn_implementation).startswith(
            VLLM_ATTENTION
        ):
            raise ValueError(
                f"this SCALE model (scale_method={config.scale_method!r}, scale_router={config.scale_router!r}) mixes "
                "at the logits, which vLLM's Transformers backend (a plain LM head on the base model) cannot compute; "
                "serve it with transformers' generate (AutoModelForCausalLM, trust_remote_code=True)"
            )
        width, split = config.hidden_size, config.scale_hidden_size
        eps = config.layer_norm_eps if hasattr(config, "layer_norm_eps") else config.rms_norm_eps
        norm = partial(self.norm_class, width, split, eps, config.scale_up_norm, config.scale_norm_groups)
        setattr(self, self.final_norm, norm())
        for layer in self.layers:
            for name in self.layer_norms:
                setattr(layer, name, norm())
        self.route_from = None  # the first layer that runs both paths, None when nothing is stacked
        if config.scale_method == "route" and config.scale_preserve_layers < len(self.layers):
            self.route_from = config.scale_preserve_layers
            for index in range(self.route_from, len(self.layers)):
                layer = self.layers[index]
                for path, (original_in, original_out) in self.original_linears(config).items():
                    parent, _, name = path.rpartition(".")
                    old = layer.get_submodule(path)
                    bias = old.bias is not None
                    new = TwoPathLinear(old.in_features, old.out_features, bias, original_in, original_out)
                    setattr(layer.get_submodule(parent), name, new)
                hook = partial(stack_paths, first=index == self.route_from)
                layer.register_forward_pre_hook(hook, with_kwargs=True)


class ScaleMixin:
    """A stock causal LM on a Scale base model (`ScaleModelMixin`), and for a model that mixes at the logits
    (`mixes_logits`) the head that does it (`RouteHead`)."""

    backbone: str  # the attribute holding the base model
    base_class: type[nn.Module]  # the Scale base model class

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.scale_init(config)

    def scale_init(self, config: Any) -> None:
        """Called by ``__init__`` after the stock one: the Scale base model, built as ``AutoModel`` builds it, in place
        of the stock one the stock ``__init__`` made (``from_pretrained`` builds both on the meta device), then the
        head; all before any weight is loaded."""
        setattr(self, self.backbone, self.base_class(config))
        # SCALE-Route, and SCALE-Preserve with a mixing router (its Z is the base's logits exactly)
        mixture = config.scale_mixture if config.scale_method in ("route", "preserve") else None
        head = self.get_output_embeddings()
        if self.route_from is not None:
            self.set_output_embeddings(RouteHead(head.in_features, head.out_features, config))
        elif mixture is not None:  # one path: the base's logits are its Z
            self.set_output_embeddings(RouteHead(head.in_features, head.out_features, config, stacked=False))
        if mixture is not None and mixture["prefix"]:  # the routers that read the token ids
            self.register_forward_pre_hook(capture_router_inputs, with_kwargs=True)

    @property
    def route_from(self) -> int | None:
        """The first layer that runs both route paths, None when nothing is stacked."""
        return getattr(self, self.backbone).route_from

    def _reorder_cache(self, cache: Any, beam_idx: torch.Tensor) -> Any:
        """Beam search: the layers holding both route paths (2n rows) reorder both halves alike (and the
        mixing router's memory is reordered with the beams)."""
        head = self.get_output_embeddings()
        if getattr(head, "memory", None) is not None:
            head.memory.reorder(beam_idx)
        if self.route_from is None:
            cache.reorder_cache(beam_idx)
            return cache
        both = torch.cat((beam_idx, beam_idx + beam_idx.numel()))
        for index, layer in enumerate(cache.layers):
            layer.reorder_cache(both if index >= self.route_from else beam_idx)
        return cache


class LlamaFamilyModelMixin(ScaleModelMixin):
    final_norm, layer_norms = "norm", ("input_layernorm", "post_attention_layernorm")
    norm_class = SplitRMSNormGroups

    # Copy of scale_cl.tuner.arch.llama.LLAMA's linears, their sizes before upscaling;
    # tested equal by tests/export/test_export_copies.py::test_the_exported_linears_are_the_architectures_of_the_tuner.
    def original_linears(self, config: Any) -> dict[str, tuple[int, int]]:
        d, ffn = config.scale_hidden_size, config.scale_intermediate_size
        q, kv = config.scale_num_attention_heads * config.head_dim, config.scale_num_key_value_heads * config.head_dim
        return {
            "self_attn.q_proj": (d, q),
            "self_attn.k_proj": (d, kv),
            "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (q, d),
            "mlp.gate_proj": (d, ffn),
            "mlp.up_proj": (d, ffn),
            "mlp.down_proj": (ffn, d),
        }


class ScaleLlamaModel(LlamaFamilyModelMixin, LlamaModel):
    config_class = ScaleLlamaConfig
    _supports_attention_backend = True  # set by every class here: vLLM reads it (is_backend_compatible)


class ScaleMistralModel(LlamaFamilyModelMixin, MistralModel):
    config_class = ScaleMistralConfig
    _supports_attention_backend = True


class ScaleQwen2Model(LlamaFamilyModelMixin, Qwen2Model):
    config_class = ScaleQwen2Config
    _supports_attention_backend = True


class ScaleGPTNeoXModel(ScaleModelMixin, GPTNeoXModel):
    """GPT-NeoX: fused per-head ``[q; k; v]`` rows (new heads append 3 x head_size rows each), LayerNorm."""

    config_class = ScaleGPTNeoXConfig
    _supports_attention_backend = True
    final_norm, layer_norms = "final_layer_norm", ("input_layernorm", "post_attention_layernorm")
    norm_class = SplitLayerNorm

    # Copy of scale_cl.tuner.arch.gpt_neox.GPT_NEOX's linears, their sizes before upscaling;
    # tested equal by tests/export/test_export_copies.py::test_the_exported_linears_are_the_architectures_of_the_tuner.
    def original_linears(self, config: Any) -> dict[str, tuple[int, int]]:
        d, ffn = config.scale_hidden_size, config.scale_intermediate_size
        return {
            "attention.query_key_value": (d, 3 * d),
            "attention.dense": (d, d),
            "mlp.dense_h_to_4h": (d, ffn),
            "mlp.dense_4h_to_h": (ffn, d),
        }


class ScaleLlamaForCausalLM(ScaleMixin, LlamaForCausalLM):
    config_class = ScaleLlamaConfig
    _supports_attention_backend = True
    backbone, base_class = "model", ScaleLlamaModel


class ScaleMistralForCausalLM(ScaleMixin, MistralForCausalLM):
    config_class = ScaleMistralConfig
    _supports_attention_backend = True
    backbone, base_class = "model", ScaleMistralModel


class ScaleQwen2ForCausalLM(ScaleMixin, Qwen2ForCausalLM):
    config_class = ScaleQwen2Config
    _supports_attention_backend = True
    backbone, base_class = "model", ScaleQwen2Model


class ScaleGPTNeoXForCausalLM(ScaleMixin, GPTNeoXForCausalLM):
    config_class = ScaleGPTNeoXConfig
    _supports_attention_backend = True
    backbone, base_class = "gpt_neox", ScaleGPTNeoXModel
