"""Fitting the calibrated router's gate after training, without old data (`scale_cl.tuner.routing.calibrated`).

The gate is fitted on two sides of text. The new side is the new domain's training text, which the model trained on.
The old side is text the base writes itself, sampled from a document start: a copy of the model read as SCALE-Preserve
at ``alpha = 0`` is the base model (Theorem 3.1; SCALE-Route's preserve path too), so no second model is loaded.
Nothing else is read: no held-out text, no old-domain evaluation set. The
evidence of both sides comes from one forward pass per batch of the model as it is (`RouteState.evidence`); the
fit itself reads only that evidence and takes no gradient into the model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from scale_cl.data.pseudo_replay import generate_blocks
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.modes import set_live_settings, set_method
from scale_cl.tuner.routing.calibrated import GateFit, fit_gate
from scale_cl.tuner.routing.posterior import Evidence
from scale_cl.tuner.scale_state import scale_config_of, scale_state_of


@dataclass(frozen=True)
class RouterFit:
    """A fitted gate, the text it was fitted on (sizes) and what fitting cost."""

    fit: GateFit
    old_blocks: int
    new_blocks: int
    block_length: int
    seconds: float


def check_routed(model: nn.Module) -> ScaleConfig:
    """The model's `ScaleConfig`, refused unless its gate can be fitted here: SCALE-Route or SCALE-Preserve (their
    base logits are exact), upscaled once (a grown model's nested experts need each earlier stage's text too)."""
    config = scale_config_of(model)
    if config.method not in ("route", "preserve"):
        raise ValueError(
            f"the calibrated router reads SCALE-Route and SCALE-Preserve (their base logits are exact), not "
            f"SCALE-{config.method.capitalize()}: fit it on a model trained with either"
        )
    if len(scale_state_of(model).stage_widths()) > 1:
        raise ValueError(
            "fitting the calibrated router of a model grown more than once (nested experts) is not built yet: set its "
            "gate by hand (options.scale.router_* settings) or read it with the nested router"
        )
    return config


def base_view(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that is its base model: SCALE-Preserve at ``alpha = 0``, not routed (Theorem 3.1)."""
    check_routed(model)
    view = set_method(copy.deepcopy(model).eval(), "preserve")
    return set_live_settings(view, up_logit_scale=0.0, router="cosine")


def collect_evidence(model: nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> list[Evidence]:
    """The experts' `Evidence` on ``blocks`` (N, T), a batch at a time, from the model read by the calibrated router
    (its evidence does not depend on the gate); the model's router and mode are restored after."""
    config = check_routed(model)
    state, was_training = model.scale_route, model.training
    device = next(model.parameters()).device
    model.eval()
    set_live_settings(model, router="calibrated")
    state.evidence = []
    try:
        with torch.no_grad():
            for first in range(0, blocks.shape[0], batch_size):
                ids = blocks[first : first + batch_size].to(device)
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return [_to_cpu(evidence) for evidence in state.evidence]
    finally:
        state.evidence = None
        set_live_settings(model, router=config.router)
        model.train(was_training)


def _to_cpu(evidence: Evidence) -> Evidence:
    fields = (evidence.next_log_probs, evidence.neg_entropy, evidence.top, evidence.ids, evidence.attention_mask)
    return Evidence(*(None if t is None else t.cpu() for t in fields))


def fit_router(
    model: nn.Module,
    new_blocks: torch.Tensor,
    start_id: int,
    *,
    seed: int = 0,
    objective: str = "likelihood",
    old_blocks: int | None = None,
    batch_size: int = 8,
    temperature: float = 1.0,
) -> RouterFit:
    """Fit the calibrated router's gate on ``new_blocks`` (the training text) and as many blocks of the same length
    sampled from the model's base (``old_blocks``, default as many), starting at ``start_id`` (the tokenizer's EOS),
    at ``temperature``; set it on ``model`` (its router becomes ``"calibrated"``) and return the fit."""
    began = time.perf_counter()
    count, length = (old_blocks or new_blocks.shape[0]), new_blocks.shape[1]
    sampled = generate_blocks(base_view(model), start_id, count, length, seed, temperature, batch_size)
    old = collect_evidence(model, sampled, batch_size)
    new = collect_evidence(model, new_blocks, batch_size)
    eos_ids = model.scale_route.eos_ids or (start_id,)
    fit = fit_gate(old, new, eos_ids, objective=objective)
    set_live_settings(model, router="calibrated", **fit.gate.settings())
    return RouterFit(fit, count, new_blocks.shape[0], length, time.perf_counter() - began)
