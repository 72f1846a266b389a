"""The escape hatch ``args`` (any other ``TrainingArguments`` setting), checked by the field's type; apart from
`scale_cl.train.arguments` so that the stage settings can check it without importing what builds the arguments."""

from __future__ import annotations

import functools
import typing
from typing import Any

from transformers import TrainingArguments

from scale_cl.setting_types import conform

# TrainingArguments that scale-cl sets from its own settings: refused in ``args``, naming the setting to use
OWNED = {
    "output_dir": "--out",
    "learning_rate": "lr (or the method's rate)",
    "num_train_epochs": "epochs",
    "max_steps": "max_steps (or tokens)",
    "per_device_train_batch_size": "batch_size / micro_batch_size",
    "gradient_accumulation_steps": "batch_size / micro_batch_size",
    "warmup_steps": "warmup_steps / warmup_ratio",
    "warmup_ratio": "warmup_steps / warmup_ratio",
    "weight_decay": "weight_decay",
    "lr_scheduler_type": "schedule",
    "lr_scheduler_kwargs": "schedule / min_lr_ratio / decay_ratio",
    "seed": "seed",
    "data_seed": "seed",
    "save_strategy": "save_every",
    "save_steps": "save_every",
    "save_total_limit": "save_total_limit",
    "logging_steps": "logging_steps",
    "report_to": "report_to",
    "use_cpu": "device",
    "bf16": "precision",
    "fp16": "precision",
    "optim": "optim",
    "max_grad_norm": "max_grad_norm",
    "run_name": "run_name",
    "gradient_checkpointing": "gradient_checkpointing",
    "activation_checkpointing": "gradient_checkpointing",
    "remove_unused_columns": "(scale-cl's batches need it false)",
    "dataloader_num_workers": "data.loader_workers",
}


@functools.cache
def _argument_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainingArguments)


def check_extra_arguments(extra: dict[str, Any], section: str = "") -> dict[str, Any]:
    """``args`` (more ``TrainingArguments`` settings) with each value as its field's type; a ValueError for a key that
    is no such setting, one scale-cl sets from its own options (`OWNED`), or a value of the wrong type."""
    types = _argument_types()
    checked = {}
    for key, value in extra.items():
        if key in OWNED:
            raise ValueError(f"{section}args {key}: scale-cl sets it; use {section}{OWNED[key]} instead")
        if key not in TrainingArguments.__dataclass_fields__ or not TrainingArguments.__dataclass_fields__[key].init:
            raise ValueError(
                f"{section}args {key}: not a transformers TrainingArguments setting (transformers "
                f"{__import__('transformers').__version__}); see its documentation for the names"
            )
        annotation = types.get(key, Any)
        if isinstance(value, str) and typing.get_origin(annotation) in (typing.Union, __import__("types").UnionType):
            args = typing.get_args(annotation)
            if type(None) in args and value.strip().lower() in ("none", "null"):
                checked[key] = None
                continue
        checked[key] = conform(f"{section}args {key}", annotation, value)
    return checked
