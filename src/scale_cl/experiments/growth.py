"""How a method's model changes between the tasks of a sequence: shared by `bio --sequence.tasks` and
`cpt --sequence.then`.

With ``growth once`` every method keeps training what it trains from the first task on. With ``per_task`` a SCALE
method is grown again before every later task (everything trained so far frozen into the base, `scale_cl.tuner.stages`)
and LoRA adds an adapter: stacked beside the finished ones (frozen, still acting) or after merging them into the
weights. SCALE-Route cannot be grown again (a Route model routes each token between two paths of the same weights,
which no frozen base computes) and is refused with ``per_task``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from scale_cl.bounds import check_fields

GROWTHS = ("once", "per_task")
LORA_PER_TASK = ("stacked", "merged")


@dataclass
class GrowthSettings:
    """Whether SCALE and LoRA add to the model before every later task of a sequence."""

    section: ClassVar[str] = "sequence."  # where its settings are given (messages name them so)

    growth: str = field(
        default="once",
        metadata={
            "help": "SCALE methods and LoRA in a sequence: 'once' (what was added before the first task keeps "
            "training) or 'per_task' (SCALE grown again before every later task, everything trained so far frozen; "
            "LoRA a new adapter per task, see lora_per_task); not with scale_route, which cannot be frozen",
            "choices": GROWTHS,
        },
    )
    lora_per_task: str = field(
        default="stacked",
        metadata={
            "help": "LoRA with growth per_task: 'stacked' (each finished adapter frozen and kept beside the new one) "
            "or 'merged' (merged into the weights before the next adapter)",
            "choices": LORA_PER_TASK,
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.growth not in GROWTHS:
            raise ValueError(f"{self.section}growth must be one of {GROWTHS}, got {self.growth!r}")
        if self.lora_per_task not in LORA_PER_TASK:
            raise ValueError(f"{self.section}lora_per_task must be one of {LORA_PER_TASK}, got {self.lora_per_task!r}")

    def check_methods(self, methods: list[str], base_quant: str = "none") -> None:
        """Refuse SCALE-Route with ``per_task`` (module doc), and growing on a quantized base (options.base_quant:
        the frozen stages would be stored dense), before anything is written."""
        from scale_cl.methods import method_spec

        for method in methods:
            spec = method_spec(method)
            if self.growth == "per_task" and spec.is_scale and not spec.grows_again:
                raise ValueError(
                    f"{self.section}growth per_task cannot grow {method}: a Route model routes each token between two "
                    f"paths of the same weights, which no frozen base computes; run {method} with growth once"
                )
        if self.growth == "per_task" and base_quant != "none" and any(self.grows(m) for m in methods):
            raise ValueError(
                f"{self.section}growth per_task cannot grow on a quantized base (options.base_quant {base_quant!r}): "
                "each finished stage would be frozen into dense weights; use growth once"
            )

    def grows(self, method: str) -> bool:
        """Whether ``method`` adds to the model before every later task: a SCALE method or LoRA, with ``per_task``."""
        from scale_cl.methods import method_spec

        return self.growth == "per_task" and method_spec(method).grows_again

    def label(self, method: str) -> str:
        """How ``method``'s model changes between tasks, for the report."""
        from scale_cl.methods import method_spec

        if not self.grows(method):
            return "once"
        return f"per_task ({self.lora_per_task})" if method_spec(method).adapter else "per_task"

    def grow(self, model: nn.Module, method: str, options: Any, seed: int, task: int) -> nn.Module:
        """What ``method`` adds before ``task`` (>= 2) with ``per_task`` (module doc); ``options``: the run's
        `scale_cl.experiments.settings.MethodSettings`. SCALE stage ``task`` is seeded ``seed + task - 1``."""
        from scale_cl import upscale
        from scale_cl.methods import method_spec, prepare

        if not method_spec(method).adapter:
            return upscale(model, options.scale_config(method_spec(method).scale_method, seed + task - 1))
        if self.lora_per_task == "merged":
            return prepare(model.merge_and_unload(), method, **options.prepare_options(method, seed))
        name = f"task{task}"
        model.add_adapter(name, copy.deepcopy(model.peft_config["default"]))
        model.base_model.set_adapter(list(model.peft_config))  # every adapter acts; PEFT makes them all trainable
        for param_name, param in model.named_parameters():
            param.requires_grad_(f".{name}." in param_name)
        return model


__all__ = ["GROWTHS", "LORA_PER_TASK", "GrowthSettings"]
