"""Inference-only rows of the bench: a trained method's model read with the likelihood router (issue 40).

A reading costs what its model computes at inference: SCALE-Route's two paths in one model, SCALE-Preserve's one
pass whose ``Z`` is the base's logits, or the two-model control, FFT's model and a copy of the base both run and
mixed (`scale_cl.eval.mixture`). Each row is timed with the methods (forward and ``generate()``, interleaved), its
forward FLOPs counted and its peak forward memory measured in a fresh process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from scale_cl.eval.mixture import ModelMixture
from scale_cl.tuner.modes import set_live_settings


@dataclass(frozen=True)
class Reading:
    """A bench reading: the method row whose model it reads, and how."""

    method: str
    setting: str
    two_models: bool = False  # the method's model and the base beside it (else the model, its router switched)


READINGS = {
    "route-likelihood": Reading("scale_route", "SCALE-Route read with the likelihood router (one model, one pass)"),
    "preserve-likelihood": Reading(
        "scale_preserve", "SCALE-Preserve read with the likelihood router (its Z is the base's; one model, one pass)"
    ),
    "control": Reading("fft", "FFT's model and the base, mixed by the likelihood router (two models)", True),
}


def reading_model(name: str, model: nn.Module, base: nn.Module) -> nn.Module:
    """The model reading ``name`` runs: a copy of its method's ``model`` with the likelihood router, or (the control)
    ``model`` and a copy of ``base`` (on the model's device and dtype) mixed."""
    reading = READINGS[name]
    if reading.two_models:
        parameter = next(model.parameters())
        return ModelMixture([copy.deepcopy(base).to(device=parameter.device, dtype=parameter.dtype), model])
    return set_live_settings(copy.deepcopy(model), router="likelihood")
