"""Sharded training through accelerate (FSDP2, DeepSpeed ZeRO-3): what a command does differently (docs/usage.md).

Every process evaluates and gathers the trained weights before the main one saves (`full_state_dict`), the merged
inference form is off, `requested_sharding` reads the launcher's environment before anything is built, and FSDP2
trains in the one-process run's mixed precision (`autocast_as_one_process`). Why each: docs/design.md §7.
"""

from __future__ import annotations

import os
from types import MethodType
from typing import Any

import torch
from torch import nn


def requested_sharding() -> str | None:
    """``"fsdp"`` or ``"deepspeed-zero3"`` when the launcher asked for sharded weights, else None (DDP or one
    process). DeepSpeed ZeRO-1/2 keep every weight on every process, as DDP does: not sharding here."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "") == "3":
        return "deepspeed-zero3"
    return None


def refuse_sharding(command: str, reason: str) -> None:
    """Raise a ValueError naming ``command`` when the launcher asked for sharding (call before anything is written)."""
    kind = requested_sharding()
    if kind is not None:
        raise ValueError(
            f"{command} does not run with sharded weights ({kind}, from the accelerate config): {reason}. Launch it "
            "without FSDP / ZeRO-3 (one process, torchrun, or accelerate's DDP config configs/accelerate/ddp.yaml)."
        )


def is_sharded(trainer: Any) -> bool:
    """Whether ``trainer`` (a transformers Trainer) shards the weights: FSDP, or DeepSpeed at ZeRO stage 3."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None) if trainer.is_deepspeed_enabled else None
    return plugin is not None and plugin.zero_stage == 3


def full_state_dict(trainer: Any) -> dict[str, torch.Tensor] | None:
    """The trained model's whole state dict, gathered from every process's shards (accelerate's ``get_state_dict``).

    A collective: every process must call it. The main process receives the tensors (on the CPU); the others may
    receive an empty dict. None when the weights are not sharded (the model holds them whole)."""
    if not is_sharded(trainer):
        return None
    return trainer.accelerator.get_state_dict(trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model)


def autocast_as_one_process(trainer: Any, model: nn.Module) -> bool:
    """Under FSDP2 in bf16 (or fp16), train in the one-process run's precision: no cast of the sharded parameters
    (fp32 all-gathers and gradient reduction: twice the bf16 traffic) and ``model``'s forward under autocast, wrapped
    as accelerate wraps it for one process. Call before ``trainer.train()`` (the plugin's policy is read when the
    model is sharded). Returns whether it changed anything."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2 or not trainer.accelerator.native_amp:
        return False
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy()  # parameters and gradients keep their dtype
    autocast = get_mixed_precision_context_manager(True, trainer.accelerator.autocast_handler)
    model._original_forward = model.forward  # where accelerate's unwrapping looks for it
    model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    return True
