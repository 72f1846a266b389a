"""The training loss with the distillation term, the logits never whole (docs/design.md §1.4).

The slicing itself is the model's (`scale_cl.tuner.sliced_loss`: a SCALE model's forward returns its sliced loss
whenever it trains on labels); here its loss of a slice also takes ``lambda`` times the KL sum to the teacher's logits
of the same slice (`scale_cl.train.distill.kl_sum`), for the Trainer's distillation and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from scale_cl.train.distill import DistillConfig, kl_sum
from scale_cl.tuner.sliced_loss import SliceLoss, cross_entropy_loss, head_returns_loss

LOSSES = ("sliced", "whole")  # the training loss: a slice of positions at a time; or transformers' own


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


def slice_loss(targets: LossTargets) -> SliceLoss:
    """The loss of one slice's logits: the cross-entropy (and the weighted KL term) summed over its labelled
    positions, over ``targets.divisor``."""
    distill = targets.distill
    if distill is None:
        return cross_entropy_loss(targets.labels, targets.divisor)

    def weighted_kl(logits: torch.Tensor, labels: torch.Tensor, positions: slice) -> torch.Tensor:
        return distill.weight * kl_sum(logits, targets.teacher(positions), labels, targets.from_replay, distill)

    return cross_entropy_loss(targets.labels, targets.divisor, weighted_kl)


@contextmanager
def sliced_head(head: nn.Module, targets: LossTargets, positions: int | None = None) -> Iterator[None]:
    """Within the block, ``head`` returns the batch's loss (a scalar) instead of its logits: a model's forward pass
    then hands the loss out as ``outputs.logits``. ``positions``: per slice (default `slice_positions`)."""
    with head_returns_loss(head, slice_loss(targets), targets.labels.shape[0], positions):
        yield
