"""The language-modelling loss with the logits never whole: a slice of positions at a time (docs/design.md §1.4).

A step's largest tensors are its logits (tokens x vocabulary: 8.4 GB in fp32 for 16 x 1,024 tokens of a 128k
vocabulary) and their gradient. Here the head runs on a slice of positions at a time, inside the model's forward
pass: the slice's logits, its loss and the gradients of its loss (to the hidden states and the head's trainable
weights) are computed at once and the logits dropped, so nothing of size tokens x vocabulary is kept (Liger
Kernel's fused linear cross-entropy does the same on CUDA for a plain linear head). The head is the model's own
module, called as is, so this holds for every method: a SCALE head computes ``Z + alpha Z_up`` and takes no
gradient for its frozen ``W`` (the floor holds), a tied head's gradient reaches the embedding, a route head's
router decides per slice. The slice's gradients are kept until the backward pass hands them on, scaled by the
loss's own gradient.

The loss is the sum of the cross-entropy over the labelled positions (transformers' ``ForCausalLMLoss``: the
labels shifted by one, ``-100`` ignored, fp32), plus, with distillation, ``lambda`` times the KL sum to the
teacher's logits of the same slice (`scale_cl.train.distill.kl_sum`), divided by the count the Trainer divides its
own by before any gradient is taken: with one slice the gradients are the whole loss's, bitwise.
A head whose output at a position reads other positions (a router reading the document's token ids) cannot be
sliced: `chunkable` says so, and the caller keeps the plain loss there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from scale_cl.train.distill import IGNORE, DistillConfig, at_least_fp32, kl_sum, shifted_labels

LOSSES = ("sliced", "whole")  # the training loss: here, a slice of positions at a time; or transformers' own


@dataclass
class LossTargets:
    """What the loss of a batch compares the logits with.

    ``labels``: (B, T), as given to a transformers causal LM (shifted by one here). ``divisor``: what the loss sum is
    divided by before its gradients are taken, as the Trainer divides its own (so the gradients round alike).
    ``distill`` and ``teacher``: the KL term's settings and the teacher's logits of a slice of positions (called
    right after the head ran on that slice: `scale_cl.train.distill.HeadTeacher` reads what the head just kept).
    ``from_replay``: (B,), which sequences are replayed old-domain text (the KL term's weights)."""

    labels: torch.Tensor
    divisor: float | torch.Tensor = 1.0
    distill: DistillConfig | None = None
    teacher: Callable[[slice], torch.Tensor] | None = None
    from_replay: torch.Tensor | None = None


def slice_positions(batch: int, positions: int, hidden: int, vocab: int) -> int:
    """Positions per slice, so that a slice holds about the hidden states' worth of logits (Liger's rule: the tokens
    over ``ceil(vocab / hidden)``) but at least half the hidden width's rows, each rounded up to a power of two.

    The floor: every slice writes the head's whole weight gradient (vocabulary x hidden) once, which outweighs the
    slice's own logits below ``hidden / 2`` rows; on a CPU 16-row slices took 4x the whole loss's time at SmolLM2's
    shape, 512 rows the same time (benchmarks/README.md)."""
    liger = math.ceil(batch * positions / math.ceil(vocab / hidden))
    rows = 2 ** math.ceil(math.log2(max(1, liger, math.ceil(hidden / 2))))
    return max(1, min(positions, rows // batch))


def chunkable(head: nn.Module) -> bool:
    """Whether ``head``'s output at a position reads that position's hidden state alone (so it can run on slices)."""
    route = getattr(head, "route", None)
    return route is None or not route.active or not route.reads_tokens


def _join(readings: list) -> Any:
    """The slices' router readings as one reading of every position (each tensor's last axis is the positions)."""
    if not readings or readings[0] is None:
        return None
    first = readings[0]
    joined = {f.name: torch.cat([getattr(r, f.name) for r in readings], dim=-1) for f in dataclasses.fields(first)}
    return type(first)(**joined)


@dataclass
class _Slices:
    """The head, its trainable weights' names, the positions per slice and the loss of a slice's logits."""

    head: nn.Module
    names: tuple[str, ...]
    positions: int
    loss: Callable[[torch.Tensor, slice], torch.Tensor]

    def run(self, hidden: torch.Tensor, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list]:
        """The loss sum and its gradients (to ``hidden`` where it takes one, then to each of ``params``), a slice
        of positions at a time; a route head's reading is left joined over every position."""
        wants_hidden = hidden.requires_grad
        grads: list[torch.Tensor | None] = [torch.zeros_like(hidden) if wants_hidden else None, *[None] * len(params)]
        total = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
        route, readings = getattr(self.head, "route", None), []
        swapped = self.head.__dict__.pop("forward")  # `sliced_head`'s: the head's own forward computes each slice
        try:
            for start in range(0, hidden.shape[1], self.positions):
                positions = slice(start, min(hidden.shape[1], start + self.positions))
                with torch.enable_grad():
                    part = hidden[:, positions].detach().requires_grad_(wants_hidden)
                    leaves = [p.detach().requires_grad_() for p in params]
                    weights = dict(zip(self.names, leaves, strict=True))
                    loss = self.loss(functional_call(self.head, weights, (part,), strict=False), positions)
                    wrt = [*([part] if wants_hidden else []), *leaves]
                    with torch.autocast(hidden.device.type, enabled=False):  # a backward pass, as outside the forward
                        got = list(torch.autograd.grad(loss, wrt, allow_unused=True)) if wrt else []
                if wants_hidden:
                    grads[0][:, positions] = got.pop(0)
                for index, grad in enumerate(got, start=1):
                    if grad is not None:
                        grads[index] = grad if grads[index] is None else grads[index].add_(grad)
                total += loss.detach()
                readings.append(None if route is None else route.last)
        finally:
            self.head.forward = swapped
        if route is not None and route.active:
            route.last = _join(readings)
        return total, grads


class _SlicedHeadLoss(torch.autograd.Function):
    """``sum over slices of loss(head(hidden[:, s]), s)``; each slice's gradients computed in the forward pass and
    handed on in the backward pass, times the loss's own gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, slices: _Slices, *params: torch.Tensor) -> torch.Tensor:
        total, ctx.grads = slices.run(hidden, params)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad_hidden, *grads = [None if g is None else g.mul_(grad_output.to(g.dtype)) for g in ctx.grads]  # ours alone
        ctx.grads = None
        return (grad_hidden, None, *grads)


def slice_loss(targets: LossTargets) -> Callable[[torch.Tensor, slice], torch.Tensor]:
    """The loss of one slice's logits: the cross-entropy (and the weighted KL term) summed over its labelled
    positions, over ``targets.divisor``."""
    shifted = shifted_labels(targets.labels)

    def loss(logits: torch.Tensor, positions: slice) -> torch.Tensor:
        labels = shifted[:, positions].to(logits.device)
        total = F.cross_entropy(
            at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        if targets.distill is not None:
            teacher = targets.teacher(positions)
            kl = kl_sum(logits, teacher, labels, targets.from_replay, targets.distill)
            total = total + targets.distill.weight * kl
        return total / targets.divisor

    return loss


@contextmanager
def sliced_head(head: nn.Module, targets: LossTargets, positions: int | None = None) -> Iterator[None]:
    """Within the block, ``head`` returns the batch's loss (a scalar, `_SlicedHeadLoss`) instead of its logits:
    a model's forward pass then hands the loss out as ``outputs.logits``, through every wrapper and hook (DDP sees
    the head's weights used). ``positions``: per slice (default `slice_positions`)."""
    if not chunkable(head):
        raise ValueError("this head reads other positions (a router reading the token ids): it cannot be sliced")
    params = {name: p for name, p in head.named_parameters() if p.requires_grad}
    loss = slice_loss(targets)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        step = positions or slice_positions(targets.labels.shape[0], hidden.shape[1], hidden.shape[-1], vocab)
        run = _Slices(head, tuple(params), step, loss)
        return _SlicedHeadLoss.apply(hidden, run, *params.values())

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
