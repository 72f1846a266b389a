"""Run one training stage on the HF Trainer (accelerate, DDP and resuming come from it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

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
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.lr <= 0 or self.batch_size <= 0 or self.epochs <= 0 or self.max_steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"invalid stage settings: {self}")


def training_arguments(stage: StageConfig, output_dir: Path, seed: int) -> TrainingArguments:
    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = {}
    if stage.schedule == "cosine_with_min_lr":
        kwargs["lr_scheduler_kwargs"] = {"min_lr_rate": stage.min_lr_ratio}
    return TrainingArguments(
        output_dir=str(output_dir),
        learning_rate=stage.lr,
        num_train_epochs=stage.epochs,
        max_steps=stage.max_steps if stage.max_steps > 0 else -1,
        per_device_train_batch_size=stage.batch_size,
        warmup_steps=stage.warmup_steps,
        weight_decay=stage.weight_decay,
        lr_scheduler_type=stage.schedule,
        seed=seed,
        data_seed=seed,
        save_strategy="no",
        report_to=[],
        logging_steps=50,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        bf16=cuda and torch.cuda.is_bf16_supported(),
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
) -> Trainer:
    """Train ``model`` in place for one stage; returns the Trainer (its ``state`` holds the log)."""
    trainer = Trainer(
        model=model,
        args=training_arguments(stage, output_dir, seed),
        train_dataset=dataset,
        data_collator=collator,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer
