"""Continual pre-training of one base model with every method, measuring learning and forgetting as it trains.

Output folder::

    cpt_config.json            the settings (a later run into this folder must use the same ones)
    reference_hidden.safetensors  the base model's final hidden states on a fixed old-domain batch
    <method>/run/checkpoint-N  resumable checkpoints (trainable weights + optimizer/scheduler/RNG),
                               deleted when the method finishes
    <method>/metrics.jsonl     one record per evaluation (see `evaluate_method`)
    <method>/logs/             TensorBoard's events, with ``--train.report_to tensorboard``
    <method>/model/            the trained model (`scale_cl.models.save_trained`), for ``scale-cl eval``
    <method>/result.json       the finished method's summary; its presence means "done"
    tokenizer/                 with ``--data.extend_vocab N``: the extended tokenizer every method trains with,
                               and vocab_extension.json (the new tokens, their ids, the base ids they merge)
    results.json, results.md, perplexity.png, representation.png

With ``--data.extend_vocab N`` the base tokenizer learns ``N`` tokens from the new-domain training
split (`scale_cl.tuner.vocab`), every set (training, held-out, old-domain) is packed with the extended
tokenizer, and every method starts from the base model grown by ``N`` rows (the reference hidden
states and step 0 too). Old-domain text splits into the same ids as with the base tokenizer wherever
no new merge fires, so its perplexity stays comparable, except that the softmax now spans the new
tokens as well (see `scale_cl.tuner.vocab`).

Re-running the same command resumes: finished methods are skipped, an interrupted one continues
from its last complete checkpoint (bitwise the same weights as an uninterrupted run on CPU).
Under ``torchrun``/``accelerate launch`` every process runs this; the Trainer makes it DDP, and
only the main process evaluates and writes results.
"""

from __future__ import annotations

import gc
import math
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from scale_cl.data.corpus import Corpus, build_corpus, check_corpus, eos_id, is_stream, split_documents
from scale_cl.data.pseudo_replay import cached_blocks, generate_blocks
from scale_cl.data.replay import ReplayMix, ReplayStream, describe_share
from scale_cl.eval.perplexity import final_hidden_original, mean_cosine_similarity, new_domain_tokens, perplexity
from scale_cl.eval.readings import read_as, reading_applied
from scale_cl.eval.route_separation import base_weights, router_separation
from scale_cl.eval.segments import MixedSet, mixed_documents, segment_readings
from scale_cl.experiments.base.name import resolve_model_name
from scale_cl.experiments.cpt.config import VOCAB_TEXT_CHARS, CptConfig
from scale_cl.experiments.cpt.layer_choice import check_probe_data, choose_layers, describe
from scale_cl.experiments.cpt.report import RESULT_FILE
from scale_cl.experiments.method_run import GATE_RECIPE, MethodRun, ReadPlan, Training
from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.files import atomic_write, write_json
from scale_cl.methods import method_spec
from scale_cl.models import BaseModelRef, load_base, save_trained
from scale_cl.remote_code import own_code_kwargs
from scale_cl.train.arguments import training_arguments as stage_training_arguments
from scale_cl.train.callbacks import PeriodicEval
from scale_cl.train.device import Placement, stage_placement, used_placement
from scale_cl.train.distill import Distillation, HeadTeacher
from scale_cl.train.reporting import report_to_argument
from scale_cl.train.route_calibration import RouteCalibration, sequence_batches
from scale_cl.train.router_fit import gate_blocks
from scale_cl.train.sharding import full_state_dict, requested_sharding
from scale_cl.tuner.vocab import VocabExtension, extend_tokenizer, grow_embeddings, vocab_rows

CONFIG_FILE = "cpt_config.json"
LOSS_FILE = "train_log.jsonl"  # every logged training loss, whatever report_to says
REFERENCE_FILE = "reference_hidden.safetensors"
TOKENIZER_DIR = "tokenizer"
VOCAB_FILE = "vocab_extension.json"


def process_state(cpu: bool | None = None) -> PartialState:
    """This process's place in a ``torchrun``/``accelerate launch`` run, set up as the Trainer's (``use_cpu``) will be.

    Without CUDA a bare ``PartialState()`` does not see the launcher's processes (accelerate sets up
    gloo only when asked for the CPU): every process would count as the main one and the world size
    as 1 until the first ``TrainingArguments`` re-initialised the state. ``cpu``: the run's ``train.device`` is
    the CPU (default: no CUDA); it counts at the first call, which `validate` makes.
    """
    return PartialState(cpu=not torch.cuda.is_available() if cpu is None else cpu)


def run_placement(cfg: CptConfig) -> Placement:
    """Where the run trains and evaluates, and in which precision (``train.device``, ``train.precision``)."""
    return stage_placement(cfg.train)


def base_placement(cfg: CptConfig) -> Placement:
    """Where the base model itself runs outside the Trainer (the reference hidden states, a sweep's step 0,
    pseudo-replay sampling): as the run, but on the CPU in fp32 under sharded weights (FSDP, ZeRO-3), where a
    whole copy of the base may not fit one GPU."""
    return Placement("cpu", bf16=False) if requested_sharding() is not None else run_placement(cfg)


def validate(cfg: CptConfig, base_config: Any) -> None:
    """Raise a ValueError for settings that cannot work with this base model, before anything is written."""
    placement = run_placement(cfg)  # train.device cuda without a GPU, bf16 on a GPU without it: refused here
    cfg.options.validate(base_config, cfg.methods)
    report_to_argument(cfg.train.report_to)  # its backends are installed
    cfg.check()  # the settings' own checks, for settings built in Python (the command line ran them first)
    world = process_state(cpu=placement.device == "cpu").num_processes
    t = cfg.train
    if t.batch_size % (t.micro_batch_size * world):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be a multiple of train.micro_batch_size={t.micro_batch_size} "
            f"x {world} process(es)"
        )
    sharding = requested_sharding()
    if sharding is not None:
        unsupported = [
            ("options.base_quant", cfg.options.base_quant != "none"),
            ("options.auto_layers", any(cfg.options.chooses_layers(m) for m in cfg.methods)),
            ("eval.wise_ft_alphas", bool(cfg.eval.wise_ft_alphas)),
            ("eval.likelihood_control", cfg.eval.likelihood_control),
        ]
        named = [name for name, used in unsupported if used]
        if named:
            raise ValueError(
                f"{', '.join(named)}: not supported with sharded weights ({sharding}, from the accelerate config; "
                "untested there: the quantized base, the weight interpolation and the two-model control need whole "
                "weights, the layer probes evaluate on one process). Drop them, or launch without FSDP / ZeRO-3."
            )


def total_steps(cfg: CptConfig, train: Any) -> int:
    """The steps of the token budget (``train.tokens``), or ``max_steps``, or of ``epochs`` passes over the training
    data (``train``, replay mixed in)."""
    if cfg.train.token_budget:
        return math.ceil(cfg.train.token_budget / (cfg.train.batch_size * cfg.data.seq_len))
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return math.ceil(cfg.train.epochs * len(train) / cfg.train.batch_size)


def training_data(cfg: CptConfig, corpus: Corpus, pseudo_replay: torch.Tensor | None = None, mark: bool = False) -> Any:
    """The training split, or with ``data.replay_ratio`` the split with replay mixed in on replay's schedule (this
    run's seed draws the order, `scale_cl.data.replay`); with ``data.pseudo_replay_ratio`` the base model's own
    text (``pseudo_replay``, `pseudo_replay_blocks`) takes replay's place. ``mark``: each sequence says whether it
    is (pseudo-)replay, for the distillation term."""
    ratio = cfg.data.replay_ratio or cfg.data.pseudo_replay_ratio
    if not ratio:
        return corpus.train
    if cfg.data.pseudo_replay_ratio:
        if pseudo_replay is None:
            raise ValueError("data.pseudo_replay_ratio needs the sampled blocks (pseudo_replay_blocks)")
        replay = pseudo_replay
    elif corpus.replay is None:
        raise ValueError(f"data.replay_ratio={ratio} but the corpus was packed without replay text (data.replay)")
    else:
        replay = corpus.replay
    if is_stream(corpus.train):
        return ReplayStream(corpus.train, replay, ratio, cfg.seed, mark=mark)
    return ReplayMix(corpus.train, replay, ratio, cfg.seed, cfg.train.batch_size, mark=mark)


def pseudo_replay_blocks(
    cfg: CptConfig, ref: BaseModelRef, base: PreTrainedModel, tokenizer: Any, cache: Path
) -> torch.Tensor | None:
    """The base model's own sequences for ``data.pseudo_replay_ratio`` (sampled once per seed, cached in
    ``cache``), or None without pseudo-replay. ``base``: the model before any method touches it."""
    d = cfg.data
    if not d.pseudo_replay_ratio:
        return None
    from scale_cl.data.corpus import eos_id

    placement = base_placement(cfg)
    settings = {
        "base": asdict(ref),
        "vocab": len(tokenizer),
        "seed": cfg.seed,
        "sequences": d.pseudo_replay_sequences,
        "seq_len": d.seq_len,
        "temperature": d.pseudo_replay_temperature,
        **({"bf16": True} if placement.bf16 else {}),  # sampled in bf16: another draw (fp32 keeps its old key)
    }

    def sample() -> torch.Tensor:
        print(f"[cpt] pseudo-replay: the base model samples {d.pseudo_replay_sequences} sequences (seed {cfg.seed})")
        start = eos_id(tokenizer)
        base.to(placement.device)  # sampled where the run trains; prepared back on the CPU, as without pseudo-replay
        try:
            sequences, temperature = d.pseudo_replay_sequences, d.pseudo_replay_temperature
            return generate_blocks(base, start, sequences, d.seq_len, cfg.seed, temperature, bf16=placement.bf16)
        finally:
            base.to("cpu")

    with process_state().main_process_first():  # one process samples and writes; the others read its file
        return cached_blocks(cache, settings, sample)


def training_arguments(
    cfg: CptConfig, method: str, run_dir: Path, steps: int, logging_dir: Path | None = None
) -> TrainingArguments:
    """cpt's settings for the shared builder: ``batch_size`` split into per-process micro-batches and accumulation."""
    t = cfg.train
    world = process_state().num_processes
    return stage_training_arguments(
        t,
        run_dir,
        cfg.seed,
        learning_rate=t.lr_of(method),
        max_steps=steps,
        micro_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.batch_size // (t.micro_batch_size * world),
        warmup_steps=max(t.warmup_steps, math.ceil(t.warmup_ratio * steps)),
        save_every=t.save_every,
        save_total_limit=t.save_total_limit,
        activation_checkpointing=t.gradient_checkpointing,
        logging_steps=t.logging_steps or min(cfg.eval.interval(steps), 50),
        logging_dir=logging_dir,
        loader_workers=cfg.data.loader_workers,
    )


def probe_arguments(cfg: CptConfig, method: str, method_dir: Path) -> TrainingArguments:
    """The Trainer settings of a layer-choice probe: the run's, for ``auto_layers_steps`` steps, never saving."""
    probe_cfg = replace(cfg, train=replace(cfg.train, save_every=0, report_to=["none"]))
    return training_arguments(probe_cfg, method, method_dir / "probe", cfg.options.auto_layers_steps)


def reference_hidden(cfg: CptConfig, base: PreTrainedModel, corpus: Corpus, out: Path) -> torch.Tensor:
    """Step-0 final hidden states on the first old-domain batch (or held-out if none), computed once per run."""
    grown_base(base, None, corpus)  # the probe may hold new tokens; the sweep evaluates this base at step 0 too
    path = out / REFERENCE_FILE
    if path.is_file():
        return load_file(path)["hidden"]
    probe = probe_batch(cfg, corpus)
    placement = base_placement(cfg)  # computed as the later evaluations are: on the run's device, in its precision
    hidden = final_hidden_original(base.to(placement.device), probe, base.config.hidden_size, placement.bf16)
    if process_state().is_main_process:
        atomic_write(path, lambda tmp: save_file({"hidden": hidden.contiguous()}, tmp))
    return hidden


def probe_batch(cfg: CptConfig, corpus: Corpus) -> torch.Tensor:
    sets = [*corpus.old_eval.values(), *([corpus.heldout] if corpus.heldout is not None else [])]
    return sets[0].blocks[: cfg.eval.representation_sequences]


def evaluate_method(cfg: CptConfig, corpus: Corpus, reference: torch.Tensor, original_width: int, bf16: bool) -> Any:
    """The callback's measurement: learning/forgetting perplexity, representation similarity, routing share."""
    from scale_cl.methods import trainable_parameter_count

    probe = probe_batch(cfg, corpus)
    new_tokens = None
    if cfg.eval.nll_split and corpus.heldout is not None and corpus.old_eval:
        old = torch.cat([data.blocks.flatten() for data in corpus.old_eval.values()])
        vocab = int(max(corpus.heldout.blocks.max(), old.max())) + 1
        new_tokens = new_domain_tokens(corpus.heldout.blocks, old, vocab)

    mixed = mixed_sets(cfg, corpus)

    def evaluate(model: torch.nn.Module) -> dict[str, Any]:
        record: dict[str, Any] = {"trainable": trainable_parameter_count(model)}
        share: dict[str, float] = {}
        weights: dict[str, torch.Tensor] = {}  # a router's base weight per token of each set
        if corpus.heldout is not None:
            with base_weights(model, weights, "heldout"):
                result = perplexity(model, corpus.heldout.blocks, cfg.eval.batch_size, bf16)
            record["learning_ppl"] = result.perplexity
            if result.route_preserve_share is not None:
                share["heldout"] = result.route_preserve_share
        record["forgetting_ppl"] = {}
        for name, data in corpus.old_eval.items():
            with base_weights(model, weights, name):
                result = perplexity(model, data.blocks, cfg.eval.batch_size, bf16, new_tokens)
            record["forgetting_ppl"][name] = result.perplexity
            if result.new_mass_nll is not None:
                record.setdefault("forgetting_new_mass_nll", {})[name] = result.new_mass_nll
            if result.route_preserve_share is not None:
                share[name] = result.route_preserve_share
        if weights:
            record["separation"] = router_separation(weights)
        if mixed:
            record["mixed_documents"] = {
                way: segment_readings(model, data, cfg.eval.batch_size) for way, data in mixed.items()
            }
        hidden = final_hidden_original(model, probe, original_width, bf16)
        record["representation_similarity"] = mean_cosine_similarity(reference, hidden)
        if share:
            record["route_preserve_share"] = share
        route = getattr(model, "scale_route", None)
        if route is not None and route.active:
            record["route_tau"] = route.tau  # fixed, or as last calibrated (options.route_share)
        return record

    return evaluate


def mixed_sets(cfg: CptConfig, corpus: Corpus) -> dict[str, MixedSet]:
    """``eval.mixed_documents``'s sequences: ``new+old`` (a held-out new-domain host, a passage of the first
    old-domain set) and ``old+new`` (the reverse); none when off or a side is missing."""
    count = cfg.eval.mixed_documents
    if not count or corpus.heldout is None or not corpus.old_eval:
        return {}
    old = next(iter(corpus.old_eval.values())).blocks
    eos = (eos_id(corpus.tokenizer),) if getattr(corpus, "tokenizer", None) is not None else ()
    return {
        "new+old": mixed_documents(corpus.heldout.blocks, old, eos, count),
        "old+new": mixed_documents(old, corpus.heldout.blocks, eos, count),
    }


@dataclass
class CptRun(MethodRun):
    """One method on the run's corpus (`run_method`): the base (grown by the corpus's new tokens) prepared for it."""

    cfg: CptConfig
    ref: BaseModelRef
    corpus: Corpus
    reference: torch.Tensor
    method: str
    out: Path
    initial: dict[str, Any] | None = None
    save_model: bool = True
    pseudo_replay_cache: Path | None = None
    method_dir: Path | None = None
    keep_checkpoints: bool = False
    reading: str | None = None
    log_prefix: str = "cpt"

    def __post_init__(self) -> None:
        self.method_dir = self.out / self.method if self.method_dir is None else self.method_dir
        self.seed, self.options, e = self.cfg.seed, self.cfg.options, self.cfg.eval
        self.result_path = self.method_dir / RESULT_FILE
        self.run_dir, self.logging_dir = self.method_dir / "run", self.method_dir / "logs"
        scale = method_spec(self.method).is_scale  # every SCALE model is read along alpha
        self.read_plan = ReadPlan(
            frontier=(e.up_logit_scales or None) if scale else None,
            routers=e.routers,
            wise_ft=e.wise_ft_alphas,
            control=e.likelihood_control,
            gate_objectives=e.gate_objectives,
            frontier_key="up_logit_frontier",
            wise_ft_key="wise_ft_frontier",
        )
        self.layer_choice: dict[str, Any] | None = None

    @property
    def is_main(self) -> bool:
        return process_state().is_main_process

    def start_model(self) -> torch.nn.Module:
        return grown_base(*load_base(self.ref), self.corpus)[0]

    def base_model(self) -> torch.nn.Module:
        """The base, once its collaborative layers are chosen by probe runs (``options.auto_layers``) and its own
        text sampled for pseudo-replay: both read it before any method touches it."""
        cfg, method, method_dir = self.cfg, self.method, self.method_dir
        base, self.tokenizer = grown_base(*load_base(self.ref), self.corpus)
        self.original_width = base.config.hidden_size
        if self.options.chooses_layers(method):
            probe = probe_arguments(cfg, method, method_dir)
            self.layer_choice = choose_layers(cfg, base, self.corpus, method, method_dir, probe)
            shutil.rmtree(method_dir / "probe", ignore_errors=True)  # the probes save nothing; the Trainer made it
            chosen = self.layer_choice["chosen"]
            scale = replace(self.options.scale, **{**chosen, "collab_modules": tuple(chosen["collab_modules"])})
            self.options = replace(self.options, scale=scale)
            if self.is_main:
                print(f"[cpt] {method}: collaborative layers from probe runs\n{describe(self.layer_choice)}")
        self.pseudo = pseudo_replay_blocks(cfg, self.ref, base, self.tokenizer, self.pseudo_replay_cache or self.out)
        return base

    @property
    def bf16(self) -> bool:
        return run_placement(self.cfg).bf16

    def training(self, model: torch.nn.Module, mark: bool) -> Training:
        from scale_cl.methods import trainable_parameter_count

        cfg, corpus = self.cfg, self.corpus
        if "calibrated" in (self.reading, *self.read_plan.routers) and requested_sharding() is not None:
            raise ValueError(
                "the calibrated router's gate is fitted on the whole model after training, which sharded weights "
                "do not hold on one process: train without FSDP, or read it with another router (--reading, "
                "--eval.routers)"
            )
        tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        train = training_data(cfg, corpus, self.pseudo, mark=mark)
        self.steps = total_steps(cfg, train)
        args = training_arguments(cfg, self.method, self.run_dir, self.steps, self.logging_dir)
        self.lr = args.learning_rate
        tracker = PeriodicEval(
            read_as(evaluate_method(cfg, corpus, self.reference, self.original_width, args.bf16), self.reading),
            every=cfg.eval.interval(self.steps),
            path=self.method_dir / "metrics.jsonl",
            tokens_per_step=tokens_per_step,
            initial=None if self.initial is None else {**self.initial, "trainable": trainable_parameter_count(model)},
        )
        run_info = {
            "method": self.method,
            "lr": self.lr,
            "base": asdict(self.ref),
            "steps": self.steps,
            "seed": cfg.seed,
        }
        if self.layer_choice is not None:
            run_info["layers"] = self.layer_choice["chosen"]

        def replay_sequences(count: int) -> list[dict[str, torch.Tensor]]:  # the calibration sample
            first = torch.stack([corpus.replay[i]["input_ids"] for i in range(min(count, len(corpus.replay)))])
            return sequence_batches(first, cfg.eval.batch_size)

        options = {
            "run_info": run_info,
            "collator": corpus.collator or default_data_collator,
            "tokens_per_step": tokens_per_step,
            "save_minutes": cfg.train.save_minutes,
            "loss_log": self.method_dir / LOSS_FILE,
            "sliced": cfg.train.loss == "sliced",
        }
        return Training(train, args, tracker, replay_sequences, options)

    def gate_text(self) -> tuple[torch.Tensor, int]:
        """The new domain's training blocks, spread over the corpus (no pseudo-replay or replay), and its EOS."""
        return gate_blocks(self.corpus.train, GATE_RECIPE.sequences), eos_id(self.tokenizer)

    def announce(self, trainable: int, distillation: Distillation | None, calibration: RouteCalibration | None) -> None:
        if not self.is_main:
            return
        d, replay = self.cfg.data, ""
        if d.replay_ratio or d.pseudo_replay_ratio:
            kind = "replay" if d.replay_ratio else "pseudo-replay"
            replay = f", {kind} {describe_share(d.replay_ratio or d.pseudo_replay_ratio, self.cfg.train.batch_size)}"
        if distillation is not None:
            distill, own = distillation.config, isinstance(distillation.teacher, HeadTeacher)
            source = "its own head" if own else "a frozen copy"
            replay += f", distillation x{distill.weight:g} (T={distill.temperature:g}, new-domain: {distill.new_tokens}"
            replay += f"; the base's logits from {source})"
        lr_ratios = self.options.lr_ratios(self.method)
        groups = "".join(f", *{suffix} at {ratio:g} x lr" for suffix, ratio in lr_ratios.items())
        if calibration is not None:
            every = f"every {calibration.every} steps" if calibration.every else "once"
            sequences = min(self.options.route_calibration_sequences, len(self.corpus.replay))
            replay += f", tau routes {calibration.share:.0%} of {sequences} old-domain sequences to preserve ({every})"
        sharding = requested_sharding()
        if sharding is not None:
            replay += f", weights sharded ({sharding}) across {process_state().num_processes} processes"
        steps = self.steps
        print(
            f"[{self.log_prefix}] {self.method}: lr {self.lr:g}{groups}, {trainable:,} trainable, {steps} steps{replay}"
        )

    def result(self, trainer: Trainer, tracker: PeriodicEval, trainable: int, seconds: float) -> dict[str, Any]:
        """The summary; with ``save_model`` every process gathers sharded weights for the main one to save."""
        self.weights = full_state_dict(trainer) if self.save_model else None  # None unsharded
        summary = {
            "method": self.method,
            "lr": self.lr,
            "trainable": trainable,
            "steps": self.steps,
            "seconds": seconds,
        }
        summary.update(used_placement(trainer.args))  # device, precision (and the GPU) it trained on
        if self.layer_choice is not None:
            summary["layer_choice"] = self.layer_choice
        if self.reading == "calibrated" and self.is_main:
            summary["gate_fit"] = self.fit_gate(trainer, tracker, seconds)
        return summary

    def fit_gate(self, trainer: Trainer, tracker: PeriodicEval, seconds: float) -> dict[str, Any]:
        """The calibrated reading's gate fitted on the trained model (`MethodRun.calibrator`: the training text and
        the base's samples, no evaluation text), the model evaluated with it (the curve's last record, ``"gate":
        "fitted"``; the records before it read the gate as it was set); the fit's summary."""
        fit = self.calibrator(self.cfg.eval.gate_objectives[0])(trainer.model)
        tracker.add(trainer.state.global_step, {"gate": "fitted", **tracker.evaluate(trainer.model)})
        gate = ", ".join(
            f"{name.removeprefix('router_')} {value:.3g}" for name, value in fit.fit.gate.settings().items()
        )
        print(f"[{self.log_prefix}] calibrated router fitted in {fit.seconds:.1f} s: {gate}")
        return {**fit.summary(), "share_of_training": fit.seconds / max(seconds, 1e-9)}

    def save(self, trainer: Trainer, tracker: PeriodicEval, result: dict[str, Any]) -> None:
        """The model (read with ``reading``, `scale_cl.models.save_trained`), and the curve into the summary."""
        if self.save_model:
            with reading_applied(trainer.model, self.reading, keep=True):
                model_dir = self.method_dir / "model"
                save_trained(trainer.model, self.tokenizer, self.method, self.ref, model_dir, state_dict=self.weights)
        result["curve"] = tracker.records
        if self.reading is not None:
            result["reading"] = self.reading

    def finish(self) -> None:
        process_state().wait_for_everyone()


def run_method(
    cfg: CptConfig,
    ref: BaseModelRef,
    corpus: Corpus,
    reference: torch.Tensor,
    method: str,
    out: Path,
    initial: dict[str, Any] | None = None,
    save_model: bool = True,
    pseudo_replay_cache: Path | None = None,
    *,
    method_dir: Path | None = None,
    keep_checkpoints: bool = False,
    reading: str | None = None,
    log_prefix: str = "cpt",
) -> dict[str, Any]:
    """Train one method (resuming from its last checkpoint), save its model and summary; returns the summary.

    ``initial``: the base model's `evaluate_method` record, used as step 0 (a sweep measures it once;
    SCALE-Route's routing share is then not measured at step 0). ``save_model=False`` keeps only the
    metrics (a sweep's many runs would otherwise each store a model). ``pseudo_replay_cache``: the folder of
    the base model's sampled sequences (default ``out``; a sweep shares one).

    ``method_dir``: the method's folder (default ``out/<method>``); ``keep_checkpoints``: keep its resumable
    checkpoints when it finishes (`scale-cl train`; cpt deletes them); ``reading``: a SCALE model's router to evaluate
    and save it with (`scale_cl.eval.readings.reading_applied`), trained as its method trains.

    Read afterwards, training nothing: every SCALE model at each of ``eval.up_logit_scales`` (Route and Preserve also
    with each router of ``eval.routers``), FFT and Freeze along ``eval.wise_ft_alphas``, a method that does not route
    mixed with its base (``eval.likelihood_control``).
    """
    extra = (initial, save_model, pseudo_replay_cache, method_dir, keep_checkpoints, reading, log_prefix)
    summary = CptRun(cfg, ref, corpus, reference, method, out, *extra).run()
    gc.collect()  # the trained model, before the next method loads one
    return summary


@dataclass
class CptCorpus(Corpus):
    """A corpus with the tokenizer it was packed with and, with ``--data.extend_vocab``, the tokens it added."""

    tokenizer: PreTrainedTokenizerBase | None = None
    vocab: VocabExtension | None = None


def load_run_corpus(
    cfg: CptConfig, tokenizer: PreTrainedTokenizerBase, rows: int | None = None, log_prefix: str = "cpt"
) -> CptCorpus:
    """The run's corpus, packed with the base tokenizer or, with ``--data.extend_vocab``, the extended one.

    ``rows``: the base model's embedding rows (where new ids start); read from its config when not given.
    Every error of the extension (too many tokens for the text, colliding ids) is raised here.
    """
    tokenizer, vocab = run_tokenizer(cfg, tokenizer, rows)
    corpus = build_corpus(cfg.data, tokenizer, seed=cfg.seed)
    if process_state().is_main_process:
        if vocab is not None:
            example = list(vocab.tokens[:8])
            print(f"[{log_prefix}] data: {vocab.count:,} new tokens, ids {vocab.first_id:,}.., e.g. {example}")
        for line in corpus.summary():
            print(f"[{log_prefix}] data {line}")
    if corpus.heldout is None and not corpus.old_eval:
        raise ValueError("nothing to measure: set data.heldout_fraction > 0 and/or data.old_eval")
    return CptCorpus(**vars(corpus), tokenizer=tokenizer, vocab=vocab)


def run_tokenizer(
    cfg: CptConfig, tokenizer: PreTrainedTokenizerBase, rows: int | None = None
) -> tuple[PreTrainedTokenizerBase, VocabExtension | None]:
    """The base tokenizer, or with ``--data.extend_vocab N`` a copy extended with ``N`` tokens learned from the
    new-domain training split (never the held-out or old-domain text)."""
    count = cfg.data.extend_vocab
    if not count:
        return tokenizer, None
    if rows is None:
        rows = base_model_config(cfg).get_text_config().vocab_size
    texts = _first_characters(split_documents(cfg.data, "train"), VOCAB_TEXT_CHARS)
    try:
        return extend_tokenizer(tokenizer, texts, count, first_id=rows)
    except ValueError as err:
        raise ValueError(f"data.extend_vocab={count}: {err}") from err


def _first_characters(texts: Iterable[str], limit: int) -> Iterator[str]:
    """``texts`` until ``limit`` characters are read (the last one cut)."""
    for text in texts:
        yield text[:limit]
        limit -= len(text)
        if limit <= 0:
            return


def grown_base(
    base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, corpus: Corpus
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """``base`` (grown in place by the corpus's new tokens, once) and the tokenizer the corpus was packed with."""
    vocab = getattr(corpus, "vocab", None)
    if vocab is None:
        return base, tokenizer
    if vocab_rows(base) == vocab.first_id:
        grow_embeddings(base, vocab)
    return base, corpus.tokenizer


def save_run_tokenizer(corpus: Corpus, out: Path) -> None:
    """The extended tokenizer and its new tokens into ``out/tokenizer`` (nothing without an extension)."""
    vocab = getattr(corpus, "vocab", None)
    if vocab is None or not process_state().is_main_process:
        return
    corpus.tokenizer.save_pretrained(out / TOKENIZER_DIR)
    record = {"first_id": vocab.first_id, "tokens": list(vocab.tokens), "pieces": [list(p) for p in vocab.pieces]}
    write_json(out / TOKENIZER_DIR / VOCAB_FILE, record)


def base_model_ref(cfg: CptConfig) -> BaseModelRef:
    """Where the run's base model comes from (``clean-en`` resolved to the built base's folder)."""
    return BaseModelRef.parse(resolve_model_name(cfg.model))


def base_model_config(cfg: CptConfig) -> Any:
    """The base model's configuration (cheap: no weights), or a FileNotFoundError that names the model."""
    check_corpus(cfg.data)  # cheap input checks first: no model is loaded for a typo in a path
    ref = base_model_ref(cfg)
    kwargs = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}
    try:
        if not ref.gguf_file:  # a scale-cl export runs its own modeling code (`scale_cl.remote_code`)
            kwargs.update(own_code_kwargs(ref.name_or_path))
        return AutoConfig.from_pretrained(ref.name_or_path, **kwargs)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load the configuration of model {cfg.model!r}: {str(err).splitlines()[0]}"
        ) from err


def run_cpt(cfg: CptConfig, out: Path) -> dict[str, Any]:
    """Run (or resume) every method of ``cfg`` into ``out``; returns the collected results."""
    from scale_cl.experiments.cpt.report import collect, write_report

    if cfg.sequence.then:
        raise ValueError(
            "sequence.then runs through scale_cl.experiments.cpt.sequence.run_cpt_sequence (as `scale-cl cpt` does)"
        )
    out = Path(out)
    check_output_folder(out, CONFIG_FILE, cfg.to_dict())  # before any data or model is loaded
    validate(cfg, base_model_config(cfg))
    ref = base_model_ref(cfg)
    base, tokenizer = load_base(ref)
    corpus = load_run_corpus(cfg, tokenizer, vocab_rows(base))
    if any(cfg.options.chooses_layers(m) for m in cfg.methods):
        check_probe_data(cfg, corpus)
    claim_output_folder(out, CONFIG_FILE, cfg.to_dict(), write=process_state().is_main_process)
    save_run_tokenizer(corpus, out)
    reference = reference_hidden(cfg, base, corpus, out)
    del base
    for method in cfg.methods:
        run_method(cfg, ref, corpus, reference, method, out)
    results = collect(cfg, out)
    if process_state().is_main_process:
        write_report(results, out)
    process_state().wait_for_everyone()  # the report exists when any process returns
    return results
