"""Sharded training through accelerate (FSDP2, DeepSpeed ZeRO-3): what a command does differently (docs/usage.md).

Under sharding every process holds a slice of every weight, and a forward pass gathers each layer's slices from
all processes. So what a DDP run does on the main process alone must run on every process: the evaluations
(`scale_cl.train.callbacks.PeriodicEval`) and gathering the trained weights before the main process saves them
(`full_state_dict`). The merged inference form of a `ScaleLinear` is switched off (`set_merged_inference`: it would
keep a dense copy of every layer on every process, and the gathered weights it is built from are freed after each
layer's forward).

``accelerate launch --config_file configs/accelerate/fsdp2.yaml`` sets accelerate's environment
(``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_DEEPSPEED`` and ``ACCELERATE_DEEPSPEED_ZERO_STAGE``), so
`requested_sharding` knows before anything is built, and a command can refuse what it does not support before it
writes anything.

**Mixed precision under FSDP2 is the one-process run's**: fp32 weights and gradients, bf16 products under
``torch.autocast`` (`autocast_as_one_process`). Left to itself, accelerate's FSDP2 plugin casts every parameter to
bf16 for the forward pass (norm gains and the embedding too, so the whole residual stream is bf16), reduces the
gradients in bf16, and does not autocast (its FSDP2 path skips the wrapper its other paths put around
``forward``): another, coarser arithmetic than one GPU's, which moved 3% of a tiny model's trained weights by up to
2.3e-3 after 6 steps (measured on an H200; reproduced on the CPU). DeepSpeed's bf16 mode likewise computes with
bf16 weights; it is left as DeepSpeed has it.
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
