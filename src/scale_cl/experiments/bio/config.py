"""The biography benchmark's configuration: nested dataclasses and the presets micro/small/medium/paper.

Every leaf field is a command-line option (``--task1.lr 1e-4``) and a YAML key (``task1: {lr: ...}``);
its ``metadata["help"]`` is the option's help text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import GPTNeoXConfig

from scale_cl.bounds import check_fields
from scale_cl.data import ATTRIBUTES, bio_spec, splits
from scale_cl.experiments.bio.datasets import QA_LOSSES
from scale_cl.experiments.experiment import ExperimentConfig, output_folder
from scale_cl.experiments.growth import GrowthSettings
from scale_cl.experiments.presets import load_preset
from scale_cl.experiments.settings import MethodSettings, MethodStageConfig
from scale_cl.methods import METHOD_NAMES as ALL_METHODS
from scale_cl.methods import method_spec
from scale_cl.train.config import StageConfig
from scale_cl.tuner.routing.calibrated import OBJECTIVES

PRESETS = ("micro", "small", "medium", "paper")
PACKINGS = ("person", "shuffled")


@dataclass
class DataConfig:
    """The synthetic people and the tokenizer trained on their text."""

    section: ClassVar[str] = "data."  # where its settings are given (messages name them so)

    people: int = field(
        default=600, metadata={"ge": 10, "help": "number of synthetic people (splits keep the paper's shares)"}
    )
    pools: str = field(default="small", metadata={"help": "name-pool sizes: a biography preset (micro, small, paper)"})
    seed: int = field(
        default=0, metadata={"ge": 0, "le": 4294967295, "help": "seed of the generated people and biographies"}
    )
    attributes: list[str] = field(
        default_factory=lambda: list(ATTRIBUTES), metadata={"help": "attributes asked about in Task 0 and Task 1 QA"}
    )
    vocab_size: int = field(
        default=3072, metadata={"ge": 257, "help": "vocabulary of the byte-level BPE trained on the data"}
    )
    qa_people: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "train Task-0 QA (stage 2) on only the first this many of its N/4 people (0 = all); the "
            "held-out people stay the same, so this measures extraction against QA-trained people",
        },
    )
    packing: str = field(
        default="shuffled",
        metadata={
            "help": "pre-training blocks: 'person' (person by person, packed once) or 'shuffled' (the original "
            "benchmark's: every biography in one global random order, packed afresh every epoch)",
            "choices": PACKINGS,
        },
    )
    distinct_templates: bool = field(
        default=True,
        metadata={"help": "a person's biographies use different templates and sentence orders (the original's)"},
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.packing not in PACKINGS:
            raise ValueError(f"data.packing must be one of {PACKINGS}, got {self.packing!r}")
        try:
            bio_spec(self.pools, people=self.people)
        except ValueError as err:
            raise ValueError(f"data.pools: {err}") from err  # unknown biography preset 'tiny'; valid presets: ...
        unknown = [a for a in self.attributes if a not in ATTRIBUTES]
        if unknown or not self.attributes:
            raise ValueError(
                f"data.attributes: unknown attributes {unknown}; valid attributes: {', '.join(ATTRIBUTES)} "
                "(one or more)"
            )
        if not 0 <= self.qa_people <= self.people // 4:
            raise ValueError(
                f"data.qa_people must be between 0 (all) and data.people // 4 = {self.people // 4}, "
                f"got {self.qa_people}"
            )


@dataclass
class BackboneConfig:
    """The GPT-NeoX (Pythia-style) model pre-trained from scratch in stage 1."""

    section: ClassVar[str] = "model."  # where its settings are given (messages name them so)

    hidden_size: int = field(default=128, metadata={"ge": 1, "help": "model width"})
    layers: int = field(default=4, metadata={"ge": 1, "help": "decoder layers"})
    heads: int = field(default=4, metadata={"ge": 1, "help": "attention heads"})
    intermediate_size: int = field(default=512, metadata={"ge": 1, "help": "FFN width"})
    rotary_pct: float = field(
        default=0.25, metadata={"ge": 0, "le": 1, "help": "share of each head's dims that get rotary embeddings"}
    )
    max_seq_len: int = field(default=256, metadata={"ge": 2, "help": "pre-training sequence length (packed)"})

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class Task1Config(MethodStageConfig):
    """Task 1 (new people's QA): one learning rate per method, and the evaluation schedule."""

    section: ClassVar[str] = "task1."  # where its settings are given (messages name them so)

    eval_every: int = field(default=20, metadata={"ge": 1, "help": "evaluate Task 0 and Task 1 every this many steps"})
    early_eval_every: int = field(
        default=5,
        metadata={
            "ge": 0,
            "help": "also evaluate every this many steps up to task1.early_eval_until, where the early "
            "collapse of Task 0 happens (0 = no early schedule)",
        },
    )
    early_eval_until: int = field(default=200, metadata={"ge": 0, "help": "last step of the early evaluation schedule"})
    replay_ratio: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "lt": 1,
            "help": "share of every Task-1 batch replayed from Task 0's training questions (stage 2's QA of people "
            "[0, N/4)); exact in every batch when task1.batch_size x ratio is whole, else over the run. The held-out "
            "Task-0 people (the paper's view) are never replayed; the QA-trained view then reads replayed questions. "
            "0 = no replay",
        },
    )

    qa_loss: str = field(
        default="answer",
        metadata={
            "choices": QA_LOSSES,
            "help": "where Task 1's (and every later cohort's) QA puts its loss: answer (the answer and EOS, as "
            "stage 2 and the original benchmark train) or all (the question's tokens too, so the trained model "
            "learns the question text a prefix router reads)",
        },
    )
    reading_alphas: tuple[float, ...] = field(
        default=(1.0,),
        metadata={
            "type": float,
            "ge": 0,
            "help": "SCALE-Route and SCALE-Preserve: after Task 1, read the trained model (as trained and with each "
            "mixing router) with its new stream's logits weighted by each alpha, Z + alpha Z_up (readings in "
            "seed-<s>/<method>.json, training nothing): alpha above 1 sharpens the new expert's distribution",
        },
    )
    wise_ft_alphas: tuple[float, ...] = field(
        default=(),
        metadata={
            "type": float,
            "ge": 0,
            "le": 1,
            "help": "FFT and Freeze: after Task 1, also evaluate the weights task0 + alpha (trained - task0) at each "
            "alpha (WiSE-FT; readings in seed-<s>/<method>.json, training nothing)",
        },
    )
    likelihood_control: bool = field(
        default=False,
        metadata={
            "help": "methods that do not route: after Task 1, also evaluate the trained model mixed with the Task-0 "
            "model by each mixing router, likelihood, confidence and hybrid (options.scale.router_*; two forward "
            "passes): the control of SCALE's router readings, with each router's AUROC (likelihood_control in "
            "seed-<s>/<method>.json, training nothing)",
        },
    )
    gate_objectives: tuple[str, ...] = field(
        default=("classification",),
        metadata={
            "choices": OBJECTIVES,
            "help": "SCALE-Route and SCALE-Preserve read with the calibrated router: the objectives its gate is "
            "fitted by (on Task 1's training questions against the Task-0 model's own text), one reading each. "
            "classification: the log-weight of the expert whose text it is; likelihood: the mixture's "
            "log-likelihood of the next token on both sides",
        },
    )
    pseudo_replay_ratio: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "lt": 1,
            "help": "share of every Task-1 batch that is text the Task-0 model samples itself from a document start "
            "(pseudo-replay: no stored Task-0 data; loss on every token), on replay's schedule; not with "
            "task1.replay_ratio; 0 = off",
        },
    )
    pseudo_replay_sequences: int = field(
        default=256,
        metadata={
            "ge": 1,
            "help": "with pseudo_replay_ratio: sequences sampled once per Task-0 model and seed (cached beside the "
            "stage models), reused in a fresh order each time they are used up",
        },
    )
    pseudo_replay_tokens: int = field(
        default=64,
        metadata={
            "ge": 2,
            "help": "with pseudo_replay_ratio: tokens per sampled sequence (every one carries loss, so long "
            "sequences outweigh the few answer tokens of the Task-1 questions beside them)",
        },
    )
    pseudo_replay_temperature: float = field(
        default=1.0, metadata={"gt": 0, "help": "with pseudo_replay_ratio: the sampling temperature"}
    )

    def __post_init__(self) -> None:
        self.wise_ft_alphas = tuple(float(a) for a in self.wise_ft_alphas)
        self.reading_alphas = tuple(float(a) for a in self.reading_alphas)
        self.gate_objectives = tuple(self.gate_objectives)
        if not self.gate_objectives or not set(self.gate_objectives) <= set(OBJECTIVES):
            raise ValueError(f"task1.gate_objectives must name one or more of {OBJECTIVES}, got {self.gate_objectives}")
        super().__post_init__()  # every field's range, these included
        if self.qa_loss not in QA_LOSSES:
            raise ValueError(f"{self.section}qa_loss must be one of {QA_LOSSES}, got {self.qa_loss!r}")
        if self.replay_ratio and self.pseudo_replay_ratio:
            raise ValueError(
                f"task1.replay_ratio={self.replay_ratio} and task1.pseudo_replay_ratio={self.pseudo_replay_ratio}: "
                "pseudo-replay takes replay's place; set one of them to 0"
            )


@dataclass
class SequenceConfig(GrowthSettings):
    """A sequence of new-people tasks after Task 0: each trained as Task 1 is, every task measured after
    each; SCALE and LoRA grow once or per task (`scale_cl.experiments.growth`)."""

    tasks: int = field(
        default=1,
        metadata={
            "ge": 1,
            "help": "cohorts of new people trained in turn after Task 0, each with Task 1's settings (1 = the paper's "
            "single Task 1); cohorts of N/10 people while five fit in the unseen half, else N/2 / tasks; results "
            "gain the accuracy matrix, ACC, BWT, FWT and forgetting",
        },
    )


@dataclass
class BioConfig(ExperimentConfig):
    """Every setting of one biography benchmark run."""

    presets: ClassVar[tuple[str, ...]] = PRESETS

    preset: str = field(default="small", metadata={"help": "starting point of every setting", "choices": PRESETS})
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS), metadata={"help": "methods to run"})
    seeds: list[int] = field(
        default_factory=lambda: [0],
        metadata={"ge": 0, "le": 4294967295, "help": "training seeds (mean and spread)", "aliases": ("seed",)},
    )
    eval_people: int = field(default=200, metadata={"ge": 0, "help": "people evaluated per test split (0 = all)"})
    data: DataConfig = field(default_factory=DataConfig)
    model: BackboneConfig = field(default_factory=BackboneConfig)
    pretrain: StageConfig = field(default_factory=StageConfig)
    task0: StageConfig = field(default_factory=StageConfig)
    task1: Task1Config = field(default_factory=Task1Config)
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    # auto_layers probes layer choices on a CPT corpus: cpt's, not taken here (left out of bio's options and YAML)
    options: MethodSettings = field(
        default_factory=MethodSettings,
        metadata={"leave_out": ("auto_layers", "auto_layers_budget", "auto_layers_steps")},
    )

    def __post_init__(self) -> None:
        self.check_experiment()

    def check(self) -> None:
        """The checks of the final settings that need several at once and no model (the backbone is built from
        these settings: its config is known without building it); the command line runs them before anything is
        built. The device and the logging backends are the pipeline's (`scale_cl.experiments.bio.pipeline.validate`,
        which runs this check first, for settings built in Python). (Not in ``__post_init__``: a YAML file and the
        options are applied one after the other, and a Python caller may build the settings in steps.)"""
        splits(self.data.people, self.sequence.tasks)  # the cohorts fit the people
        m = self.model
        if m.hidden_size % m.heads:
            raise ValueError(f"model.hidden_size={m.hidden_size} must be a multiple of model.heads={m.heads}")
        self.options.validate(backbone_config(self), self.methods)  # SCALE widths, freeze_layers: the backbone's
        if self.sequence.tasks > 1:
            t, routes = self.task1, any(method_spec(name).two_paths for name in self.methods)
            unsupported = {
                "task1.replay_ratio": t.replay_ratio,
                "task1.pseudo_replay_ratio": t.pseudo_replay_ratio,
                "task1.wise_ft_alphas": t.wise_ft_alphas,
                "options.distill_weight": self.options.distill_weight,
                "options.route_share": self.options.route_share if routes else 0,
            }
            given = [name for name, value in unsupported.items() if value]
            if given:
                raise ValueError(
                    f"sequence.tasks={self.sequence.tasks} does not take {', '.join(given)} yet: set them off"
                )
            self.sequence.check_methods(self.methods, self.options.base_quant)


def preset(name: str) -> BioConfig:
    """The settings of preset ``name``: ``scale_cl/configs/bio/<name>.yaml`` on the defaults (its file says why)."""
    return load_preset(BioConfig(), "bio", name, PRESETS)


@dataclass
class BioCommand:
    """``scale-cl bio``: the benchmark's settings (`BioConfig`) and its output folder."""

    out: str | None = output_folder("outputs/bio-<preset>")
    cache: str | None = field(
        default=None,
        metadata={
            "help": "folder of the tokenizer and stage-1/2 models (default: <out>/cache); runs that differ only "
            "in Task-1 settings (rates, methods, schedule) can share one, one run at a time",
            "type": str,
            "metavar": "DIR",
        },
    )
    bio: BioConfig = field(default_factory=lambda: preset("small"), metadata={"inline": True})

    def check(self) -> None:
        self.bio.check()


def bio_settings(name: str = "small") -> BioCommand:
    """The command's settings with preset ``name``'s experiment settings."""
    return BioCommand(bio=preset(name))


def backbone_config(cfg: BioConfig, **tokens: Any) -> GPTNeoXConfig:
    """The stage-1 model's config; ``tokens``: vocab_size and the special token ids, once the tokenizer exists."""
    m = cfg.model
    return GPTNeoXConfig(
        hidden_size=m.hidden_size,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        intermediate_size=m.intermediate_size,
        rotary_pct=m.rotary_pct,
        max_position_embeddings=m.max_seq_len,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        **tokens,
    )
