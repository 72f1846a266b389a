"""The calibrated router: the evidence of the other mixing routers, weighed by a gate fitted to the model and its data.

::

    s_j,t = prior_j + a_r r_j,t + a_H (-H(p_j,t)) + a_top ln max_v p_j,t(v)      w_t = softmax_j(s_j,t)

``a_r``, ``a_H``, ``a_top`` are ``router_prefix_weight``, ``router_entropy_weight``, ``router_top_weight`` (unfitted:
the hybrid's); `fit_gate` fits the gate on the experts' evidence from text the base writes and the new domain's text,
with no gradient into the model. Why, and the other routers as its special cases: docs/design.md §2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from scale_cl.tuner.routing.posterior import Evidence, MixtureRouter, document_starts, running_ratio
from scale_cl.tuner.routing.router import register_router

GATE_SETTINGS = ("router_prior", "router_decay", "router_prefix_weight", "router_entropy_weight", "router_top_weight")


class CalibratedRouter(MixtureRouter):
    """The module doc's gate over the prefix's evidence and each expert's confidence."""

    name = "calibrated"
    reads = GATE_SETTINGS

    def mixture(self, setting: Callable[[str], Any]) -> dict[str, Any]:
        return {
            "prefix": True,
            "prior": setting("router_prior"),
            "decay": setting("router_decay"),
            "confidence": None,
            "prefix_weight": setting("router_prefix_weight"),
            "entropy_weight": setting("router_entropy_weight"),
            "top_weight": setting("router_top_weight"),
        }


register_router(CalibratedRouter())


@dataclass(frozen=True)
class Gate:
    """The calibrated router's settings (module doc), ``ScaleConfig``'s ``router_<name>`` fields."""

    prior: float = 0.0
    decay: float = 0.95
    prefix_weight: float = 1.0
    entropy_weight: float = 3.0
    top_weight: float = 0.0

    def settings(self) -> dict[str, float]:
        """As `scale_cl.tuner.modes.set_live_settings` takes them."""
        return {f"router_{name}": value for name, value in asdict(self).items()}


def gate_log_weights(evidence: Evidence, gate: Gate, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """(E, B, T) each expert's log-weight under ``gate``, as `posterior_mix` computes it on a batch read whole (its
    running ratio from the batch's start)."""
    experts, rows, length = evidence.next_log_probs.shape
    prior = torch.zeros(experts, dtype=evidence.next_log_probs.dtype, device=evidence.ids.device)
    prior[0] = gate.prior
    starts = document_starts(evidence.ids, eos_ids).repeat(experts, 1)
    ratio = running_ratio(evidence.prefix_evidence().reshape(-1, length), starts, gate.decay)
    score = prior[:, None, None] + gate.prefix_weight * ratio.view(experts, rows, length)
    score = score + gate.entropy_weight * evidence.neg_entropy + gate.top_weight * evidence.top
    return torch.log_softmax(score, dim=0)


OBJECTIVES = ("likelihood", "classification")
DECAYS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)  # the decays a fit tries (the others' weights fitted at each)
# Each fitted weight's range: ScaleConfig's for its router_<name> field.
RANGES = {
    "prior": (-20.0, 20.0),
    "prefix_weight": (0.0, 10.0),
    "entropy_weight": (-100.0, 100.0),
    "top_weight": (-100.0, 100.0),
}


@dataclass(frozen=True)
class GateFit:
    """A fitted gate and what it reached on the fitting text: ``value`` the objective (higher is better), by decay
    tried; per side, a token's mean log-likelihood under the mixture and the base's mean weight."""

    gate: Gate
    objective: str
    value: float
    by_decay: dict[float, float] = field(default_factory=dict)
    old_log_likelihood: float = 0.0
    new_log_likelihood: float = 0.0
    old_base_weight: float = 0.0
    new_base_weight: float = 0.0


@dataclass(frozen=True)
class _Side:
    """One side's evidence at its predicted positions, flattened (E, N), its running ratio at one decay."""

    ratio: torch.Tensor
    neg_entropy: torch.Tensor
    top: torch.Tensor
    next_log_probs: torch.Tensor
    target: int | torch.Tensor  # the expert whose text it is: 0 (the base) on the old side, the newest on the new;
    # per position (N,) on text that switches sides


def _side(
    batches: Sequence[Evidence], decay: float, eos_ids: tuple[int, ...], target: int | Sequence[torch.Tensor]
) -> _Side:
    """``target``: the expert whose text it is, or per batch (B, T) whether the newest wrote each next token."""
    ratios, entropies, tops, log_probs, targets = [], [], [], [], []
    for index, evidence in enumerate(batches):
        experts, rows, length = evidence.next_log_probs.shape
        starts = document_starts(evidence.ids, eos_ids).repeat(experts, 1)
        ratio = running_ratio(evidence.prefix_evidence().reshape(-1, length), starts, decay)
        where = evidence.predicted()
        ratios.append(ratio.view(experts, rows, length)[:, where].double())
        entropies.append(evidence.neg_entropy[:, where].double())
        tops.append(evidence.top[:, where].double())
        log_probs.append(evidence.next_log_probs[:, where].double())
        if not isinstance(target, int):
            targets.append(target[index][where].long() * (experts - 1))
    columns = (torch.cat(part, dim=1) for part in (ratios, entropies, tops, log_probs))
    return _Side(*columns, target=target if isinstance(target, int) else torch.cat(targets))


def _objective(side: _Side, theta: torch.Tensor, objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the side's mean objective, its log-weights (E, N)) at ``theta`` = (prior, prefix, entropy, top weights)."""
    prior = torch.zeros(side.ratio.shape[0], 1, dtype=theta.dtype)
    prior[0, 0] = 1.0
    score = theta[0] * prior + theta[1] * side.ratio + theta[2] * side.neg_entropy + theta[3] * side.top
    log_w = torch.log_softmax(score, dim=0)
    if objective == "likelihood":
        return torch.logsumexp(log_w + side.next_log_probs, dim=0).mean(), log_w
    if isinstance(side.target, int):
        return log_w[side.target].mean(), log_w
    return log_w.gather(0, side.target[None]).mean(), log_w


def fit_gate(
    old: Sequence[Evidence],
    new: Sequence[Evidence],
    eos_ids: tuple[int, ...],
    objective: str = "likelihood",
    decays: Sequence[float] = DECAYS,
    steps: int = 100,
    switching: Sequence[tuple[Evidence, torch.Tensor]] = (),
) -> GateFit:
    """The gate that best reads text of both sides (module doc), fitted on their evidence alone (no gradient into the
    model): ``old`` the base's side (text the base writes), ``new`` the new domain's (the training text); each side
    counts alike. ``objective`` ``"likelihood"``: the mixture's mean log-likelihood of the next token;
    ``"classification"``: the mean log-weight of the expert whose text it is (the base on the old side, the newest
    model on the new). ``switching``: a third side, text that changes sides within a sequence, each batch's
    evidence with whether the newest model wrote each next token (B, T). With k + 1 experts (a grown model) the sides
    are the same: the gate's weights are shared, and the base's text against the newest's sets them. At each decay
    the other four weights are fitted by L-BFGS from the unfitted gate and clipped to their ranges; the decay whose
    gate scores best wins."""
    if objective not in OBJECTIVES:
        raise ValueError(f"a gate is fitted by one of {OBJECTIVES}, got {objective!r}")
    if not old or not new:
        raise ValueError("a gate is fitted on both sides: the base's text (old) and the new domain's (new)")
    experts = new[0].next_log_probs.shape[0]
    low = torch.tensor([r[0] for r in RANGES.values()], dtype=torch.float64)
    high = torch.tensor([r[1] for r in RANGES.values()], dtype=torch.float64)
    start = Gate()
    best: tuple[float, torch.Tensor, float] | None = None
    by_decay = {}
    for decay in decays:
        sides = (_side(old, decay, eos_ids, 0), _side(new, decay, eos_ids, experts - 1))
        if switching:  # text that changes sides: the decay is chosen by how fast the evidence must fade
            evidence, written = zip(*switching, strict=True)
            sides = (*sides, _side(evidence, decay, eos_ids, written))
        theta = torch.tensor(
            [start.prior, start.prefix_weight, start.entropy_weight, start.top_weight], dtype=torch.float64
        )
        theta.requires_grad_(True)
        optimizer = torch.optim.LBFGS([theta], max_iter=steps, line_search_fn="strong_wolfe")

        def loss(sides=sides, theta=theta, optimizer=optimizer) -> torch.Tensor:
            optimizer.zero_grad()
            value = -sum(_objective(side, theta, objective)[0] for side in sides) / len(sides)
            value.backward()
            return value

        optimizer.step(loss)
        with torch.no_grad():
            fitted = torch.minimum(torch.maximum(torch.nan_to_num(theta.detach()), low), high)
            value = float(sum(_objective(side, fitted, objective)[0] for side in sides) / len(sides))
        by_decay[decay] = value
        if best is None or value > best[0]:
            best = (value, fitted, decay)
    value, theta, decay = best
    gate = Gate(float(theta[0]), decay, float(theta[1]), float(theta[2]), float(theta[3]))
    readings = []
    with torch.no_grad():
        for side in (_side(old, decay, eos_ids, 0), _side(new, decay, eos_ids, experts - 1)):
            _, log_w = _objective(side, theta, "likelihood")
            readings.append(
                (float(torch.logsumexp(log_w + side.next_log_probs, 0).mean()), float(log_w[0].exp().mean()))
            )
    (old_ll, old_w), (new_ll, new_w) = readings
    return GateFit(gate, objective, value, by_decay, old_ll, new_ll, old_w, new_w)
