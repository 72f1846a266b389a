"""One method trained on a corpus run's corpus (`run_method`): the training path `scale-cl train`, `scale-cl cpt`
and `scale-cl sweep cpt` share; `RunOptions` says what differs between them."""

from __future__ import annotations

import gc
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, default_data_collator

from scale_cl.data.corpus import Corpus, eos_id
from scale_cl.data.replay import describe_share
from scale_cl.eval.readings import read_as, reading_applied
from scale_cl.experiments.method_run import GATE_RECIPE, MethodRun, ReadPlan, Training
from scale_cl.experiments.train.corpus import grown_base
from scale_cl.experiments.train.layer_choice import choose_layers, describe
from scale_cl.experiments.train.measure import evaluate_method
from scale_cl.experiments.train.prepare import (
    probe_arguments,
    process_state,
    pseudo_replay_blocks,
    run_placement,
    total_steps,
    training_arguments,
    training_data,
)
from scale_cl.experiments.train.sections import RunSettings
from scale_cl.methods import method_spec
from scale_cl.models import BaseModelRef, load_base, save_trained
from scale_cl.train.callbacks import PeriodicEval
from scale_cl.train.device import used_placement
from scale_cl.train.distill import Distillation, HeadTeacher
from scale_cl.train.route_calibration import RouteCalibration, sequence_batches
from scale_cl.train.router_fit import gate_blocks
from scale_cl.train.sharding import full_state_dict, requested_sharding

LOSS_FILE = "train_log.jsonl"  # every logged training loss, whatever report_to says
RESULT_FILE = "result.json"  # the finished method's summary; its presence means "done"


@dataclass(frozen=True)
class RunOptions:
    """What a command asks of the shared training path beyond its settings (`run_method`); the defaults are
    `scale-cl cpt`'s."""

    initial: dict[str, Any] | None = None  # the base's `evaluate_method` record as step 0 (a sweep measures it once)
    save_model: bool = True  # False: only the metrics (a sweep's many runs would each store a model)
    pseudo_replay_cache: Path | None = None  # the folder of the base's sampled sequences (default: the run's)
    method_dir: Path | None = None  # the method's folder (default: ``out/<method>``; `scale-cl train`: ``out``)
    keep_checkpoints: bool = False  # keep the resumable checkpoints when the method finishes (`scale-cl train`)
    reading: str | None = None  # a SCALE model's router to evaluate and save it with, trained as its method trains
    log_prefix: str = "cpt"  # the tag of its printed lines


@dataclass
class CorpusRun(MethodRun):
    """One method on the run's corpus (`run_method`): the base (grown by the corpus's new tokens) prepared for it."""

    cfg: RunSettings
    ref: BaseModelRef
    corpus: Corpus
    reference: torch.Tensor
    method: str
    out: Path
    run_options: RunOptions = field(default_factory=RunOptions)

    def __post_init__(self) -> None:
        o = self.run_options
        self.keep_checkpoints = o.keep_checkpoints  # `MethodRun.run` reads it
        self.method_dir = self.out / self.method if o.method_dir is None else o.method_dir
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
                chosen = describe(self.layer_choice)
                print(f"[{self.run_options.log_prefix}] {method}: collaborative layers from probe runs\n{chosen}")
        self.pseudo = pseudo_replay_blocks(
            cfg, self.ref, base, self.tokenizer, self.run_options.pseudo_replay_cache or self.out
        )
        return base

    @property
    def bf16(self) -> bool:
        return run_placement(self.cfg).bf16

    def training(self, model: torch.nn.Module, mark: bool) -> Training:
        from scale_cl.methods import trainable_parameter_count

        cfg, corpus = self.cfg, self.corpus
        if "calibrated" in (self.run_options.reading, *self.read_plan.routers) and requested_sharding() is not None:
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
            read_as(
                evaluate_method(cfg, corpus, self.reference, self.original_width, args.bf16), self.run_options.reading
            ),
            every=cfg.eval.interval(self.steps),
            path=self.method_dir / "metrics.jsonl",
            tokens_per_step=tokens_per_step,
            initial=None
            if self.run_options.initial is None
            else {**self.run_options.initial, "trainable": trainable_parameter_count(model)},
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
        prefix, steps = self.run_options.log_prefix, self.steps
        print(f"[{prefix}] {self.method}: lr {self.lr:g}{groups}, {trainable:,} trainable, {steps} steps{replay}")

    def result(self, trainer: Trainer, tracker: PeriodicEval, trainable: int, seconds: float) -> dict[str, Any]:
        """The summary; with ``save_model`` every process gathers sharded weights for the main one to save."""
        self.weights = full_state_dict(trainer) if self.run_options.save_model else None  # None unsharded
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
        if self.run_options.reading == "calibrated" and self.is_main:
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
        print(f"[{self.run_options.log_prefix}] calibrated router fitted in {fit.seconds:.1f} s: {gate}")
        return {**fit.summary(), "share_of_training": fit.seconds / max(seconds, 1e-9)}

    def save(self, trainer: Trainer, tracker: PeriodicEval, result: dict[str, Any]) -> None:
        """The model (read with ``reading``, `scale_cl.models.save_trained`), and the curve into the summary."""
        if self.run_options.save_model:
            with reading_applied(trainer.model, self.run_options.reading, keep=True):
                model_dir = self.method_dir / "model"
                save_trained(trainer.model, self.tokenizer, self.method, self.ref, model_dir, state_dict=self.weights)
        result["curve"] = tracker.records
        if self.run_options.reading is not None:
            result["reading"] = self.run_options.reading

    def finish(self) -> None:
        process_state().wait_for_everyone()


def run_method(
    cfg: RunSettings,
    ref: BaseModelRef,
    corpus: Corpus,
    reference: torch.Tensor,
    method: str,
    out: Path,
    options: RunOptions | None = None,
) -> dict[str, Any]:
    """Train one method (resuming from its last checkpoint), save its model and summary; returns the summary.

    ``options``: what the command asks beyond its settings (`RunOptions`; default cpt's: ``out/<method>``, the model
    saved, the checkpoints deleted when it finishes).

    Read afterwards, training nothing: every SCALE model at each of ``eval.up_logit_scales`` (Route and Preserve also
    with each router of ``eval.routers``), FFT and Freeze along ``eval.wise_ft_alphas``, a method that does not route
    mixed with its base (``eval.likelihood_control``).
    """
    summary = CorpusRun(cfg, ref, corpus, reference, method, out, options or RunOptions()).run()
    gc.collect()  # the trained model, before the next method loads one
    return summary
