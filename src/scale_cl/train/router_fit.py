"""Fitting the calibrated router's gate after training, without old data (`scale_cl.tuner.routing.calibrated`).

The gate is fitted on two sides of text. The new side is the new domain's training text, which the model trained on.
The old side is text the base writes itself, sampled from a document start: a copy of the model read as SCALE-Preserve
at ``alpha = 0`` is the base model (Theorem 3.1; SCALE-Route's preserve path too), so no second model is loaded; the
two-model control (`scale_cl.eval.mixture.ModelMixture`) samples its first model. A model grown k times (k + 1
nested experts) is fitted on the same sides: the gate's weights are shared by every expert, and the base's text against
the newest's sets them (a side of each earlier expert's own samples made them shrink: docs/design.md §2); a control of
k + 1 models likewise. Nothing else is read: no held-out text, no old-domain evaluation set. The evidence of every side
comes from one forward pass per batch of the model as it is (`RouteState.evidence`, ``ModelMixture.evidence``); the
fit itself reads only that evidence and takes no gradient into the model. One recipe (`GateRecipe`) serves every
benchmark and `scale-cl train`.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from scale_cl.data.pseudo_replay import generate_blocks
from scale_cl.eval.mixture import ModelMixture
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.modes import set_live_settings, set_method
from scale_cl.tuner.routing.calibrated import OBJECTIVES, GateFit, fit_gate
from scale_cl.tuner.routing.posterior import Evidence
from scale_cl.tuner.scale_state import ScaleState, scale_config_of, scale_state_of

Batch = Mapping[str, torch.Tensor]  # input_ids (B, T), attention_mask where padded; other keys are not read


@dataclass(frozen=True)
class GateRecipe:
    """How a gate is fitted, the same on every benchmark: ``sequences`` of the training text (the first of those
    given: callers spread them over the training set) and as many the base samples at ``temperature``, with
    ``switching`` the two spliced into text that changes sides; ``objective`` one of `OBJECTIVES` (classification:
    on the biography benchmark the likelihood objective leans on the old model, docs/design.md §2)."""

    objective: str = "classification"
    sequences: int = 64
    temperature: float = 1.0
    batch_size: int = 8  # sequences a forward pass reads
    sample_batch_size: int = 64  # sequences the base samples at once (decoding is latency-bound: the wider the better)
    switching: bool = True  # also fit on the two sides spliced into text that changes sides (blocks of text only)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"a gate is fitted by one of {OBJECTIVES}, got {self.objective!r}")
        if min(self.sequences, self.batch_size, self.sample_batch_size) < 1 or self.temperature <= 0:
            raise ValueError(f"a gate recipe needs sequences and batch sizes >= 1 and temperature > 0, got {self}")


@dataclass(frozen=True)
class RouterFit:
    """A fitted gate, the experts it weighs, the text it was fitted on (sizes) and what fitting cost."""

    fit: GateFit
    experts: int
    old_sequences: int
    new_sequences: int
    length: int
    seconds: float

    def summary(self) -> dict[str, Any]:
        """As a run's result records it."""
        fit = asdict(self.fit)
        return {
            **{key: value for key, value in fit.items() if key not in ("gate", "by_decay")},
            "by_decay": {str(decay): value for decay, value in self.fit.by_decay.items()},
            "experts": self.experts,
            "sequences": [self.old_sequences, self.new_sequences],
            "length": self.length,
            "seconds": round(self.seconds, 3),
        }


def check_routed(model: nn.Module) -> ScaleConfig:
    """The model's `ScaleConfig`, refused unless its gate can be fitted here: SCALE-Route or SCALE-Preserve (their
    base logits, and a grown Preserve model's earlier stages', are exact)."""
    config = scale_config_of(model)
    if config.method not in ("route", "preserve"):
        raise ValueError(
            f"the calibrated router reads SCALE-Route and SCALE-Preserve (their base logits are exact), not "
            f"SCALE-{config.method.capitalize()}: fit it on a model trained with either"
        )
    return config


def scale_reads_gate(model: nn.Module) -> bool:
    """Whether ``model`` is a SCALE model read by the calibrated router, whose gate a fit sets (SCALE-Route or
    -Preserve; not a baseline, whose options.scale.router reads nothing)."""
    if not isinstance(getattr(model, "scale_state", None), ScaleState):
        return False
    config = scale_config_of(model)
    return config.router == "calibrated" and config.routed


def train_unrouted(model: nn.Module) -> None:
    """Set ``model`` to train as SCALE does without a mixing router (Eq. 5's cosine router: SCALE-Route's two paths,
    SCALE-Preserve unrouted): the calibrated router is a reading fitted after training, not a gate to train through."""
    set_live_settings(model, router="cosine")


def expert_count(model: nn.Module) -> int:
    """How many experts the calibrated router mixes: the base and the model now, and on a model grown k times each
    earlier stage's model between them (k + 1); a control's models."""
    if isinstance(model, ModelMixture):
        return len(model.experts)
    return len(scale_state_of(model).stage_widths()) + 1


def expert_view(model: nn.Module, expert: int) -> nn.Module:
    """A model that is ``model``'s expert ``expert`` alone, to sample its text: a control's model; for a SCALE model
    a copy read as SCALE-Preserve at ``alpha = 0``, not routed (Theorem 3.1: the model before this stage), its head
    given only the streams of the stages up to ``expert`` (the nested experts' cumulative sums,
    `scale_cl.tuner.routing.nested`; 0: the base)."""
    count = expert_count(model)
    if not 0 <= expert < count - 1:
        raise ValueError(f"a view is of an expert before the newest, 0..{count - 2}; got {expert}")
    if isinstance(model, ModelMixture):
        return model.experts[expert]
    check_routed(model)
    view = set_live_settings(set_method(copy.deepcopy(model).eval(), "preserve"), up_logit_scale=0.0, router="cosine")
    kept = sum(scale_state_of(model).stage_widths()[: expert + 1])
    if expert < count - 2:  # the later stages' streams read as zeros: their columns add nothing to the logits

        def earlier_streams(_head: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            hidden = args[0].clone()
            hidden[..., kept:] = 0
            return (hidden, *args[1:])

        view.get_output_embeddings().register_forward_pre_hook(earlier_streams)
    return view


def base_view(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that is its base model (`expert_view` 0); a control's first model."""
    return expert_view(model, 0)


def as_batches(text: torch.Tensor | Sequence[Batch], sequences: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The first ``sequences`` rows of ``text`` (a (N, T) tensor of blocks, or batches as a collator gives them) in
    batches of ``batch_size`` with their attention masks."""
    if isinstance(text, torch.Tensor):
        rows = text[:sequences]
        return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in rows.split(batch_size)]
    batches, taken = [], 0
    for batch in text:
        if taken >= sequences:
            break
        ids = batch["input_ids"][: sequences - taken]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask[: ids.shape[0]]
        batches.append({"input_ids": ids, "attention_mask": mask})
        taken += ids.shape[0]
    if not batches:
        raise ValueError("a gate is fitted on the training text: none was given")
    return batches


def spread_sample(data: Any, count: int) -> list[Any]:
    """``count`` items of ``data`` spread evenly over it (a dataset with a length), or its first ``count`` (a
    stream): the training text the gate is fitted on, not one document's first blocks."""
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        size = len(data)
        if size == 0:
            raise ValueError("a gate is fitted on the training text: the training set is empty")
        indices = sorted({int(i) for i in torch.linspace(0, size - 1, min(count, size)).round().tolist()})
        return [data[i] for i in indices]
    return list(itertools.islice(iter(data), count))


def gate_blocks(train: Any, count: int) -> torch.Tensor:
    """``count`` blocks of a corpus's training set (`spread_sample`) as one (N, T) tensor: the fit's new side."""
    return torch.stack([torch.as_tensor(block["input_ids"]) for block in spread_sample(train, count)])


def collect_evidence(model: nn.Module, text: torch.Tensor | Sequence[Batch], batch_size: int = 8) -> list[Evidence]:
    """The experts' `Evidence` on ``text`` (blocks or batches, `as_batches`), from the model read by the calibrated
    router (its evidence does not depend on the gate) or a two-model control; the model's router and mode are restored
    after."""
    batches = as_batches(text, sequences=10**12, batch_size=batch_size) if isinstance(text, torch.Tensor) else text
    mixture = isinstance(model, ModelMixture)
    config = None if mixture else check_routed(model)
    holder = model if mixture else model.scale_route
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    if not mixture:
        set_live_settings(model, router="calibrated")
    holder.evidence = []
    try:
        with torch.no_grad():
            for batch in batches:
                ids, mask = batch["input_ids"].to(device), batch.get("attention_mask")
                model(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None else mask.to(device))
        return [_to_cpu(evidence) for evidence in holder.evidence]
    finally:
        holder.evidence = None
        if config is not None:
            set_live_settings(model, router=config.router)
        model.train(was_training)


def _to_cpu(evidence: Evidence) -> Evidence:
    fields = (evidence.next_log_probs, evidence.neg_entropy, evidence.top, evidence.ids, evidence.attention_mask)
    return Evidence(*(None if t is None else t.cpu() for t in fields))


def fit_router(
    model: nn.Module,
    new_text: torch.Tensor | Sequence[Batch],
    start_id: int,
    *,
    seed: int = 0,
    recipe: GateRecipe = GateRecipe(),
    bf16: bool = False,
) -> RouterFit:
    """Fit the calibrated router's gate (`GateRecipe`) on ``new_text`` (the training text: blocks or batches) and
    as many sequences of its length sampled from the model's base from ``start_id`` (the tokenizer's EOS); set it on
    ``model`` (a SCALE model, a grown one included: its router becomes ``"calibrated"``; a control likewise) and
    return the fit. ``bf16``: the base samples under bf16 autocast (the run's precision)."""
    began = time.perf_counter()
    new = as_batches(new_text, recipe.sequences, recipe.batch_size)
    count = sum(batch["input_ids"].shape[0] for batch in new)
    length = max(batch["input_ids"].shape[1] for batch in new)
    if length < 2:
        raise ValueError(f"a gate is fitted on sequences of two tokens or more, got {length}")
    base, temperature = base_view(model), recipe.temperature
    sampled = generate_blocks(base, start_id, count, length, seed, temperature, recipe.sample_batch_size, bf16)
    old = collect_evidence(model, sampled, recipe.batch_size)
    new_evidence = collect_evidence(model, new, recipe.batch_size)
    switching = []
    if recipe.switching and isinstance(new_text, torch.Tensor):  # blocks of running text (not single questions)
        blocks = torch.cat([batch["input_ids"] for batch in new])
        spliced, written = spliced_sequences(sampled, blocks, seed)
        evidence = collect_evidence(model, spliced, recipe.batch_size)
        switching = list(zip(evidence, written.split(recipe.batch_size), strict=True))
    eos_ids = _eos_ids(model) or (start_id,)
    fit = fit_gate(old, new_evidence, eos_ids, objective=recipe.objective, switching=switching)
    apply_gate(model, fit)
    return RouterFit(fit, expert_count(model), count, count, length, time.perf_counter() - began)


def spliced_sequences(old: torch.Tensor, new: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text that changes sides once, from the two sides' rows (N, T) alike: row i is one side's row i up to a cut
    drawn in the middle three quarters, the other side's after it (old first on even rows, new first on odd); and
    (N, T) whether the newest model wrote each position's next token. No old data: the base's samples and the
    training text."""
    rows, length = old.shape
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randint(length // 8, length - length // 8, (rows,), generator=generator).clamp_min(1)
    after = torch.arange(length)[None, :] >= cuts[:, None]  # a token from the second side
    new_first = (torch.arange(rows) % 2 == 1)[:, None]
    spliced = torch.where(after ^ new_first, new, old)
    written_new = torch.zeros_like(after)
    written_new[:, :-1] = (after ^ new_first)[:, 1:]  # the next token's side
    return spliced, written_new


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    return tuple(model.eos_ids if isinstance(model, ModelMixture) else model.scale_route.eos_ids or ())


def apply_gate(model: nn.Module, fit: GateFit) -> None:
    """Read ``model`` (a SCALE model or a two-model control) by the calibrated router with ``fit``'s gate."""
    gate = fit.gate
    if isinstance(model, ModelMixture):
        model.router, model.prior, model.decay = "calibrated", gate.prior, gate.decay
        weights = ("prefix_weight", "entropy_weight", "top_weight")
        model.gate = {name: getattr(gate, name) for name in weights}
    else:
        set_live_settings(model, router="calibrated", **gate.settings())
