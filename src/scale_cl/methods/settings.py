"""Experiment-level settings of the seven methods: how each is set up, and each one's learning rate.

Both experiments (``scale-cl bio``, ``scale-cl cpt``) share these dataclasses, so every method is
configured the same way everywhere (``--options.hidden_up 256``, ``--train.lora_lr 1e-4``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scale_cl.config import ScaleConfig

MATCH = "match"


def check_methods(methods: list[str]) -> None:
    """Raise a ValueError unless ``methods`` is a non-empty list of known method names."""
    from scale_cl.methods import METHOD_NAMES

    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown or not methods:
        raise ValueError(f"unknown methods {unknown}; valid methods: {', '.join(METHOD_NAMES)}")


@dataclass
class MethodSettings:
    """How each continual-learning method is set up (its options of `scale_cl.prepare`)."""

    hidden_up: int = field(default=64, metadata={"help": "SCALE: width added to the residual stream"})
    ffn_up: int = field(default=64, metadata={"help": "SCALE: width added to every FFN"})
    preserve_layers: int = field(
        default=-1, metadata={"help": "SCALE: L_fp (W12 frozen below it); -1 = all but the last layer"}
    )
    collab_modules: str = field(
        default="attn+ffn",
        metadata={"help": "SCALE-Adapt/Route: where W12 trains in collaborative layers: attn, ffn or attn+ffn"},
    )
    route_tau: float = field(default=0.5, metadata={"help": "SCALE-Route: cosine threshold of Eq. 5"})
    w21_init: str = field(default="svd", metadata={"help": "SCALE: W21 initialiser (zero, random, svd)"})
    w22_init: str = field(default="zero", metadata={"help": "SCALE: W22 initialiser (zero, random, svd)"})
    lora_rank: str = field(
        default=MATCH, metadata={"help": "LoRA rank, or 'match' for SCALE-Route's trainable parameters"}
    )
    freeze_layers: int = field(
        default=1, metadata={"help": "Freeze: bottom decoder layers frozen (with the embedding)"}
    )
    llama_pro_blocks: str = field(
        default=MATCH, metadata={"help": "LLaMA Pro: blocks added, or 'match' for SCALE-Route's trainable parameters"}
    )

    def validate(self, layers: int, head_dim: int) -> None:
        """Raise a ValueError for settings that cannot fit a model of ``layers`` layers and head size ``head_dim``."""
        if self.hidden_up <= 0 or self.hidden_up % head_dim:
            raise ValueError(
                f"options.hidden_up={self.hidden_up} must be a positive multiple of the head size {head_dim}"
            )
        if self.ffn_up <= 0:
            raise ValueError(f"options.ffn_up must be positive, got {self.ffn_up}")
        if self.preserve_layers >= layers or self.freeze_layers > layers:
            raise ValueError(
                f"options.preserve_layers={self.preserve_layers} and options.freeze_layers={self.freeze_layers} "
                f"must be below the model's {layers} layers"
            )
        self.scale_config(layers)  # collab_modules, inits and route_tau are checked by ScaleConfig
        for name in ("lora_rank", "llama_pro_blocks"):
            value = getattr(self, name)
            if value != MATCH and not (str(value).isdigit() and int(value) > 0):
                raise ValueError(f"options.{name} must be '{MATCH}' or a positive integer, got {value!r}")

    def scale_config(self, layers: int, method: str = "route") -> ScaleConfig:
        preserve = layers - 1 if self.preserve_layers < 0 else self.preserve_layers
        return ScaleConfig(
            hidden_up=self.hidden_up,
            ffn_up=self.ffn_up,
            method=method,
            preserve_layers=preserve,
            collab_modules=tuple(self.collab_modules.split("+")),
            route_tau=self.route_tau,
            w21_init=self.w21_init,
            w22_init=self.w22_init,
            seed=0,
        )

    def prepare_options(self, method: str, layers: int) -> dict[str, Any]:
        """Keyword options of `scale_cl.prepare` for ``method``; 'match' counts against SCALE-Route."""
        route = self.scale_config(layers)
        if method.startswith("scale_"):
            return {"scale": route}
        if method == "lora":
            return {"rank": MATCH, "match": route} if self.lora_rank == MATCH else {"rank": int(self.lora_rank)}
        if method == "llama_pro":
            if self.llama_pro_blocks == MATCH:
                return {"blocks": MATCH, "match": route}
            return {"blocks": int(self.llama_pro_blocks)}
        if method == "freeze":
            return {"layers": self.freeze_layers}
        return {}


@dataclass
class MethodRates:
    """One learning rate per method (0 = the stage's ``lr``): methods are compared at matched learning."""

    fft_lr: float = field(default=0.0, metadata={"help": "learning rate of fft (0 = lr)"})
    lora_lr: float = field(default=0.0, metadata={"help": "learning rate of lora (0 = lr)"})
    freeze_lr: float = field(default=0.0, metadata={"help": "learning rate of freeze (0 = lr)"})
    llama_pro_lr: float = field(default=0.0, metadata={"help": "learning rate of llama_pro (0 = lr)"})
    scale_preserve_lr: float = field(default=0.0, metadata={"help": "learning rate of scale_preserve (0 = lr)"})
    scale_adapt_lr: float = field(default=0.0, metadata={"help": "learning rate of scale_adapt (0 = lr)"})
    scale_route_lr: float = field(default=0.0, metadata={"help": "learning rate of scale_route (0 = lr)"})

    def lr_of(self, method: str) -> float:
        return getattr(self, f"{method}_lr") or self.lr  # type: ignore[attr-defined]
