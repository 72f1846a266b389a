"""Readings of one trained model along a frontier, training nothing (docs/design.md §2): SCALE's new-stream logits
weighted by alpha (with SCALE-Route also read with ``route_exact`` and with the likelihood router, SCALE-Preserve
with the likelihood router), and WiSE-FT's
interpolation of FFT's weights towards the base model's. `cpt` and `bio` record them beside each run's curve."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

TRAINED = "trained"  # the reading of a model as it trained: no router changed
Calibrate = Callable[[torch.nn.Module], Any]  # fits the calibrated router's gate on a model, sets it, returns the fit


@contextmanager
def reading_applied(model: torch.nn.Module, reading: str | None, keep: bool = False) -> Iterator[torch.nn.Module]:
    """``model`` read with the router ``reading`` (a SCALE model's live setting, `scale_cl.tuner.modes`) while open,
    then given back its own router unless ``keep``; None or `TRAINED` changes nothing."""
    if reading in (None, TRAINED):
        yield model
        return
    from scale_cl import scale_config_of
    from scale_cl.tuner.modes import set_live_settings

    own = scale_config_of(model).router
    set_live_settings(model, router=reading)
    try:
        yield model
    finally:
        if not keep:
            set_live_settings(model, router=own)


def read_as(evaluate: Callable[[Any], dict], reading: str | None) -> Callable[[Any], dict]:
    """``evaluate(model)`` under the reading ``reading`` (`reading_applied`); ``evaluate`` itself when there is none."""
    if reading in (None, TRAINED):
        return evaluate

    def evaluate_read(model: Any) -> dict:
        with reading_applied(model, reading):
            return evaluate(model)

    return evaluate_read


def up_logit_frontier(
    model: torch.nn.Module,
    evaluate: Any,
    scales: tuple[float, ...],
    routers: tuple[str, ...] = ("likelihood",),
    calibrate: Sequence[Calibrate] = (),
) -> list[dict[str, Any]]:
    """The trained SCALE model evaluated with its new stream's logits weighted by each alpha (``Z + alpha Z_up``,
    `scale_cl.set_up_logit_scale`), then given back its own settings: one record per alpha (docs/design.md §2).

    A SCALE-Route model trained with Eq. 5 as the paper has it is evaluated with ``route_exact`` too (records
    with ``"route_exact": true``): trained with it from the start, Route cannot learn (at W12 = 0 both paths
    agree, every token routes to the exact base logits, and no gradient flows), so it is an evaluation option;
    and with each mixing router of ``routers`` (``"router": "likelihood"``, ..., their settings as the model holds
    them). SCALE-Preserve trained without a router is read with those routers too (its ``Z`` is the base's logits
    exactly, `ScaleConfig.routed`). The calibrated router's gate is fitted at each alpha by each of ``calibrate``
    (which sets it on the model; `scale_cl.train.router_fit.fit_router`, one objective each): a record each, with
    the gate and the fit (``"gate_fit"``).
    """
    from scale_cl import scale_config_of
    from scale_cl.tuner.modes import set_live_settings
    from scale_cl.tuner.routing.calibrated import GATE_SETTINGS

    own = scale_config_of(model)
    variants = [{}]  # the model's own settings, then the readings it was not trained with
    if own.method == "route" and own.router == "cosine" and not own.route_exact:
        variants += [{"route_exact": True}, *({"router": router} for router in routers)]
    elif own.method == "preserve" and not own.routed:
        variants += [{"router": router} for router in routers]
    frontier = []
    try:
        for changes in variants:
            for alpha in scales:
                set_live_settings(model, up_logit_scale=alpha, **changes)
                if changes.get("router") == "calibrated" and calibrate:
                    for fit_on in calibrate:
                        fit = fit_on(model)
                        fitted = {**fit.fit.gate.settings(), "gate_fit": fit.summary()}
                        frontier.append({"alpha": alpha, **changes, **fitted, **evaluate(model)})
                    set_live_settings(model, **{name: getattr(own, name) for name in GATE_SETTINGS})
                else:
                    frontier.append({"alpha": alpha, **changes, **evaluate(model)})
                set_live_settings(model, **{name: getattr(own, name) for name in changes})
    finally:
        set_live_settings(model, up_logit_scale=own.up_logit_scale, route_exact=own.route_exact, router=own.router)
    return frontier


def wise_ft_frontier(
    model: torch.nn.Module, base: torch.nn.Module, evaluate: Any, alphas: tuple[float, ...]
) -> list[dict[str, Any]]:
    """The trained model's weights interpolated towards the base model's, ``base + alpha (trained - base)``
    (WiSE-FT, Wortsman et al. 2022), evaluated at each alpha, then given back the trained weights."""
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    start = dict(base.named_parameters())
    frontier = []
    try:
        for alpha in alphas:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name in trained:
                        param.copy_(torch.lerp(start[name].to(param.device, param.dtype), trained[name], alpha))
            frontier.append({"alpha": alpha, **evaluate(model)})
    finally:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in trained:
                    param.copy_(trained[name])
    return frontier
