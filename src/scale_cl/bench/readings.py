"""Inference-only rows of the bench: a trained method's model read with the likelihood (or calibrated) router.

A reading costs what its model computes at inference: SCALE-Route's two paths in one model, SCALE-Preserve's one
pass whose ``Z`` is the base's logits, or the two-model control, FFT's model and a copy of the base both run and
mixed (`scale_cl.eval.mixture`). The nested rows read a model after three tasks: SCALE-Preserve grown twice more
(four experts in one pass, the nested router) against the base and three FFT-sized models run and mixed alike.
Each row is timed with the methods (forward and ``generate()``, interleaved), its forward FLOPs counted and its
peak forward memory measured in a fresh process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from scale_cl.eval.mixture import ModelMixture
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.scale_state import scale_config_of
from scale_cl.tuner.upscale import upscale


@dataclass(frozen=True)
class InferenceRow:
    """An inference-only row of the bench: the method row whose model it reads, and how."""

    method: str
    setting: str
    two_models: bool = False  # the method's model and the base beside it (else the model, its router switched)
    experts: int = 2  # the base and the models after each task: > 2 grows SCALE (nested router) or copies the model
    router: str = "likelihood"  # the mixing router of a two-expert reading


READINGS = {
    "route-likelihood": InferenceRow(
        "scale_route", "SCALE-Route read with the likelihood router (one model, one pass)"
    ),
    "preserve-likelihood": InferenceRow(
        "scale_preserve", "SCALE-Preserve read with the likelihood router (its Z is the base's; one model, one pass)"
    ),
    "preserve-calibrated": InferenceRow(
        "scale_preserve",
        "SCALE-Preserve read with the calibrated router (prefix and both confidences; one model, one pass)",
        router="calibrated",
    ),
    "control": InferenceRow("fft", "FFT's model and the base, mixed by the likelihood router (two models)", True),
    "control-calibrated": InferenceRow(
        "fft", "FFT's model and the base, mixed by the calibrated router (two models)", True, router="calibrated"
    ),
    "preserve-nested": InferenceRow(
        "scale_preserve",
        "SCALE-Preserve after three tasks (grown twice more), read with the nested router (four experts, one pass)",
        experts=4,
    ),
    "control-nested": InferenceRow(
        "fft",
        "the base and three FFT models (one per task), mixed by the nested router's posterior (four models)",
        True,
        experts=4,
    ),
}


def reading_model(name: str, model: nn.Module, base: nn.Module) -> nn.Module:
    """The model reading ``name`` runs: a copy of its method's ``model`` with its router (grown once per
    later task with its own settings and the nested router where the reading has more experts), or (a control)
    ``model``, copies of it for the earlier tasks and a copy of ``base`` (on the model's device and dtype) mixed."""
    reading = READINGS[name]
    if reading.two_models:
        parameter = next(model.parameters())
        earlier = [copy.deepcopy(model) for _ in range(reading.experts - 2)]  # the earlier tasks' models
        experts = [copy.deepcopy(base).to(device=parameter.device, dtype=parameter.dtype), *earlier, model]
        return ModelMixture(experts, router=reading.router if reading.experts == 2 else "likelihood")
    if reading.experts == 2:
        return set_live_settings(copy.deepcopy(model), router=reading.router)
    grown, config = copy.deepcopy(model), scale_config_of(model)
    for _ in range(reading.experts - 2):  # one stage per later task, as a sequence grows it
        grown = upscale(grown, config)
    return set_live_settings(grown, router="nested")
