"""Full fine-tuning: the baseline every continual-learning method is measured against."""

from __future__ import annotations

from torch import nn


def prepare_fft(model: nn.Module) -> nn.Module:
    """Make every parameter trainable (a tied embedding/LM head is one parameter and trains once).

    Why: FFT is the plasticity upper bound and the forgetting worst case of the paper's comparison.
    """
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def describe_fft(model: nn.Module, options: dict) -> str:
    """The bench's one-line description of the prepared model."""
    return "every parameter trains"
