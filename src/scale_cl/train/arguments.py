"""``TrainingArguments`` from a stage's settings: the one place the experiments' settings become the Trainer's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from scale_cl.train.config import StageConfig
from scale_cl.train.device import stage_placement
from scale_cl.train.extra_arguments import check_extra_arguments
from scale_cl.train.reporting import report_to_argument

# transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
CHECKPOINTING_ARGUMENT = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in TrainingArguments.__dataclass_fields__
)


_OPTIMIZERS = {"adamw_torch_fused": "adamw_torch_fused", "adamw_torch": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit"}


def resolved_optimizer(stage: StageConfig) -> str:
    """The Trainer's ``optim`` for a stage's ``optim`` (``auto``: the Trainer's default)."""
    if stage.optim == "auto":
        return TrainingArguments.__dataclass_fields__["optim"].default
    return _OPTIMIZERS[stage.optim]


def schedule_arguments(stage: StageConfig, steps: int) -> dict[str, Any]:
    """``lr_scheduler_type`` and ``lr_scheduler_kwargs`` of a stage's schedule over ``steps`` optimizer steps."""
    if stage.schedule == "cosine_with_min_lr":
        return {"lr_scheduler_type": stage.schedule, "lr_scheduler_kwargs": {"min_lr_rate": stage.min_lr_ratio}}
    if stage.schedule == "wsd":
        decay = max(1, math.ceil(stage.decay_ratio * steps)) if steps > 0 else 1
        kwargs = {"num_decay_steps": decay, "min_lr_ratio": stage.min_lr_ratio, "decay_type": "cosine"}
        return {"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": kwargs}
    return {"lr_scheduler_type": stage.schedule}


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
    logging_steps: int = 50,
    logging_dir: Path | None = None,
    loader_workers: int = 0,
) -> TrainingArguments:
    """The Trainer settings of one stage: the one place bio and cpt turn their settings into ``TrainingArguments``.

    Each keyword overrides what ``stage`` says (``learning_rate``: a method's own rate; ``max_steps``:
    a step count worked out by the caller; ``micro_batch_size`` with ``gradient_accumulation_steps``:
    ``stage.batch_size`` split over accumulation and processes). ``save_every`` > 0 writes a checkpoint
    every that many steps (``save_total_limit`` also bounds checkpoints asked for by a callback).
    ``stage.device`` and ``stage.precision`` say where and in which precision it trains (`scale_cl.train.device`:
    ``use_cpu`` and ``bf16``); a process that sees several GPUs trains on the first, not over all of them with
    ``nn.DataParallel`` as the Trainer would (`one_gpu_per_process`; several GPUs: one process each). The loss is
    logged unfiltered: a NaN is not averaged away (`CheckpointingTrainer` stops on it anyway).
    ``stage.report_to`` picks the reporting integrations (each follows its own settings: W&B its ``WANDB_*``
    variables, as with transformers); TensorBoard writes into ``logging_dir`` (on transformers 5, once
    `connect_reporting` has pointed its callback there). ``stage.optim``, ``max_grad_norm``, ``run_name`` and the
    schedule (`schedule_arguments`) are the stage's; ``stage.args`` adds any other ``TrainingArguments`` setting.
    ``loader_workers``: the DataLoader's worker processes.
    A dataset that orders itself (replay) is read in its order by `scale_cl.train.recipe.train_model`.
    """
    placement = stage_placement(stage)
    steps = stage.max_steps if max_steps is None else max_steps
    report_to = report_to_argument(stage.report_to)
    kwargs: dict[str, Any] = {CHECKPOINTING_ARGUMENT: activation_checkpointing}
    if logging_dir is not None and "logging_dir" in TrainingArguments.__dataclass_fields__:  # transformers 4
        kwargs["logging_dir"] = str(logging_dir)
    kwargs.update(schedule_arguments(stage, steps))
    if stage.run_name:
        kwargs["run_name"] = stage.run_name
    kwargs.update(check_extra_arguments(stage.args))
    args = TrainingArguments(
        output_dir=str(output_dir),
        learning_rate=stage.lr if learning_rate is None else learning_rate,
        num_train_epochs=stage.epochs,
        max_steps=steps if steps > 0 else -1,
        per_device_train_batch_size=micro_batch_size or stage.batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        warmup_steps=stage.warmup_steps if warmup_steps is None else warmup_steps,
        weight_decay=stage.weight_decay,
        optim=resolved_optimizer(stage),
        max_grad_norm=stage.max_grad_norm,
        seed=seed,
        data_seed=seed,
        save_strategy="steps" if save_every else "no",
        save_steps=save_every or 500,
        save_total_limit=save_total_limit,
        logging_steps=logging_steps,
        logging_nan_inf_filter=False,
        report_to=report_to,
        remove_unused_columns=False,
        dataloader_num_workers=loader_workers,
        use_cpu=placement.device == "cpu",
        bf16=placement.bf16,
        disable_tqdm=False,
        **kwargs,
    )
    return one_gpu_per_process(args)


def one_gpu_per_process(args: TrainingArguments) -> TrainingArguments:
    """``args`` with the Trainer's single-process multi-GPU mode off: one process that sees several GPUs trains on
    the first (``cuda:0``, the first that ``CUDA_VISIBLE_DEVICES`` leaves), as under ``torchrun`` each process
    does, instead of wrapping the model in ``nn.DataParallel`` over all of them (which would multiply the batch by
    the GPUs and split every forward pass). The Trainer does the same itself for a model spread over devices."""
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args
