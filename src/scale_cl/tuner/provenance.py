"""What an upscaled model was built from: recorded at upscale time, checked when a checkpoint is loaded."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from scale_cl.tuner.quant import quantized_kind
from scale_cl.tuner.widths import Dims


def weight_fingerprint(model: nn.Module) -> str:
    """A cheap hash of a strided sample of the base weights, to tell one base checkpoint from another; ``"meta"`` for a
    model on the meta device (shapes only, as a plan counts its parameters)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if param.is_meta:
            return "meta"
        if name.rsplit(".", 1)[-1] in ("weight", "bias"):
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            digest.update(name.encode())
            digest.update(flat[::step].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def recorded_name(name: str) -> str:
    """A base loaded from a local folder or file as its absolute path (a checkpoint is loaded from any directory),
    a hub id as it is."""
    return str(Path(name).resolve()) if name and Path(name).exists() else name


def base_record(model: PreTrainedModel, dims: Dims) -> dict[str, Any]:
    """The base model's name (and GGUF file), class, config, sizes, dtype and weight fingerprint."""
    config = model.config
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    return {
        "name_or_path": recorded_name(getattr(config, "_name_or_path", "") or ""),
        "gguf_file": quant.get("gguf_file") if quant.get("quant_method") == "gguf" else None,
        "class": type(model).__name__,
        "config": config.to_dict(),
        "dims": asdict(dims),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "base_quant": quantized_kind(model),  # `scale_cl.tuner.quant`: a load quantizes the base the same way
        "fingerprint": weight_fingerprint(model),
    }
