"""Mixing experts' next-token distributions, ``log sum_j w_j softmax(z_j)`` at every position.

The likelihood and nested routers mix full-vocabulary distributions at every position. That work is elementwise
and memory-bound: written as ``log_softmax`` per expert and a ``logaddexp`` / ``logsumexp`` over them, each step
materialises a (B, T, V) fp32 tensor (200 MB at 4 x 256 positions and SmolLM2's 49,152 tokens), and on a CPU the
fresh allocations and the passes through main memory cost more than the arithmetic (`measurements/mixture_time.py`).

So where no gradient is needed (inference, reading a trained model) the two functions here work a few positions
at a time, in buffers that stay in the CPU's cache (on a GPU: chunks of bounded size, few kernel launches), and
write the mixture once; where one is (training through the mixture) they are the plain differentiable
expressions. Both give the same values to fp32 rounding (tested). Lower precisions are mixed in fp32; float64
logits stay float64 (so a float64 model is an exact reference for an fp32 one: tests/exactness.py).

Nested experts (SCALE-Preserve's one path, ``Z`` and ``Z + alpha Z_up``; a grown model's cumulative head sums) are
given as ``increments``: the first expert's logits, then what each next expert adds to the one before. Their sums
are then formed a chunk at a time, never as whole tensors, and the mixture is ``z_0 + log(e^(s_0) + e^(s_1 + d_1) +
...)``: with two experts one ``logaddexp`` an entry (``d_1`` the increment, ``s_j`` the shifts below).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

CPU_CHUNK_ELEMENTS = 2**17  # a CPU chunk's elements per expert (512 KiB of fp32): stays in a core's L2 cache
ACCELERATOR_CHUNK_ELEMENTS = 2**24  # a GPU's (64 MiB of fp32): few kernel launches, temporaries of bounded size


# Copy in export/modeling_scale.py (chunk_rows): the same code (tests/export/test_export_copies.py).
def chunk_rows(vocab: int, device: torch.device) -> int:
    """Positions per chunk of a mixture over ``vocab`` entries on ``device``."""
    elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // vocab)


# Copy in export/modeling_scale.py (log_normalisers): the same code (tests/export/test_export_copies.py).
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


# Copy in export/modeling_scale.py (mixture_log_probs): the same code (tests/export/test_export_copies.py).
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


CONFIDENCES = ("entropy", "top")  # what an expert's confidence at a position is read as (`expert_confidence`)


# Copy in export/modeling_scale.py (expert_confidence): the same code (tests/export/test_export_copies.py).
def expert_confidence(
    experts: Sequence[torch.Tensor], norms: torch.Tensor, kind: str, increments: bool = False
) -> torch.Tensor:
    """Each expert's confidence at every position (E, ...), fp32, no gradient: ``kind`` ``"entropy"`` is the negative
    entropy of its distribution ``-H(p_j) = sum_v p_j(v) ln p_j(v)`` (what a calibrated expert expects its next
    token's log-probability to be), ``"top"`` the log of its top probability ``ln max_v p_j(v)``. ``norms``: the
    experts' `log_normalisers`; ``increments`` as there. Computed a CPU chunk of positions at a time."""
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


# Copy in export/modeling_scale.py (expert_statistics): the same code (tests/export/test_export_copies.py).
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
