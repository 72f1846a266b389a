"""The base model as a teacher: a KL term to the base's next-token distribution (docs/design.md §2).

The loss becomes ``CE + lambda * T^2 * sum_t w_t KL(p_base^T || p_model^T) / N``, ``w_t`` set by replay and
``new_tokens``. SCALE-Preserve's and SCALE-Route's heads hand over the base's logits from their own forward pass
(`HeadTeacher`); every other method runs a frozen copy of the base (`CopyTeacher`; `teacher_for` picks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scale_cl.tuner.sliced_loss import IGNORE, at_least_fp32, shifted_labels

NEW_TOKEN_WEIGHTS = ("confidence", "all", "none")


@dataclass(frozen=True)
class DistillConfig:
    """``weight``: lambda (> 0); ``temperature``: T of both softmaxes; ``new_tokens``: the weight of a
    new-domain position (one of `NEW_TOKEN_WEIGHTS`)."""

    weight: float
    temperature: float = 1.0
    new_tokens: str = "confidence"

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"distillation weight must be > 0, got {self.weight}")
        if not self.temperature > 0:
            raise ValueError(f"distillation temperature must be > 0, got {self.temperature}")
        if self.new_tokens not in NEW_TOKEN_WEIGHTS:
            raise ValueError(f"distillation new_tokens must be one of {NEW_TOKEN_WEIGHTS}, got {self.new_tokens!r}")


def _teacher_side(teacher_logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p^T, sum_v p^T log p^T)`` at every position (no gradient: the teacher is fixed)."""
    with torch.no_grad():
        logp = F.log_softmax(at_least_fp32(teacher_logits) / temperature, dim=-1)
        p = logp.exp()
        return p, torch.einsum("...v,...v->...", p, logp)


def position_weights(
    teacher_logits: torch.Tensor,
    shifted: torch.Tensor,
    from_replay: torch.Tensor | None,
    new_tokens: str,
    neg_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w_t`` of every position (B, T) given the label each predicts (``shifted``: `shifted_labels`, or a slice of
    positions of it): 0 where that label is ignored (the last position of `shifted_labels` predicts none).

    ``neg_entropy``: ``sum p log p`` of the base's distribution at temperature 1 where already computed.
    """
    has_label = (shifted != IGNORE).float()
    replay = torch.zeros(shifted.shape[0], 1, device=shifted.device)
    if from_replay is not None:
        replay = from_replay.to(shifted.device).float().view(-1, 1)
    if new_tokens == "confidence":
        if neg_entropy is None:
            neg_entropy = _teacher_side(teacher_logits, 1.0)[1]
        new = torch.exp(neg_entropy)  # exp(-H)
    else:
        new = torch.full_like(has_label, 1.0 if new_tokens == "all" else 0.0)
    return has_label * (replay + (1 - replay) * new)


def distill_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    from_replay: torch.Tensor | None,
    config: DistillConfig,
) -> torch.Tensor:
    """``T^2 sum_t w_t KL(p_teacher^T || p_student^T)`` over the batch (not yet averaged)."""
    return kl_sum(student_logits, teacher_logits, shifted_labels(labels), from_replay, config)


def kl_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    shifted: torch.Tensor,
    from_replay: torch.Tensor | None,
    config: DistillConfig,
) -> torch.Tensor:
    """`distill_sum` of positions given the label each predicts (``shifted``; a slice of the positions is enough).

    Computed as ``KL = sum p log p - <p, z_student> / T + logsumexp(z_student / T)`` (``p`` sums to 1): no
    log-softmax of the student and no full-size difference is materialised, which halves the term's cost over
    a large vocabulary. The teacher covers the base vocabulary; a student with more logits (an extended
    vocabulary) is compared on its full softmax, so the mass it gives new tokens counts against it where the
    base is the target.
    """
    t = config.temperature
    p, neg_entropy = _teacher_side(teacher_logits, t)
    weights = position_weights(
        teacher_logits, shifted, from_replay, config.new_tokens, neg_entropy if t == 1.0 else None
    )
    if not bool(weights.any()):
        return student_logits.sum() * 0.0  # keeps the graph (every process runs the same backward)
    student = at_least_fp32(student_logits)
    scaled = student if t == 1.0 else student / t
    cross = torch.einsum("...v,...v->...", p, scaled[..., : p.shape[-1]])
    kl = neg_entropy - cross + torch.logsumexp(scaled, dim=-1)
    return (t * t) * (weights * kl).sum()


class HeadTeacher:
    """The base logits SCALE-Preserve and SCALE-Route compute anyway: the head keeps them for one forward pass
    (``RouteState.capture_base``), no second pass and no copy of the weights."""

    def __init__(self, model: nn.Module) -> None:
        self.state = model.scale_route

    def run(self, forward: Callable[[], Any], inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        self.state.capture_base, self.state.base_logits = True, None
        try:
            outputs = forward()
            logits = self.state.base_logits
        finally:
            self.state.capture_base, self.state.base_logits = False, None
        if logits is None:
            raise RuntimeError("the SCALE head did not hand over the base logits (is this a Preserve or Route model?)")
        return outputs, logits

    @contextlib.contextmanager
    def slices(self, inputs: dict[str, Any]) -> Iterator[Callable[[slice], torch.Tensor]]:
        """Within the block the head keeps the base logits of each slice of positions it runs on
        (`scale_cl.train.chunked_loss`); yields the reader of the slice it ran on last."""

        def kept(positions: slice) -> torch.Tensor:
            if self.state.base_logits is None:
                raise RuntimeError("the SCALE head did not hand over the base logits of a slice")
            return self.state.base_logits

        self.state.capture_base, self.state.base_logits = True, None
        try:
            yield kept
        finally:
            self.state.capture_base, self.state.base_logits = False, None


class CopyTeacher:
    """A frozen copy of the base model run on the same batch, without gradient (LwF's second forward pass), on the
    batch's device and, with ``bf16``, under bf16 autocast as the student trains (the stage's ``precision``: the
    Trainer's autocast covers the student's forward pass only)."""

    def __init__(self, base: nn.Module, bf16: bool = False) -> None:
        self.model = base.eval().requires_grad_(False)
        self.bf16 = bf16

    def run(self, forward: Callable[[], Any], inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        device = inputs["input_ids"].device
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with torch.no_grad(), autocast:
            logits = self.model(**model_inputs).logits
        return forward(), logits

    @contextlib.contextmanager
    def slices(self, inputs: dict[str, Any]) -> Iterator[Callable[[slice], torch.Tensor]]:
        """The copy's logits of the batch (no gradient), read a slice of positions at a time."""
        logits = self.run(lambda: None, inputs)[1]
        yield lambda positions: logits[:, positions]


def free_teacher(model: nn.Module) -> bool:
    """Whether ``model``'s own forward pass computes the base model's logits exactly: its method declares so
    (`MethodSpec.base_logits_exact`; a two-path method's only in route mode, where both paths run), with the base
    vocabulary (an extended vocabulary's new rows train inside the original stream, which then is no longer the
    base)."""
    from scale_cl.methods import scale_spec
    from scale_cl.tuner.scale_state import scale_config_of

    route = getattr(model, "scale_route", None)
    if route is None or any(name.endswith("weight_new") for name, _ in model.named_parameters()):
        return False
    spec = scale_spec(scale_config_of(model).method)
    return spec.base_logits_exact and (route.active or not spec.two_paths)


def teacher_for(model: nn.Module, load_base: Callable[[], nn.Module], bf16: bool = False) -> HeadTeacher | CopyTeacher:
    """The cheapest exact teacher for ``model``: its own head (in the student's precision), or a frozen copy
    (``load_base()``) of the base, run in bf16 autocast with ``bf16`` (the stage's precision)."""
    return HeadTeacher(model) if free_teacher(model) else CopyTeacher(load_base(), bf16)


@dataclass
class Distillation:
    """What the Trainer needs: the settings and the teacher."""

    config: DistillConfig
    teacher: HeadTeacher | CopyTeacher
