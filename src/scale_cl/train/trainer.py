"""Run one training stage on the HF Trainer (accelerate, DDP and resuming come from it)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.integrations import TensorBoardCallback, get_available_reporting_integrations
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

from scale_cl.train.callbacks import PeriodicEval
from scale_cl.train.checkpointing import CheckpointingTrainer

SCHEDULES = ("constant", "linear", "cosine", "cosine_with_min_lr")
REPORT_ALL, REPORT_NONE = "all", "none"
# Settings that say where metrics are sent, not what is computed: left out of every run's identity (cache
# keys, the settings a run folder is claimed with), so changing them reuses finished work.
REPORTING_SETTINGS = frozenset({"report_to"})
# Backends whose module or package is not named as the backend: (modules, any of which will do; what
# `pip install` needs). Every other backend is its own module and package.
_PACKAGES = {
    "azure_ml": (("azureml.core",), "azureml-core"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "flyte": (("flytekit",), "flytekit"),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
}
_NO_PACKAGE = ("kubeflow",)  # switched on by its environment, not by a package


def report_backends() -> tuple[str, ...]:
    """The backends ``report_to`` may name: the installed transformers' reporting integrations."""
    return tuple(INTEGRATION_TO_CALLBACK)


def check_report_to(report_to: Sequence[str]) -> None:
    """Raise a ValueError for a ``report_to`` that is not a list of known backends, or ``all`` or ``none`` alone."""
    valid = (*report_backends(), REPORT_ALL, REPORT_NONE)
    unknown = [name for name in report_to if name not in valid]
    if unknown or not report_to:
        given = ", ".join(map(repr, unknown)) or "nothing"
        raise ValueError(f"report_to: unknown backend {given}; valid: {', '.join(valid)}")
    alone = {REPORT_ALL, REPORT_NONE} & set(report_to)
    if (len(report_to) > 1 and alone) or len(set(report_to)) < len(report_to):
        raise ValueError(f"report_to: name each backend once, or 'all' or 'none' alone; got {' '.join(report_to)}")


def backend_installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it: some backends are slow to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def report_to_argument(report_to: Sequence[str]) -> list[str]:
    """``TrainingArguments.report_to`` of a stage's ``report_to``, or a ValueError naming the ``pip install`` it needs.

    Called where settings are validated (before anything is written) and where the Trainer is set up.
    """
    check_report_to(report_to)
    if list(report_to) == [REPORT_NONE]:
        return []
    if list(report_to) == [REPORT_ALL]:
        return list(get_available_reporting_integrations())
    for name in report_to:
        if name in _NO_PACKAGE:
            continue
        modules, package = _PACKAGES.get(name, ((name,), name))
        if not any(backend_installed(m) for m in modules):
            raise ValueError(f"report_to {name!r} needs a package that is not installed: pip install {package}")
    return list(report_to)


def result_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (nested, as ``asdict`` gives them) without `REPORTING_SETTINGS`: what a run's results depend on."""
    return {
        key: result_settings(value) if isinstance(value, dict) else value
        for key, value in settings.items()
        if key not in REPORTING_SETTINGS
    }


@dataclass
class StageConfig:
    """Optimisation of one training stage (AdamW)."""

    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the stage's data (ignored if max_steps > 0)"})
    max_steps: int = field(default=0, metadata={"help": "optimizer steps; 0 = use epochs"})
    batch_size: int = field(default=32, metadata={"help": "sequences per optimizer step"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    schedule: str = field(default="constant", metadata={"help": f"learning-rate schedule, one of {SCHEDULES}"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr / peak lr for cosine_with_min_lr"})
    report_to: list[str] = field(
        default_factory=lambda: [REPORT_NONE],
        metadata={
            "help": "send the training loss and the run's own metrics (eval/...) to these transformers "
            "integrations: tensorboard (events in the run's folder), wandb (offline unless WANDB_MODE is set), "
            "mlflow, ...; 'all' = every installed one, 'none' = only the run's own files. Not part of the "
            "settings that identify a run"
        },
    )

    def __post_init__(self) -> None:
        # 120 and 120.0 are one setting: stored as floats, so they hash (cache keys) and print alike
        for name in ("lr", "epochs", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.lr <= 0 or self.batch_size <= 0 or self.epochs <= 0 or self.max_steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"invalid stage settings: {self}")
        if isinstance(self.report_to, str):  # a YAML file's ``report_to: tensorboard``
            self.report_to = [self.report_to]
        check_report_to(self.report_to)


# transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
CHECKPOINTING_ARGUMENT = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in TrainingArguments.__dataclass_fields__
)


def training_arguments(
    stage: StageConfig,
    output_dir: Path,
    seed: int,
    *,
    learning_rate: float | None = None,
    max_steps: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int = 1,
    warmup_steps: int | None = None,
    save_every: int = 0,
    save_total_limit: int | None = None,
    activation_checkpointing: bool = False,
    bf16: bool | None = None,
    logging_steps: int = 50,
    logging_dir: Path | None = None,
    in_order: bool = False,
) -> TrainingArguments:
    """The Trainer settings of one stage: the one place bio and cpt turn their settings into ``TrainingArguments``.

    Each keyword overrides what ``stage`` says (``learning_rate``: a method's own rate; ``max_steps``:
    a step count worked out by the caller; ``micro_batch_size`` with ``gradient_accumulation_steps``:
    ``stage.batch_size`` split over accumulation and processes). ``save_every`` > 0 writes a checkpoint
    every that many steps (``save_total_limit`` also bounds checkpoints asked for by a callback).
    ``bf16=None`` trains in bf16 on a GPU that has it. The loss is logged unfiltered: a NaN is not
    averaged away (`CheckpointingTrainer` stops on it anyway). ``stage.report_to`` picks the reporting
    integrations (W&B offline unless ``WANDB_MODE`` says otherwise); TensorBoard writes into
    ``logging_dir`` (on transformers 5, once `connect_reporting` has pointed its callback there).
    ``in_order``: the Trainer reads a map-style dataset in its own order instead of shuffling it (a dataset that
    orders itself, such as `scale_cl.data.replay.ReplayMix`).
    """
    cuda = torch.cuda.is_available()
    steps = stage.max_steps if max_steps is None else max_steps
    report_to = report_to_argument(stage.report_to)
    if "wandb" in report_to:
        os.environ.setdefault("WANDB_MODE", "offline")  # a run never uploads unless its user asks
    kwargs: dict[str, Any] = {CHECKPOINTING_ARGUMENT: activation_checkpointing}
    if logging_dir is not None and "logging_dir" in TrainingArguments.__dataclass_fields__:  # transformers 4
        kwargs["logging_dir"] = str(logging_dir)
    if in_order:
        if "train_sampling_strategy" not in TrainingArguments.__dataclass_fields__:
            raise ValueError(
                "training data in its own order (replay) needs transformers >= 5 (train_sampling_strategy)"
            )
        kwargs["train_sampling_strategy"] = "sequential"
    if stage.schedule == "cosine_with_min_lr":
        kwargs["lr_scheduler_kwargs"] = {"min_lr_rate": stage.min_lr_ratio}
    return TrainingArguments(
        output_dir=str(output_dir),
        learning_rate=stage.lr if learning_rate is None else learning_rate,
        num_train_epochs=stage.epochs,
        max_steps=steps if steps > 0 else -1,
        per_device_train_batch_size=micro_batch_size or stage.batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        warmup_steps=stage.warmup_steps if warmup_steps is None else warmup_steps,
        weight_decay=stage.weight_decay,
        lr_scheduler_type=stage.schedule,
        seed=seed,
        data_seed=seed,
        save_strategy="steps" if save_every else "no",
        save_steps=save_every or 500,
        save_total_limit=save_total_limit,
        logging_steps=logging_steps,
        logging_nan_inf_filter=False,
        report_to=report_to,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        bf16=(cuda and torch.cuda.is_bf16_supported()) if bf16 is None else bf16,
        disable_tqdm=False,
        **kwargs,
    )


def connect_reporting(trainer: Trainer, logging_dir: Path | None = None) -> Trainer:
    """Send ``trainer``'s `PeriodicEval` records to its reporting integrations, TensorBoard's files to ``logging_dir``.

    ``trainer.log`` hands a record to every integration's ``on_log``, so the run's own metrics sit beside
    the loss. Called once the Trainer exists (a callback cannot reach it). transformers 5 has no
    ``TrainingArguments.logging_dir``: its TensorBoard callback keeps its own (``TENSORBOARD_LOGGING_DIR``
    when set, which is left as it is). Without reporting this changes nothing.
    """
    if not trainer.args.report_to:
        return trainer

    def report(metrics: dict[str, float]) -> None:
        due = trainer.control.should_log
        trainer.log(metrics)
        trainer.control.should_log = due  # on_log clears it: the loss due at this step is still logged

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, PeriodicEval):
            callback.report = report
        elif isinstance(callback, TensorBoardCallback) and getattr(callback, "logging_dir", None) is None:
            callback.logging_dir = None if logging_dir is None else str(logging_dir)
    return trainer


def run_stage(
    model: torch.nn.Module,
    dataset: Dataset,
    collator: Callable,
    stage: StageConfig,
    output_dir: Path,
    seed: int,
    callbacks: Sequence[TrainerCallback] = (),
    run_info: dict[str, Any] | None = None,
    resume_from: Path | None = None,
    save_total_limit: int | None = None,
    logging_dir: Path | None = None,
    lr_ratios: dict[str, float] | None = None,
    in_order: bool = False,
) -> Trainer:
    """Train ``model`` in place for one stage; returns the Trainer (its ``state`` holds the log).

    A `CheckpointingTrainer`: a NaN/inf loss raises `NonFiniteLossError` instead of being trained on,
    and checkpoints (asked for by a callback such as `SaveAtEvaluations`) are trainable-only and
    atomic. ``run_info`` is recorded in them; ``resume_from`` continues from one. ``logging_dir``:
    TensorBoard's folder when ``stage.report_to`` names it. ``lr_ratios``: learning-rate multiples of parameter
    groups (`CheckpointingTrainer`). ``in_order``: ``dataset`` orders itself (`training_arguments`).
    """
    args = training_arguments(
        stage, output_dir, seed, save_total_limit=save_total_limit, logging_dir=logging_dir, in_order=in_order
    )
    trainer = CheckpointingTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        callbacks=list(callbacks),
        run_info=run_info,
        lr_ratios=lr_ratios,
    )
    connect_reporting(trainer, logging_dir)
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return trainer
