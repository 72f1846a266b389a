"""SCALE-Route's threshold chosen from data instead of fixed (beyond the paper, whose tau is a constant 0.5).

Eq. 5 routes a token to the preserve path when ``cos(Z_p, Z_a) > tau``. What a fixed tau does depends on
how far the adapt path has moved: early in training every token's cosine is near 1 and any tau below it
routes everything to the preserve path; later the cosines spread and the same tau routes a share nobody
chose. Calibrating fixes the *share* instead: on a small sample of old-domain text (text the model must
keep), tau is set so that ``share`` of its tokens go to the preserve path, and it is set again as the
adapt path moves (`RouteCalibration`, every ``every`` optimizer steps). New-domain tokens, on which the
two paths disagree more, then go to the adapt path.

The cosines are Eq. 5's own (`scale_cl.tuner.routing.cosine.route_cosine`, float32), read from a forward pass of the
model in the form training runs (split, not the merged inference form), so the chosen tau routes
exactly the target share of the sample's tokens up to ties (see `tau_for_share`). The calibrated tau is
the model's ``route_tau`` from then on: saved, exported and used in evaluation like a fixed one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from scale_cl.tuner.merged import merged_inference
from scale_cl.tuner.modes import set_live_settings

Batch = dict[str, torch.Tensor]


def sequence_batches(sequences: torch.Tensor, batch_size: int = 4) -> list[Batch]:
    """Packed ``[n, T]`` token ids (every position a real token) as model-input batches of ``batch_size``."""
    if sequences.ndim != 2 or len(sequences) == 0:
        raise ValueError(f"the calibration sample must be a non-empty [n, T] tensor, got {tuple(sequences.shape)}")
    return [{"input_ids": sequences[i : i + batch_size]} for i in range(0, len(sequences), batch_size)]


def route_cosines(model: nn.Module, batches: Iterable[Batch], bf16: bool = False) -> torch.Tensor:
    """``cos(Z_p, Z_a)`` of every real token of ``batches`` (``input_ids``, optionally ``attention_mask``) under
    route mode, flattened (float32)."""
    state = getattr(model, "scale_route", None)
    if state is None or not state.active:
        raise ValueError("calibrating tau needs a model in SCALE-Route mode (upscale(...); set_method(model, 'route'))")
    was_training = model.training
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    found = []
    model.eval()
    try:
        with torch.no_grad(), merged_inference(model, False), autocast:
            for batch in batches:
                mask = batch.get("attention_mask")
                model(**{k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")})
                cosine = state.last.cosine.float().cpu()  # Eq. 5's reading (`CosineReading`)
                found.append(cosine.flatten() if mask is None else cosine[mask.bool()])
    finally:
        model.train(was_training)
    if not found:
        raise ValueError("the calibration sample is empty")
    return torch.cat(found)


def tau_for_share(cosines: torch.Tensor, share: float) -> float:
    """The tau in [-1, 1] with which ``cosines > tau`` holds for ``share`` of them (the nearest share ties allow).

    With ``k = round(share x n)`` and the cosines sorted high to low, ``m`` tokens can be routed exactly
    only where the ``m``-th and ``m+1``-th differ; ``m`` is the count nearest to ``k`` that can (equally
    near: the fewer). tau is the float32 midpoint of those two cosines, so a token must move by half
    their gap before a forward pass that rounds differently (another batch size, another device) routes
    it otherwise; where the midpoint rounds onto one of them, tau is the lower one, which is still exact.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the target share of tokens routed to the preserve path must be in [0, 1], got {share}")
    values = cosines.detach().flatten().float().sort(descending=True).values
    n = values.numel()
    if n == 0:
        raise ValueError("no cosines to calibrate tau on (an empty sample)")
    k = round(share * n)
    if k < n:
        tied_from, tied_to = int((values > values[k]).sum()), int((values >= values[k]).sum())
        k = tied_from if k - tied_from <= tied_to - k else tied_to
    if k == 0:
        return min(1.0, float(values[0]))
    if k == n:
        return max(-1.0, float(torch.nextafter(values[-1], torch.tensor(-float("inf")))))
    tau = ((values[k - 1].double() + values[k].double()) / 2).float()
    if int((values > tau).sum()) != k:
        tau = values[k]
    return min(1.0, max(-1.0, float(tau)))


def calibrate_route_tau(model: nn.Module, batches: Iterable[Batch], share: float, bf16: bool = False) -> float:
    """Set (and return) the tau that routes ``share`` of the real tokens of ``batches`` to the preserve path."""
    tau = tau_for_share(route_cosines(model, batches, bf16), share)
    set_live_settings(model, route_tau=tau)  # the model's route_tau: saved and exported with it
    return tau


class RouteCalibration(TrainerCallback, ExportableState):
    """Calibrate SCALE-Route's tau before training and every ``every`` optimizer steps (0: before training only).

    The tau in use is part of each checkpoint (the Trainer's ``stateful_callbacks`` in
    ``trainer_state.json``), so a resumed run continues with the tau the interrupted one had, and goes on
    calibrating at the same steps. `scale_cl.train.recipe.train_model` puts it before every other callback, so an
    evaluation sees the step's tau.
    """

    def __init__(self, model: nn.Module, batches: list[Batch], share: float, every: int, bf16: bool = False) -> None:
        if every < 0:
            raise ValueError(f"the calibration interval must be 0 (before training only) or more steps, got {every}")
        self.model, self.batches, self.share, self.every, self.bf16 = model, batches, share, every, bf16
        self.tau: float | None = None

    def state(self) -> dict[str, Any]:
        return {"args": {}, "attributes": {"tau": self.tau}}

    def _calibrate(self) -> None:
        self.tau = calibrate_route_tau(self.model, self.batches, self.share, self.bf16)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        saved = (state.stateful_callbacks or {}).get(type(self).__name__, {})
        tau = saved.get("attributes", {}).get("tau") if isinstance(saved, dict) else None
        if state.global_step > 0 and tau is not None:  # resumed: the tau the checkpoint was trained with
            self.tau = tau
            set_live_settings(self.model, route_tau=tau)
        else:
            self._calibrate()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            self._calibrate()
