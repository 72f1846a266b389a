"""Where a training stage runs and in which precision: the one reading of a stage's ``device`` and ``precision``
(`scale_cl.train.config.StageConfig`), for the Trainer (`scale_cl.train.arguments.training_arguments`) and for
every pass the experiments run outside it (evaluations of a model before it trains, pseudo-replay sampling, the
frozen teacher, the layer probes), so that nothing picks a device or a dtype by itself.

``device``: ``auto`` is CUDA when torch sees a GPU, else the CPU; ``cuda`` without a GPU is refused, before
anything is written. One process trains on one GPU, the first that ``CUDA_VISIBLE_DEVICES`` leaves visible;
several GPUs take one process each (``torchrun``, ``accelerate launch``). ``precision``: ``auto`` is bf16 mixed
precision (fp32 weights, bf16 autocast, the Trainer's ``bf16=True``) on a GPU that supports it, else fp32;
``bf16`` on a GPU without bf16 is refused (on the CPU it runs, under CPU autocast).

On CUDA, torch's cuDNN attention kernel is switched off (`avoid_cudnn_attention`): its backward returns NaN
gradients under an explicit attention mask, as padded batches have (pytorch#196678, trl#7181; seen here on an H200,
torch 2.11: SCALE-Route's bf16 training went NaN at its fourth step, finite with the kernel off). SDPA takes the
flash or memory-efficient kernel instead. ``SCALE_CL_CUDNN_ATTENTION=1`` keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from scale_cl.train.config import DEVICES, PRECISIONS

CUDNN_ATTENTION_ENV = "SCALE_CL_CUDNN_ATTENTION"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """A resolved ``device`` (``cpu`` or ``cuda``) and precision (``bf16``: bf16 autocast over fp32 weights)."""

    device: str
    bf16: bool

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on this device where the precision is bf16; nothing in fp32."""
        return torch.autocast(self.device, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def record(self) -> dict[str, str]:
        """What a run records of where it trained: the device, the precision and, on a GPU, its name."""
        record = {"device": self.device, "precision": self.precision}
        if self.device == "cuda":
            record["gpu"] = torch.cuda.get_device_name()
        return record


def resolve_device(device: str, name: str = "device") -> str:
    """``cpu`` or ``cuda`` for a ``device`` setting; ``name``: the option, as the error names it."""
    if device not in DEVICES:
        raise ValueError(f"{name} must be one of {DEVICES}, got {device!r}")
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ValueError(
            f"{name}=cuda, but torch sees no CUDA device (torch {torch.__version__}: a CPU build, no GPU, or "
            f"CUDA_VISIBLE_DEVICES hides them); set {name} auto or cpu"
        )
    resolved = ("cuda" if cuda else "cpu") if device == "auto" else device
    if resolved == "cuda":
        avoid_cudnn_attention()
    return resolved


def avoid_cudnn_attention() -> bool:
    """Switch torch's cuDNN attention kernel off (module doc) unless ``SCALE_CL_CUDNN_ATTENTION=1``; whether it was
    on and is now off."""
    if os.environ.get(CUDNN_ATTENTION_ENV) == "1" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    logger.info(
        "cuDNN attention switched off: its backward returns NaN gradients under padding masks (pytorch#196678); "
        "%s=1 keeps it",
        CUDNN_ATTENTION_ENV,
    )
    return True


def resolve_precision(precision: str, device: str, name: str = "precision") -> bool:
    """Whether a stage on the resolved ``device`` trains in bf16; ``name``: the option, as the error names it."""
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    gpu_bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "bf16" and device == "cuda" and not gpu_bf16:
        raise ValueError(f"{name}=bf16, but this GPU ({torch.cuda.get_device_name()}) has no bf16; set {name} fp32")
    return precision == "bf16" or (precision == "auto" and gpu_bf16)


def stage_placement(stage: Any, section: str | None = None) -> Placement:
    """Where ``stage`` (a `StageConfig`) runs; errors name its options under ``section`` (default: its own,
    e.g. ``train.``)."""
    section = getattr(stage, "section", "") if section is None else section
    device = resolve_device(stage.device, f"{section}device")
    return Placement(device, resolve_precision(stage.precision, device, f"{section}precision"))


def used_placement(args: Any) -> dict[str, str]:
    """`Placement.record` of the device and precision a Trainer's ``TrainingArguments`` train with."""
    return Placement(args.device.type, bool(args.bf16)).record()


__all__ = [
    "Placement",
    "avoid_cudnn_attention",
    "resolve_device",
    "resolve_precision",
    "stage_placement",
    "used_placement",
]
