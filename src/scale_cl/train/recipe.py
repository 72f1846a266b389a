"""Train one model: the one recipe every experiment trains through (bio's stages, cpt's methods, the layer probes,
the clean base).

What it does, in order: read a dataset that orders itself (replay) in its own order; find the last complete
checkpoint in ``args.output_dir`` to resume from (or, starting afresh, clear the reporting folder of an earlier
attempt); put SCALE-Route's tau calibration before every other callback (an evaluation sees the step's tau);
build the `CheckpointingTrainer` (trainable-only atomic checkpoints, ``run_info`` checked on resume, per-group
learning rates, a hard stop on a non-finite loss); under sharded weights (FSDP, ZeRO-3), have every process evaluate
and switch the merged inference form off (`scale_cl.train.sharding`); connect the reporting integrations; train.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer_callback import ProgressCallback

from scale_cl.train.callbacks import LossLog, PeriodicEval, SaveEveryMinutes, TokensProgress
from scale_cl.train.distill import Distillation
from scale_cl.train.reporting import connect_reporting
from scale_cl.train.route_calibration import RouteCalibration
from scale_cl.train.sharding import autocast_as_one_process, is_sharded
from scale_cl.train.trainer import CheckpointingTrainer, complete_checkpoints
from scale_cl.tuner.merged import set_merged_inference


def train_model(
    model: nn.Module,
    dataset: Dataset,
    args: TrainingArguments,
    *,
    collator: Callable = default_data_collator,
    callbacks: Sequence[TrainerCallback] = (),
    calibration: RouteCalibration | None = None,
    run_info: dict[str, Any] | None = None,
    lr_ratios: dict[str, float] | None = None,
    resume: bool = False,
    logging_dir: Path | None = None,
    distillation: Distillation | None = None,
    tokens_per_step: int | None = None,
    save_minutes: float = 0.0,
    loss_log: Path | None = None,
    sliced: bool = True,
) -> CheckpointingTrainer:
    """Train ``model`` in place on ``dataset`` with ``args`` (`scale_cl.train.arguments.training_arguments`);
    returns the Trainer (its ``state`` holds the log).

    Args:
        collator: batches ``dataset``'s items (the Trainer's default: stacked tensors).
        callbacks: run in this order, after ``calibration``.
        calibration: SCALE-Route's tau chosen from data (`RouteCalibration`), first among the callbacks.
        run_info: what the run is (method, rate, base, ...), written into every checkpoint with ``lr_ratios``
            and the calibration's share; a checkpoint of another run is refused on resume.
        lr_ratios: learning-rate multiples of parameter groups by name suffix (`CheckpointingTrainer`).
        resume: continue from the last complete checkpoint in ``args.output_dir`` when there is one.
        logging_dir: TensorBoard's folder when ``report_to`` names it; emptied when the run starts afresh.
        distillation: a KL term to the base model's logits (`scale_cl.train.distill`); recorded in ``run_info``.
        tokens_per_step: the tokens of one optimizer step: the progress bar shows tokens/s (`TokensProgress`).
        save_minutes: also save a checkpoint whenever this many minutes have passed (`SaveEveryMinutes`).
        loss_log: a JSONL file that keeps every logged loss, whatever ``report_to`` says (`LossLog`).
        sliced: the loss a slice of positions at a time (`scale_cl.train.chunked_loss`); False: transformers' own.
    """
    if getattr(dataset, "in_order", False):  # e.g. replay's exact share of every batch (`scale_cl.data.replay`)
        if not hasattr(args, "train_sampling_strategy"):
            raise ValueError("training data in its own order (replay) needs transformers 5 (train_sampling_strategy)")
        args.train_sampling_strategy = "sequential"
    run_info = dict(run_info or {})
    if lr_ratios:
        run_info["lr_ratios"] = lr_ratios
    if calibration is not None:
        run_info["route_share"] = calibration.share
    if distillation is not None:
        run_info["distill"] = asdict(distillation.config)
    checkpoints = complete_checkpoints(Path(args.output_dir)) if resume else []
    checkpoint = checkpoints[-1] if checkpoints else None
    trainer = CheckpointingTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        callbacks=[*([calibration] if calibration is not None else []), *callbacks],
        run_info=run_info,
        lr_ratios=lr_ratios,
        distillation=distillation,
        slice_positions=0 if sliced else None,
    )
    if tokens_per_step and not args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(TokensProgress(tokens_per_step))
    if save_minutes:
        trainer.add_callback(SaveEveryMinutes(save_minutes))
    if loss_log is not None:
        trainer.add_callback(LossLog(loss_log, tokens_per_step or 0))
    if is_sharded(trainer):  # every process takes part in a forward pass (`scale_cl.train.sharding`)
        set_merged_inference(model, False)  # a merged copy would hold every gathered layer whole
        autocast_as_one_process(trainer, model)
        for callback in callbacks:
            if isinstance(callback, PeriodicEval):
                callback.every_process = True
    if checkpoint is None and logging_dir is not None and trainer.is_world_process_zero():
        shutil.rmtree(logging_dir, ignore_errors=True)  # a run started afresh: no events of an earlier attempt
    connect_reporting(trainer, logging_dir)
    if checkpoint is not None and trainer.is_world_process_zero():
        print(f"[train] resuming from {checkpoint}")
    trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    return trainer
