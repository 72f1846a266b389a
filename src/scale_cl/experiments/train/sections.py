"""The sections every corpus training run shares (`scale-cl train`, `scale-cl cpt`, `scale-cl sweep cpt`): ``data``,
``train`` and ``eval`` (``options`` is `scale_cl.experiments.settings.MethodSettings`), and the checks that need
several of them at once (`check_run`).

Every leaf field is a command-line option (``--train.method_lr scale_route=1e-3``) and a YAML key; its
``metadata["help"]`` is the option's help text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from scale_cl.bounds import check_fields
from scale_cl.data.corpus import CorpusConfig
from scale_cl.eval.mixture import MIXTURE_ROUTERS
from scale_cl.experiments.settings import MethodSettings, MethodStageConfig
from scale_cl.train.chunked_loss import LOSSES
from scale_cl.tuner.routing.calibrated import OBJECTIVES

AUTO_MEASUREMENTS = 20  # eval.every 0: this many measurements a run, whatever its length
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def parse_tokens(text: str, name: str = "train.tokens") -> int:
    """A token count written as ``2B``, ``500M``, ``1.5k`` or ``2000000`` (empty or 0: none)."""
    if not str(text).strip():
        return 0
    match = _TOKENS.match(str(text))
    if not match:
        raise ValueError(f"{name} must be a token count such as 2B, 500M, 300k or 2000000, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


@dataclass
class TrainSection(MethodStageConfig):
    """Optimisation (AdamW on the HF Trainer): one learning rate per method, batch, schedule, checkpoints."""

    section: ClassVar[str] = "train."  # where its settings are given (messages name them so)

    tokens: str = field(
        default="",
        metadata={
            "help": "a token budget: the steps are tokens / (batch_size x data.seq_len), rounded up (2B, 500M, 300k, "
            "2000000); empty = max_steps, or epochs when that is 0"
        },
    )
    logging_steps: int = field(
        default=0,
        metadata={"ge": 0, "help": "log the training loss every this many steps; 0 = min(the evaluation's, 50)"},
    )
    loss: str = field(
        default="sliced",
        metadata={
            "choices": LOSSES,
            "help": "the training loss: sliced (the LM head and its loss a slice of positions at a time, the logits "
            "never whole: the same gradients, far less memory at a large vocabulary; scale_cl.train.chunked_loss) "
            "or whole (transformers' own loss over every logit at once)",
        },
    )
    save_minutes: float = field(
        default=0.0,
        metadata={"ge": 0, "help": "also write a checkpoint whenever this many minutes passed since the last; 0 = off"},
    )

    micro_batch_size: int = field(
        default=4,
        metadata={"ge": 1, "help": "sequences per forward pass and process; gradient accumulation fills batch_size"},
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"ge": 0, "lt": 1, "help": "share of the steps with linear warm-up"}
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in backward"})
    save_every: int = field(
        default=50, metadata={"ge": 0, "help": "write a resumable checkpoint every this many steps"}
    )
    save_total_limit: int = field(default=2, metadata={"ge": 1, "help": "checkpoints kept per method (oldest deleted)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.save_minutes = float(self.save_minutes)
        budget = parse_tokens(self.tokens, f"{self.section}tokens")
        if budget and self.max_steps:
            raise ValueError(
                f"{self.section}tokens={self.tokens} and {self.section}max_steps={self.max_steps} both set the length "
                "of the run: give one of them"
            )

    @property
    def token_budget(self) -> int:
        """``tokens`` as a number (0: none)."""
        return parse_tokens(self.tokens)


@dataclass
class EvalSection:
    """What is measured during training (learning and forgetting perplexity, representation drift)."""

    section: ClassVar[str] = "eval."  # where its settings are given (messages name them so)

    every: int = field(
        default=20,
        metadata={
            "ge": 0,
            "help": "measure every this many optimizer steps (and at 0 and the end); 0 = from the run's length, "
            f"{AUTO_MEASUREMENTS} times a run (every ceil(steps / {AUTO_MEASUREMENTS}) steps)",
        },
    )
    batch_size: int = field(default=4, metadata={"ge": 1, "help": "sequences per evaluation forward pass"})
    representation_sequences: int = field(
        default=4, metadata={"ge": 1, "help": "old-domain sequences whose final hidden states are compared with step 0"}
    )
    up_logit_scales: tuple[float, ...] = field(
        default=(),
        metadata={
            "type": float,
            "ge": 0,
            "help": "SCALE methods: after training, evaluate the model again with its new stream's logits weighted "
            "by each alpha (Z + alpha Z_up): a learning-forgetting frontier from one trained model, no retraining",
        },
    )

    wise_ft_alphas: tuple[float, ...] = field(
        default=(),
        metadata={
            "type": float,
            "ge": 0,
            "le": 1,
            "help": "FFT and Freeze: after training, evaluate the weights base + alpha (trained - base) at each alpha "
            "(WiSE-FT): the same kind of frontier from one trained model, the anchor of --eval.up_logit_scales",
        },
    )

    likelihood_control: bool = field(
        default=False,
        metadata={
            "help": "methods that do not route: after training, evaluate the trained model mixed with its base by "
            "the likelihood router (options.scale.router_prior / router_decay; two forward passes): the control of "
            "SCALE's router readings (scale_cl.eval.mixture). In a sequence (sequence.then), after every task: the "
            "base and the model after each task so far, mixed (k + 1 models; methods that do not grow)",
        },
    )

    routers: tuple[str, ...] = field(
        default=("likelihood",),
        metadata={
            "help": f"the mixing routers, of {MIXTURE_ROUTERS}, that read SCALE-Route and SCALE-Preserve after "
            "training (--eval.up_logit_scales' frontier) and the two-model control (--eval.likelihood_control)",
        },
    )

    gate_objectives: tuple[str, ...] = field(
        default=("classification",),
        metadata={
            "choices": OBJECTIVES,
            "help": "where --eval.routers names the calibrated router: the objectives its gate is fitted by (on the "
            "training text against the base's own samples), one reading each. classification: the log-weight of "
            "the expert whose text it is (what scale-cl train and scale-cl calibrate fit); likelihood: the "
            "mixture's log-likelihood of the next token on both sides",
        },
    )

    mixed_documents: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "also read N mixed documents each way: a held-out new-domain sequence with a passage of the first "
            "old-domain set inside (a quarter of it, at a known position), and the reverse; the perplexity of the "
            "host before the passage, the passage and the host after it (and a router's base weight there): whether "
            "a router turns to the passage's domain and back (scale_cl.eval.segments; records mixed_documents); "
            "0 = off",
        },
    )

    nll_split: bool = field(
        default=False,
        metadata={
            "help": "also split each old-domain loss into the probability mass given to the new domain's own tokens "
            "(those relatively more frequent in the held-out new-domain text than in the old-domain sets) and the "
            "ranking among the others: where forgetting goes (records forgetting_new_mass_nll, in nats)"
        },
    )

    def interval(self, steps: int) -> int:
        """The steps between measurements of a run of ``steps``: ``every``, or with 0 a share of the run, so that a
        short run draws a curve and a long one is not measured more often than it needs."""
        return self.every or max(1, math.ceil(steps / AUTO_MEASUREMENTS))

    def __post_init__(self) -> None:
        self.up_logit_scales = tuple(float(a) for a in self.up_logit_scales)
        self.wise_ft_alphas = tuple(float(a) for a in self.wise_ft_alphas)
        self.routers = tuple(self.routers)
        self.gate_objectives = tuple(self.gate_objectives)
        check_fields(self)
        if not self.gate_objectives or not set(self.gate_objectives) <= set(OBJECTIVES):
            raise ValueError(f"eval.gate_objectives must name one or more of {OBJECTIVES}, got {self.gate_objectives}")
        unknown = [router for router in self.routers if router not in MIXTURE_ROUTERS]
        if unknown or not self.routers:
            raise ValueError(f"eval.routers must name one or more of {MIXTURE_ROUTERS}, got {list(self.routers)}")


VOCAB_TEXT_CHARS = 50_000_000  # new-domain training text read to learn --data.extend_vocab's tokens


@dataclass
class DataSection(CorpusConfig):
    """The corpus (`scale_cl.data.corpus.CorpusConfig`), a vocabulary extension learned from it, and pseudo-replay."""

    pseudo_replay_ratio: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "lt": 1,
            "help": "share of the training sequences that are text the base model samples itself (pseudo-replay: "
            "old-domain text without stored old data), on replay's schedule; it takes replay's place (not with "
            "data.replay_ratio); 0 = off",
        },
    )
    pseudo_replay_sequences: int = field(
        default=256,
        metadata={
            "ge": 1,
            "help": "with pseudo_replay_ratio: sequences of data.seq_len tokens sampled once per run and seed "
            "(cached in the output folder), reused in a fresh order each time they are used up",
        },
    )
    pseudo_replay_temperature: float = field(
        default=1.0, metadata={"gt": 0, "help": "with pseudo_replay_ratio: the sampling temperature"}
    )

    extend_vocab: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "add this many tokens to the base tokenizer (and rows to every method's embedding and LM head), "
            "learned as BPE merges on the base tokenizer's own segmentation of the new-domain training split "
            f"(its first {VOCAB_TEXT_CHARS:,} characters; never the held-out or old-domain text); 0 = off",
        },
    )


class RunSettings(Protocol):
    """What the shared training path reads of a run's settings (`scale_cl.experiments.train.config.TrainConfig` and
    `scale_cl.experiments.cpt.config.CptConfig` have them)."""

    model: str
    seed: int
    data: DataSection
    train: TrainSection
    eval: EvalSection
    options: MethodSettings

    @property
    def methods(self) -> list[str]: ...


def check_run(cfg: Any) -> None:
    """Refuse settings of a corpus run (``cfg``: a `scale_cl.experiments.train.config.TrainConfig` or a `CptConfig`)
    that cannot work whatever the model, the data and the machine: the checks that need several settings at once, made
    on the final settings before any model or data loads. What depends on the model's config, the data or the launch
    is checked by `scale_cl.experiments.train.prepare.validate`, which runs these first."""
    t, d, options = cfg.train, cfg.data, cfg.options
    if t.batch_size % t.micro_batch_size:
        raise ValueError(
            f"train.batch_size={t.batch_size} must be a multiple of train.micro_batch_size={t.micro_batch_size} "
            "(gradient accumulation fills the batch with whole micro-batches; under N processes, a multiple of "
            "micro_batch_size x N): change one of them"
        )
    if d.streaming and t.max_steps <= 0 and not t.token_budget:
        raise ValueError(
            "data.streaming needs train.max_steps > 0 or train.tokens (a stream has no length to count epochs on)"
        )
    if not d.heldout_fraction and not d.old_eval:
        raise ValueError(
            "nothing to measure: set data.heldout_fraction > 0 and/or data.old_eval (learning is measured on the "
            "held-out share of data.train, forgetting on each old-domain set)"
        )
    needs_old = [(m, "route_share calibrates its tau") for m in cfg.methods if options.calibrates_route(m)]
    needs_old += [(m, "auto_layers measures forgetting") for m in cfg.methods if options.chooses_layers(m)]
    if needs_old and not d.replay:
        method, what = needs_old[0]
        raise ValueError(
            f"{method}: options.{what} on old-domain text, and none is given: set --data.replay NAME=SOURCE "
            "(documents the old-domain evaluation sets read are left out; with --data.replay_ratio 0 it is only "
            "measured on, not trained on)"
        )
    if any(options.chooses_layers(m) for m in cfg.methods) and d.streaming:
        raise ValueError("options.auto_layers needs a packed training split: drop data.streaming")
