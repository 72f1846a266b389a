"""A one-call summary of where an upscaled model's parameters are and which of them train."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from scale_cl.tuner.layers import ScaleEmbedding, ScaleHead, ScaleLinear, SplitNorm
from scale_cl.tuner.scale_state import StageRecord, decoder_layers, scale_state_of
from scale_cl.tuner.stages import added_parameters


@dataclass
class ParamSummary:
    total: int
    trainable: int
    # (place, parameter name) -> trainable count, e.g. ("attn", "w21")
    trainable_by_place: dict[tuple[str, str], int] = field(default_factory=dict)
    collaborative_layers: list[int] = field(default_factory=list)
    # a grown model's stages, first to current: (method, hidden_up, ffn_up, parameters added)
    stages: list[tuple[str, int, int, int]] = field(default_factory=list)

    def __str__(self) -> str:
        share = 100 * self.trainable / max(self.total, 1)
        lines = [f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {share:.4f}"]
        for number, (method, hidden_up, ffn_up, added) in enumerate(self.stages, start=1):
            now = "now" if number == len(self.stages) else "frozen"
            stage = f"stage {number} ({method}, +{hidden_up} wide, +{ffn_up} FFN, {now})"
            lines.append(f"  {stage}: {added:,} params added")
        for (place, name), count in sorted(self.trainable_by_place.items()):
            lines.append(f"  {place:<10} {name:<8} {count:>14,}")
        layers = self.collaborative_layers
        lines.append(f"  W12 trains in decoder layers {layers}" if layers else "  W12 trains nowhere")
        return "\n".join(lines)


def _place(module: nn.Module) -> str:
    if isinstance(module, ScaleLinear):
        return module.sublayer
    if isinstance(module, ScaleEmbedding):
        return "embedding"
    if isinstance(module, ScaleHead):
        return "head"
    if isinstance(module, SplitNorm):
        return "norm"
    return type(module).__name__


def parameter_summary(model: nn.Module) -> ParamSummary:
    """Count each parameter once (a tied embedding/head too) and group the trainable ones."""
    seen: set[int] = set()
    total = trainable = 0
    by_place: Counter[tuple[str, str]] = Counter()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            if param.requires_grad:
                trainable += param.numel()
                by_place[(_place(module), name)] += param.numel()
    collaborative = [
        index
        for index, layer in enumerate(decoder_layers(model))
        if any(isinstance(m, ScaleLinear) and m.use_w12 for m in layer.modules())
    ]
    return ParamSummary(total, trainable, dict(by_place), collaborative, _stages(model))


def _stages(model: nn.Module) -> list[tuple[str, int, int, int]]:
    """Each stage of a model grown more than once (`scale_cl.tuner.stages`); none for a model upscaled once."""
    state = scale_state_of(model)
    if not state.stages:
        return []
    records = [*state.stages, StageRecord(state.config, state.dims, added_parameters(model))]
    return [(r.config.method, r.config.hidden_up, r.config.ffn_up, r.added) for r in records]
