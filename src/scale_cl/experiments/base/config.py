"""Settings of the clean base model: English corpus, architecture, pre-training; presets ``clean-en`` and ``micro``.

Why a base of our own: the one real model available offline (SmolLM2-135M-Instruct, de-quantised
from Q4_1) *improves* on English under any update, because training its weights repairs
quantisation error; and a CPU budget is far too short for a 135M model to drift. A small model
pre-trained here on English alone has neither problem, and its tokenizer (byte-level BPE trained on
English only) makes a new script cost several tokens per character, as it does for real
English-centric models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from scale_cl.bounds import check_fields
from scale_cl.data.corpus import CorpusConfig
from scale_cl.experiments.experiment import ExperimentConfig
from scale_cl.experiments.presets import load_preset
from scale_cl.train.config import StageConfig

PRESETS = ("clean-en", "micro")


@dataclass
class ArchitectureConfig:
    """A Llama-family decoder as in SmolLM2 / Llama-3.2: GQA, RMSNorm, SwiGLU, RoPE, tied embeddings."""

    section: ClassVar[str] = "model."  # where its settings are given (messages name them so)

    vocab_size: int = field(
        default=8192, metadata={"ge": 257, "help": "byte-level BPE vocabulary trained on the English text"}
    )
    hidden_size: int = field(default=192, metadata={"ge": 1, "help": "residual stream width"})
    layers: int = field(default=6, metadata={"ge": 1, "help": "decoder layers"})
    heads: int = field(default=6, metadata={"ge": 1, "help": "query heads (head_dim = hidden_size / heads)"})
    kv_heads: int = field(default=3, metadata={"ge": 1, "help": "key/value heads (grouped-query attention)"})
    intermediate_size: int = field(default=512, metadata={"ge": 1, "help": "SwiGLU hidden width"})
    rope_theta: float = field(default=10000.0, metadata={"gt": 0, "help": "RoPE base"})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be a multiple of model.heads={self.heads}, and heads "
                f"a multiple of model.kv_heads={self.kv_heads}"
            )


@dataclass
class BaseBuildConfig(ExperimentConfig):
    """Every setting of one clean base model; a folder holds one (a different setting needs another --out)."""

    presets: ClassVar[tuple[str, ...]] = PRESETS

    preset: str = field(default="clean-en", metadata={"help": "starting point of every setting", "choices": PRESETS})
    seed: int = field(
        default=0, metadata={"ge": 0, "le": 4294967295, "help": "seed of the initialisation and the data order"}
    )
    data: CorpusConfig = field(default_factory=CorpusConfig)
    model: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    train: StageConfig = field(default_factory=lambda: StageConfig(max_steps=1500))  # budgeted in steps
    eval_every: int = field(default=250, metadata={"ge": 1, "help": "measure English perplexity every this many steps"})
    save_every: int = field(
        default=250, metadata={"ge": 0, "help": "write a resumable checkpoint every this many steps"}
    )
    tokenizer_chars: int = field(
        default=0,
        metadata={"ge": 0, "help": "train the tokenizer on this many characters of the text at most; 0 = all"},
    )
    min_english_share: float = field(
        default=0.9,
        metadata={
            "ge": 0,
            "le": 1,
            "help": "least share of ASCII among the text's letters (refuses text that is not English)",
        },
    )

    def __post_init__(self) -> None:
        self.check_experiment()
        if self.train.max_steps <= 0:
            raise ValueError("train.max_steps must be positive: pre-training is budgeted in optimizer steps")

    def check(self) -> None:
        """The checks of the final settings, before any text is read (the command line runs them): English text is
        given. (Not in ``__post_init__``: the micro preset names no text, which the options then give.)"""
        if not self.data.train:
            raise ValueError(
                "no English text given: pass --data.train FILE... (.txt/.jsonl/.parquet, globs, hf:...); "
                "`python measurements/cpt_corpus.py --corpora english-base` builds the default corpus"
            )


def preset(name: str) -> BaseBuildConfig:
    """The settings of preset ``name``: ``scale_cl/configs/base/<name>.yaml`` on the defaults (its file says why)."""
    return load_preset(BaseBuildConfig(), "base", name, PRESETS)


@dataclass
class BaseCommand:
    """``scale-cl base``: the clean base's settings (`BaseBuildConfig`) and its output folder."""

    out: str | None = field(
        default=None,
        metadata={
            "help": "output folder (default: outputs/<preset>; outputs/clean-en is what --model clean-en names)",
            "type": str,
            "metavar": "DIR",
        },
    )
    base: BaseBuildConfig = field(default_factory=lambda: preset("clean-en"), metadata={"inline": True})

    def check(self) -> None:
        self.base.check()


def base_settings(name: str = "clean-en") -> BaseCommand:
    """The command's settings with preset ``name``'s experiment settings."""
    return BaseCommand(base=preset(name))
