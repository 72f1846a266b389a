"""The SCALE state of an upscaled model, typed: what it is and how it reads (``model.scale_state``).

One object per model, as peft keeps ``model.peft_config``: the shape, fixed at upscale (the backbone, the original
base model's record, the sizes this stage grew, the earlier stages of a grown model) and the readout, the current
stage's `ScaleConfig` (its method, ``alpha``, the router and the router's settings), which `set_method` and
`scale_cl.tuner.modes.set_live_settings` replace. Every part of the model reads it here (the route state holds the
same object), so a setting has one home. It becomes a dict only where it is written down: a checkpoint
(`scale_cl.tuner.io`) records `to_dict`'s parts, and the export writes its own fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torch import nn

from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.widths import Dims

NOT_UPSCALED = "this model is not upscaled by scale_cl; call scale_cl.tuner.upscale(model, config) first"


@dataclass
class StageRecord:
    """An earlier stage of a grown model (`scale_cl.tuner.stages`): its config (its method included), the sizes it
    grew and the parameters it added."""

    config: ScaleConfig
    dims: Dims
    added: int

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "dims": asdict(self.dims), "added": self.added}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageRecord:
        return cls(ScaleConfig.from_dict(data["config"]), Dims(**data["dims"]), data["added"])


@dataclass
class ScaleState:
    """The module doc's state.

    Attributes:
        arch: the attribute holding the backbone (`scale_cl.tuner.arch.ArchSpec.backbone`).
        config: the current stage's `ScaleConfig`: its shape and its readout.
        base: the original base model's record (`scale_cl.tuner.provenance.base_record`: name, class, config,
            sizes, dtype, quantization, fingerprint), as a checkpoint writes it.
        dims: the sizes this stage grew (the base's; on a grown model the model's before its last growth).
        grew_from_parameters: the parameter count before this stage (`scale_cl.tuner.stages.added_parameters`).
        stages: a grown model's earlier stages, oldest first (none on a model upscaled once).
    """

    arch: str
    config: ScaleConfig
    base: dict[str, Any]
    dims: Dims
    grew_from_parameters: int
    stages: list[StageRecord] = field(default_factory=list)

    @property
    def base_class(self) -> str:
        """The original base model's class name (``LlamaForCausalLM``)."""
        return self.base["class"]

    @property
    def base_quant(self) -> str:
        """How the original base model's weights are quantized (``"none"``, `scale_cl.tuner.quant`)."""
        return self.base.get("base_quant", "none")

    def stage_widths(self) -> tuple[int, ...]:
        """The widths of the head's original input by stage: the base's hidden size, then what each earlier stage
        added (one entry for a model upscaled once)."""
        return (self.base["dims"]["hidden"], *(stage.config.hidden_up for stage in self.stages))

    def with_config(self, **changes: Any) -> ScaleConfig:
        """Replace the readout by this config with ``changes`` (checked as a `ScaleConfig` is); returns it."""
        self.config = replace(self.config, **changes)
        return self.config


def scale_state_of(model: nn.Module) -> ScaleState:
    """The `ScaleState` of an upscaled ``model``, or a ValueError that says how to make one."""
    state = getattr(model, "scale_state", None)
    if not isinstance(state, ScaleState):
        raise ValueError(NOT_UPSCALED)
    return state


def scale_config_of(model: Any) -> ScaleConfig:
    """The ScaleConfig an upscaled model was built with (its current method included), a copy to change freely."""
    return replace(scale_state_of(model).config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an upscaled model (its backbone is recorded in its state)."""
    return getattr(model, scale_state_of(model).arch).layers


def stage_records(model: nn.Module) -> list[StageRecord]:
    """The earlier stages of ``model`` (a plain model whose last stage was frozen included); none when it was never
    upscaled."""
    state = getattr(model, "scale_state", None)
    return state.stages if isinstance(state, ScaleState) else []


__all__ = ["ScaleState", "StageRecord", "decoder_layers", "scale_config_of", "scale_state_of", "stage_records"]
