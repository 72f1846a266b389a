"""Rebuild an upscaled model from a checkpoint written by `scale_cl.tuner.io.save` (``model.save_pretrained``).

The base model is loaded (or taken as given), checked against what the checkpoint recorded
(class, shape fields, weight fingerprint), upscaled with the saved config (a grown model: with each
earlier stage's in turn, `scale_cl.tuner.stages`) and given the saved new weights (and the earlier stages'
additions to the frozen tensors), so its logits are bitwise the saved model's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from scale_cl.remote_code import trust_own_code
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.io import (
    BASE_WEIGHTS_NAME,
    CONFIG_NAME,
    FROZEN_WEIGHTS_NAME,
    check_tensors,
    read_meta,
    read_tensors,
    weights_name,
)
from scale_cl.tuner.layers import ScaleLinear, is_new_parameter
from scale_cl.tuner.modes import set_method
from scale_cl.tuner.provenance import weight_fingerprint
from scale_cl.tuner.quant import quantize_base, quantized_kind
from scale_cl.tuner.scale_state import StageRecord, scale_state_of
from scale_cl.tuner.stages import STAGES_KEY, assemble_frozen
from scale_cl.tuner.upscale import upscale
from scale_cl.tuner.vocab import grow_embeddings

# Base config fields whose mismatch makes a checkpoint unusable.
_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def _config_differences(recorded: dict[str, Any], config: Any) -> list[str]:
    now = config.to_dict()
    diffs = []
    for key in _SHAPE_FIELDS:
        if (key in recorded or key in now) and recorded.get(key) != now.get(key):
            diffs.append(f"{key}: checkpoint {recorded.get(key)!r}, base model {now.get(key)!r}")
    return diffs


def _load_base(meta: dict[str, Any], directory: Path, base_model: Any, kwargs: dict[str, Any]) -> PreTrainedModel:
    base = meta["base_model"]
    if meta["full"]:
        fields = {k: v for k, v in base["config"].items() if k != "quantization_config"}
        config = AutoConfig.for_model(**fields)
        dtype = getattr(torch, base["dtype"])
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        weights = read_tensors(directory / BASE_WEIGHTS_NAME, meta)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {n for n in missing if n not in dict(model.named_parameters())}
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"{directory / BASE_WEIGHTS_NAME} does not match its base config: "
                f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        return model
    if isinstance(base_model, PreTrainedModel):
        return base_model
    name = base_model or base["name_or_path"]
    if not name:
        raise ValueError(
            "this checkpoint does not name its base model (it was upscaled from a model built in memory): "
            "pass base_model=<model or path>, or save with full=True"
        )
    if not base_model and Path(name).is_absolute() and not Path(name).exists():
        raise FileNotFoundError(
            f"the base model of {directory} was recorded at {name}, which does not exist now (moved or deleted): "
            "pass base_model=<its new folder, or the model itself>"
        )
    if base.get("gguf_file") and not base_model:
        kwargs.setdefault("gguf_file", base["gguf_file"])
    kwargs.setdefault("dtype", getattr(torch, base["dtype"]))
    return AutoModelForCausalLM.from_pretrained(name, **kwargs)


def _fit_w12(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The saved weights without the zero W12 blocks a linear of ``model`` does not hold (written before SCALE-Preserve
    and the linears below ``preserve_layers`` held none); a nonzero one (a model switched to Preserve after training
    W12) gets its block allocated, and keeps its values."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, ScaleLinear)}
    kept = {}
    for name, tensor in weights.items():
        owner = linears.get(name.removesuffix(".w12")) if name.endswith(".w12") else None
        if owner is not None and owner.w12 is None:
            if not tensor.any():
                continue
            owner.add_w12()
        kept[name] = tensor
    return kept


def load(
    directory: str | os.PathLike,
    base_model: PreTrainedModel | str | None = None,
    check_base_weights: bool = True,
    **from_pretrained_kwargs: Any,
) -> PreTrainedModel:
    """Rebuild an upscaled model saved with ``save_pretrained``; its logits are bitwise the saved ones.

    Args:
        directory: the checkpoint directory; or a folder written by ``scale-cl export``, loaded as transformers
            loads it (its merged weights in `scale_cl.export.modeling_scale`'s classes: runs and serves, does not grow
            again), with ``trust_remote_code`` where its code is this scale-cl's own (`scale_cl.remote_code`).
        base_model: the base model (a model, upscaled in place, or a hub id / local path); by default
            the one the checkpoint names. Not needed for a ``full=True`` checkpoint.
        check_base_weights: refuse a base model whose weights differ from the one the checkpoint
            was trained on (compared by a fingerprint of its weights).
        from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` for the base.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such folder (relative to {Path.cwd()})")
    if not (directory / CONFIG_NAME).is_file() and trust_own_code(str(directory)):
        return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **from_pretrained_kwargs)
    meta = read_meta(directory)
    cfg = ScaleConfig.from_dict(meta["scale_config"])
    weights_path = directory / weights_name(meta)
    weights = read_tensors(weights_path, meta)
    shapes = {n: list(t.shape) for n, t in weights.items()}
    if shapes != meta["tensors"]:
        raise ValueError(f"{weights_path} does not hold the tensors {CONFIG_NAME} lists")

    model = _load_base(meta, directory, base_model, dict(from_pretrained_kwargs))
    recorded = meta["base_model"]
    if recorded.get("base_quant", "none") != quantized_kind(model):  # trained on a quantized base: quantize it alike
        model = quantize_base(model, recorded["base_quant"])
    if type(model).__name__ != recorded["class"]:
        raise ValueError(
            f"the checkpoint was trained on a {recorded['class']}, the base model is a {type(model).__name__}"
        )
    diffs = _config_differences(recorded["config"], model.config)
    if diffs:
        raise ValueError("the base model does not match the checkpoint's: " + "; ".join(diffs))
    if check_base_weights and not meta["full"] and weight_fingerprint(model) != recorded["fingerprint"]:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        raise ValueError(
            "the base model's weights differ from those this checkpoint was trained on "
            f"(fingerprint {weight_fingerprint(model)} != {recorded['fingerprint']}; dtype now {dtype}, "
            f"then {recorded['dtype']}). Load the same base checkpoint and dtype, or pass "
            "check_base_weights=False to accept the difference."
        )

    if meta.get("vocab"):  # an extended vocabulary: the new rows' values come with the new weights below
        grow_embeddings(model, meta["vocab"]["new_rows"])
    # The saved values replace the initialisers, so skip the SVD. A grown model's earlier stages are replayed
    # first (their frozen tensors are filled in below).
    for stage in [*(record["config"] for record in meta.get(STAGES_KEY, [])), cfg.to_dict()]:
        model = upscale(model, ScaleConfig.from_dict({**stage, "w21_init": "zero", "w22_init": "zero"}))
    weights = _fit_w12(model, weights)
    shapes = {n: list(t.shape) for n, t in weights.items()}
    params = dict(model.named_parameters())
    expected = {n: p.shape for n, p in params.items() if is_new_parameter(n)}
    check_tensors(shapes, expected, str(weights_path))
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    if meta.get(STAGES_KEY):
        frozen = read_tensors(directory / FROZEN_WEIGHTS_NAME, meta)
        if {n: list(t.shape) for n, t in frozen.items()} != meta["frozen_tensors"]:
            raise ValueError(f"{directory / FROZEN_WEIGHTS_NAME} does not hold the tensors {CONFIG_NAME} lists")
        assemble_frozen(model, frozen)
    state = scale_state_of(model)
    state.config, state.base = cfg, recorded
    # the earlier stages as trained (replayed above with zero initialisers)
    state.stages = [StageRecord.from_dict(record) for record in meta.get(STAGES_KEY, [])]
    return set_method(model, cfg.method)
