"""Run one training stage on the HF Trainer (accelerate, DDP and resuming come from it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from scale_cl.train.checkpointing import CheckpointingTrainer

SCHEDULES = ("constant", "linear", "cosine", "cosine_with_min_lr")


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
) -> TrainingArguments:
    """The Trainer settings of one stage: the one place bio and cpt turn their settings into ``TrainingArguments``.

    Each keyword overrides what ``stage`` says (``learning_rate``: a method's own rate; ``max_steps``:
    a step count worked out by the caller; ``micro_batch_size`` with ``gradient_accumulation_steps``:
    ``stage.batch_size`` split over accumulation and processes). ``save_every`` > 0 writes a checkpoint
    every that many steps (``save_total_limit`` also bounds checkpoints asked for by a callback).
    ``bf16=None`` trains in bf16 on a GPU that has it. The loss is logged unfiltered: a NaN is not
    averaged away (`CheckpointingTrainer` stops on it anyway).
    """
    cuda = torch.cuda.is_available()
    steps = stage.max_steps if max_steps is None else max_steps
    kwargs: dict[str, Any] = {CHECKPOINTING_ARGUMENT: activation_checkpointing}
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
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        bf16=(cuda and torch.cuda.is_bf16_supported()) if bf16 is None else bf16,
        disable_tqdm=False,
        **kwargs,
    )


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
) -> Trainer:
    """Train ``model`` in place for one stage; returns the Trainer (its ``state`` holds the log).

    A `CheckpointingTrainer`: a NaN/inf loss raises `NonFiniteLossError` instead of being trained on,
    and checkpoints (asked for by a callback such as `SaveAtEvaluations`) are trainable-only and
    atomic. ``run_info`` is recorded in them; ``resume_from`` continues from one.
    """
    trainer = CheckpointingTrainer(
        model=model,
        args=training_arguments(stage, output_dir, seed, save_total_limit=save_total_limit),
        train_dataset=dataset,
        data_collator=collator,
        callbacks=list(callbacks),
        run_info=run_info,
    )
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return trainer
