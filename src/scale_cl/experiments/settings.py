"""Experiment-level settings of the seven methods: how each is set up, and each one's learning rate.

Both experiments (``scale-cl bio``, ``scale-cl cpt``) share these dataclasses, so every method is
configured the same way everywhere (``--options.scale.hidden_up 256``, ``--train.lora_lr 1e-4``).
The SCALE methods' settings are a `ScaleConfig` itself, checked against the model by the same
`scale_cl.tuner.widths.check_fits` that `upscale` uses; its method and seed come from each run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from scale_cl.bounds import check_fields
from scale_cl.methods import METHOD_NAMES, check_quantizable, method_spec
from scale_cl.train.config import StageConfig
from scale_cl.train.distill import NEW_TOKEN_WEIGHTS, DistillConfig
from scale_cl.train.route_calibration import Batch, RouteCalibration
from scale_cl.tuner.arch import refuse_export
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.quant import BASE_QUANTS, check_base_quant
from scale_cl.tuner.widths import base_dims, resolve

MATCH = "match"
W12_SUFFIX = ".w12"  # the name of every ScaleLinear's W12 block ends so


def settings_of(method: str) -> tuple[str, ...]:
    """The `MethodSettings` ``method`` reads (dotted below ``options``; its declaration's `MethodSpec.reads`), or a
    ValueError naming the valid methods."""
    return method_spec(method).reads


def _default_scale() -> ScaleConfig:
    return ScaleConfig(hidden_up=64, ffn_up=64, method="route", preserve_layers=-1)


@dataclass
class MethodSettings:
    """How each continual-learning method is set up (its options of `scale_cl.prepare`)."""

    section: ClassVar[str] = "options."  # where its settings are given (messages name them so)

    scale: ScaleConfig = field(
        default_factory=_default_scale,
        metadata={"help": "the SCALE methods' ScaleConfig (its method and seed are set per run)"},
    )
    lora_rank: str = field(
        default=MATCH, metadata={"help": "LoRA rank, or 'match' for SCALE-Route's trainable parameters"}
    )
    freeze_layers: int = field(
        default=1, metadata={"ge": 0, "help": "Freeze: bottom decoder layers frozen (with the embedding)"}
    )
    llama_pro_blocks: str = field(
        default=MATCH, metadata={"help": "LLaMA Pro: blocks added, or 'match' for SCALE-Route's trainable parameters"}
    )
    w12_lr_ratio: float = field(
        default=1.0,
        metadata={
            "gt": 0,
            "help": "SCALE-Adapt/Route: W12's learning rate as a multiple of the method's (W21, W22, the new norm, "
            "embedding and head parts keep the method's rate); W12 is what writes into the original stream",
        },
    )
    auto_layers: bool = field(
        default=False,
        metadata={
            "help": "SCALE-Adapt/Route: choose options.scale.preserve_layers and collab_modules by short probe runs "
            "instead (the setting that learns most within the forgetting budget; needs data.replay for the "
            "old-domain measurement; scale_cl.experiments.train.layer_choice)"
        },
    )
    auto_layers_budget: float = field(
        default=0.1,
        metadata={
            "ge": 0,
            "help": "with auto_layers: old-domain loss rise allowed per unit of new-domain loss fall in a probe",
        },
    )
    auto_layers_steps: int = field(
        default=10, metadata={"ge": 1, "help": "with auto_layers: optimizer steps of each probe"}
    )
    route_share: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "le": 1,
            "help": "SCALE-Route: choose tau from data instead of options.scale.route_tau: the tau that routes this "
            "share of an old-domain sample's tokens to the preserve path, set again as training goes "
            "(scale_cl.train.route_calibration); 0 = the fixed tau of Eq. 5",
        },
    )
    route_calibrate_every: int = field(
        default=10,
        metadata={"ge": 0, "help": "SCALE-Route with route_share: optimizer steps between calibrations (0 = once)"},
    )
    route_calibration_sequences: int = field(
        default=16,
        metadata={"ge": 1, "help": "SCALE-Route with route_share: old-domain sequences in the calibration sample"},
    )

    base_quant: str = field(
        default="none",
        metadata={
            "help": "store the base model's attention and FFN weights quantized and frozen (bitsandbytes; int8 = "
            "LLM.int8, nf4 = QLoRA's 4-bit NormalFloat): only what a method adds trains, in full precision. SCALE "
            "and LoRA only (LoRA on it is QLoRA); SCALE then preserves the quantized base exactly "
            "(scale_cl.tuner.quant). Needs bitsandbytes: pip install -e '.[quant]' in the checkout",
            "choices": BASE_QUANTS,
        },
    )
    distill_weight: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "help": "weight lambda of a KL term to the base model's next-token distribution (the base as a teacher; "
            "free for SCALE-Preserve and SCALE-Route, whose forward pass computes the base logits; a frozen copy of "
            "the base otherwise: LwF); 0 = off. Replayed sequences weigh 1, new-domain ones by distill_new_tokens "
            "(scale_cl.train.distill)",
        },
    )
    distill_temperature: float = field(
        default=1.0, metadata={"gt": 0, "help": "with distill_weight: softmax temperature T of teacher and model"}
    )
    distill_new_tokens: str = field(
        default="confidence",
        metadata={
            "help": "with distill_weight: the weight of the term on a new-domain position: confidence = exp(-H) of "
            "the base's distribution there (sure of the English inside Korean text, unsure of the Korean), all = "
            "1 (plain LwF), none = 0 (replayed text only)",
            "choices": NEW_TOKEN_WEIGHTS,
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.scale, ScaleConfig):
            raise ValueError(f"options.scale must be a ScaleConfig, got {type(self.scale).__name__}")
        for name in ("lora_rank", "llama_pro_blocks"):
            value = getattr(self, name)
            if value != MATCH and not (str(value).isdigit() and int(value) > 0):
                raise ValueError(f"options.{name} must be '{MATCH}' or a positive integer, got {value!r}")
        check_base_quant(self.base_quant)
        if self.distill_new_tokens not in NEW_TOKEN_WEIGHTS:
            raise ValueError(
                f"options.distill_new_tokens must be one of {NEW_TOKEN_WEIGHTS}, got {self.distill_new_tokens!r}"
            )
        if self.route_share and self.scale.router != "cosine":
            raise ValueError(
                f"options.route_share calibrates Eq. 5's cosine threshold; options.scale.router={self.scale.router!r} "
                "has none: set route_share 0, or router cosine"
            )
        check_fields(self)
        self.distill_weight, self.distill_temperature = float(self.distill_weight), float(self.distill_temperature)
        self.w12_lr_ratio = float(self.w12_lr_ratio)  # 1 and 1.0 are one setting (cache keys, run folders)
        self.route_share = float(self.route_share)

    def scale_config(self, method: str = "route", seed: int = 0) -> ScaleConfig:
        """The ScaleConfig of a run: ``options.scale`` with the run's SCALE method and seed."""
        return replace(self.scale, method=method, seed=seed)

    def validate(self, model_config: Any, methods: list[str]) -> None:
        """Raise a ValueError for settings that ``methods`` read and that cannot fit this model (its HF config).

        The SCALE settings are checked by `scale_cl.tuner.widths.check_fits`, exactly as `upscale` will check them.
        """
        for method in methods:
            check_quantizable(method, self.base_quant)  # before anything is written
        reads = {setting.split(".")[0] for m in methods for setting in settings_of(m)}
        matched = {"lora_rank": self.lora_rank, "llama_pro_blocks": self.llama_pro_blocks}
        if "scale" in reads or any(matched[name] == MATCH for name in reads & set(matched)):
            refuse_export(model_config)  # merged blocks: grown from its saved folder instead
            dims = base_dims(model_config)  # a model scale_cl cannot upscale is refused here
            try:
                resolve(self.scale_config(), dims)
            except ValueError as err:
                raise ValueError(f"options.scale.{err}") from err  # names the setting: options.scale.hidden_up=...
        layers = model_config.get_text_config().num_hidden_layers
        if "freeze_layers" in reads and self.freeze_layers > layers:
            raise ValueError(f"options.freeze_layers={self.freeze_layers} exceeds the model's {layers} decoder layers")

    def prepare_options(self, method: str, seed: int = 0) -> dict[str, Any]:
        """Keyword options of `scale_cl.prepare` for ``method``; 'match' counts against SCALE-Route."""
        spec = method_spec(method)
        quant = {"base_quant": self.base_quant} if self.base_quant != "none" else {}
        if spec.is_scale:
            return {"scale": self.scale_config(spec.scale_method, seed), **quant}
        options: dict[str, Any] = {}
        for option, setting in spec.prepare_settings:
            value = getattr(self, setting)
            if option != spec.match_option:
                options[option] = value
            elif value == MATCH:
                options.update({option: MATCH, "match": self.scale_config("route", seed)})
            else:
                options[option] = int(value)
        return {**options, **quant} if spec.quantizable_base else options

    def chooses_layers(self, method: str) -> bool:
        """Whether ``method``'s L_fp and collaborative modules come from probe runs (`..train.layer_choice`)."""
        return "auto_layers" in settings_of(method) and self.auto_layers

    def calibrates_route(self, method: str) -> bool:
        """Whether ``method`` chooses its Eq. 5 threshold from data (`scale_cl.train.route_calibration`)."""
        return "route_share" in settings_of(method) and self.route_share > 0

    def route_calibration(
        self, method: str, model: Any, batches: Callable[[int], list[Batch]], bf16: bool
    ) -> RouteCalibration | None:
        """``method``'s tau calibration (`scale_cl.train.route_calibration`), or None when its tau is fixed.

        ``batches(n)``: the first ``n`` sequences of the experiment's old-domain sample as model-input batches.
        """
        if not self.calibrates_route(method):
            return None
        sample = batches(self.route_calibration_sequences)
        return RouteCalibration(model, sample, self.route_share, self.route_calibrate_every, bf16)

    def distill_config(self, method: str) -> DistillConfig | None:
        """``method``'s distillation to the base model (`scale_cl.train.distill`), or None when it trains without."""
        if "distill_weight" not in settings_of(method) or not self.distill_weight:
            return None
        return DistillConfig(self.distill_weight, self.distill_temperature, self.distill_new_tokens)

    def lr_ratios(self, method: str) -> dict[str, float]:
        """Learning-rate multiples of parameter groups for ``method``'s optimizer, by parameter-name suffix
        (`scale_cl.train.trainer.CheckpointingTrainer`); empty = one rate for everything."""
        if "w12_lr_ratio" in settings_of(method) and self.w12_lr_ratio != 1.0:
            return {W12_SUFFIX: self.w12_lr_ratio}
        return {}


@dataclass
class MethodStageConfig(StageConfig):
    """A training stage that every method runs: one learning rate per method (matched learning)."""

    method_lr: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "gt": 0,
            "help": "learning rate per method, METHOD=LR (methods not named use lr)",
            "keys": METHOD_NAMES,
            "key_suffix": "_lr",
            "value_type": float,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # the rates' range too
        for method in self.method_lr:
            method_spec(method)

    def lr_of(self, method: str) -> float:
        return self.method_lr.get(method, self.lr)
