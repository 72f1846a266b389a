"""Mixing experts' next-token distributions, ``log sum_j w_j softmax(z_j)`` at every position (issue 40, part 5).

The likelihood and nested routers mix full-vocabulary distributions at every position. That work is elementwise
and memory-bound: written as ``log_softmax`` per expert and a ``logaddexp`` / ``logsumexp`` over them, each step
materialises a (B, T, V) fp32 tensor (200 MB at 4 x 256 positions and SmolLM2's 49,152 tokens), and on a CPU the
fresh allocations and the passes through main memory cost more than the arithmetic (`benchmarks/mixture_time.py`,
two experts at (4, 256, 49152) on the project's 2-core CPU: 1.06 s a call that way, 0.25 s as computed here).

So where no gradient is needed (inference, reading a trained model) the two functions here work a few positions
at a time, in buffers that stay in the CPU's cache (on a GPU: chunks of bounded size, few kernel launches), and
write the mixture once; where one is (training through the mixture) they are the plain differentiable
expressions. Both give the same values to fp32 rounding (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CPU_CHUNK_ELEMENTS = 2**17  # a CPU chunk's elements per expert (512 KiB of fp32): stays in a core's L2 cache
ACCELERATOR_CHUNK_ELEMENTS = 2**24  # a GPU's (64 MiB of fp32): few kernel launches, temporaries of bounded size


# Copy in export/modeling_scale.py (chunk_rows): the same code (tests/test_export_copies.py).
def chunk_rows(vocab: int, device: torch.device) -> int:
    """Positions per chunk of a mixture over ``vocab`` entries on ``device``."""
    elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // vocab)


# Copy in export/modeling_scale.py (log_normalisers): the same code (tests/test_export_copies.py).
def log_normalisers(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dimension in fp32, a CPU chunk of positions at a time unless a gradient is
    needed: ``z - log_normalisers(z)`` are the log-probabilities."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return torch.logsumexp(logits.float(), dim=-1)
    flat = logits.reshape(-1, logits.shape[-1])
    rows = chunk_rows(flat.shape[1], flat.device)
    out = torch.empty(flat.shape[0], device=flat.device)
    for first in range(0, flat.shape[0], rows):
        out[first : first + rows] = torch.logsumexp(flat[first : first + rows].float(), dim=-1)
    return out.view(logits.shape[:-1])


# Copy in export/modeling_scale.py (mixture_log_probs): the same code (tests/test_export_copies.py).
def mixture_log_probs(expert_logits: Sequence[torch.Tensor], shifts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``log sum_j exp(z_j + shift_j)`` (fp32, the logits' shape) for E >= 2 experts' logits ``z_j`` (..., V) and
    shifts (...): with ``shift_j = log w_j - log_normalisers(z_j)``, the log of the mixture ``sum_j w_j
    softmax(z_j)``. Shifted by the largest term per entry, so no term under- or overflows."""
    inputs = [*expert_logits, *shifts]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        terms = torch.stack([z.float() + s[..., None] for z, s in zip(expert_logits, shifts, strict=True)])
        return torch.logsumexp(terms, dim=0)
    vocab = expert_logits[0].shape[-1]
    flat = [z.reshape(-1, vocab) for z in expert_logits]
    columns = [s.reshape(-1, 1).float() for s in shifts]
    out = torch.empty(flat[0].shape, device=flat[0].device)
    rows = chunk_rows(vocab, out.device)
    for first in range(0, out.shape[0], rows):
        part = slice(first, first + rows)
        terms = [z[part].float() + shift[part] for z, shift in zip(flat, columns, strict=True)]
        top = torch.maximum(terms[0], terms[1], out=out[part])
        for term in terms[2:]:
            torch.maximum(top, term, out=top)
        top.clamp_min_(torch.finfo(top.dtype).min)  # every term -inf: exp(-inf - min) = 0, the sum's log -inf
        total = terms[0].sub_(top).exp_()
        for term in terms[1:]:
            total.add_(term.sub_(top).exp_())
        top.add_(total.log_())
    return out.view(expert_logits[0].shape)
