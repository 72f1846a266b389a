"""Write a model as a self-contained Hugging Face folder: `export_model` (any model in memory) and `export`
(``scale-cl export RUN_OR_CHECKPOINT OUT``: a run or checkpoint on disk, with its tokenizer and model card).

The folder holds ``config.json``, the weights (``model.safetensors``, or shards and their index above
``max_shard_size``, written by transformers' own ``save_pretrained``), ``generation_config.json``, the
tokenizer where there is one, a README.md model card and, for a SCALE model, ``modeling_scale.py`` (named
by ``auto_map`` in the config, so ``trust_remote_code=True`` loads it). A baseline (fft, freeze, llama_pro,
lora with its adapter merged) is a plain checkpoint of its stock class.

Everything is written into a hidden staging folder beside ``OUT`` and renamed into place at the end, so
a failed export leaves nothing behind, and an ``OUT`` that exists and is not empty is refused first.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from scale_cl.export import modeling_scale
from scale_cl.export.card import CardInfo, model_card
from scale_cl.export.config import DEFAULT_SHARD_SIZE, ExportSettings
from scale_cl.export.merge import MODELING_FILE, exported_model
from scale_cl.methods import scale_spec
from scale_cl.tuner.scale_state import scale_config_of


def check_out(out: str | os.PathLike) -> Path:
    """``out`` if it can be written: it does not exist, or is an empty folder; else a ValueError."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is a file; choose a new folder to export into")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new folder (nothing was written)")
    return out


def _is_peft(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def _method_of(model: nn.Module) -> str:
    """The method a model in memory shows it was trained with (fft and freeze look alike: "fine-tuned")."""
    if getattr(model, "is_scale_upscaled", False):
        return scale_spec(scale_config_of(model).method).name
    if _is_peft(model):
        return "lora"
    return "llama_pro" if getattr(model.config, "llama_pro", None) else "fine-tuned"


def _write_model(model: nn.Module, folder: Path, dtype: torch.dtype | None, max_shard_size: str) -> bool:
    """The weights, config and generation config into ``folder``; True where custom code was written too."""
    if getattr(model, "is_scale_upscaled", False):
        exported_model(model, dtype).save_pretrained(folder, max_shard_size=max_shard_size)
        shutil.copyfile(modeling_scale.__file__, folder / MODELING_FILE)
        return True
    if _is_peft(model):
        model = model.merge_and_unload()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return False


def export_model(
    model: nn.Module,
    out: str | os.PathLike,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    card: CardInfo | None = None,
) -> Path:
    """Write ``model`` into the new folder ``out`` (see the module doc) and return ``out``.

    ``model``: an upscaled SCALE model (merged into `scale_cl.export.modeling_scale`'s classes; left as it
    is), a PEFT LoRA model (merged and unloaded: the PeftModel given is used up) or a plain transformers
    causal LM (cast to ``dtype`` in place). ``card``: the model card's facts (default: the method alone).
    """
    out = check_out(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # left by an export of this process that was killed
    staging.mkdir(parents=True)
    try:
        custom_code = _write_model(model, staging, dtype, str(max_shard_size))
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        card = card or CardInfo(method=_method_of(model), custom_code=custom_code)
        card.custom_code = custom_code
        (staging / "README.md").write_text(model_card(card))
        os.replace(staging, out)  # an empty `out` is replaced, a non-empty one (made meanwhile) refused
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def export(settings: ExportSettings) -> Path:
    """``scale-cl export``: find and load the run or checkpoint, then `export_model` it with its tokenizer and card."""
    from scale_cl.export.source import card_info, find_source, load_source, load_tokenizer

    if not settings.source or not settings.out:
        raise ValueError("give the run or checkpoint to export and the folder to write: scale-cl export SOURCE OUT")
    out = check_out(settings.out)
    source = find_source(settings.source)
    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    print(f"[export] loading {source.model_dir} ({source.kind})")
    model, method, base_model = load_source(source, dtype)
    tokenizer = load_tokenizer(source.model_dir)
    custom_code = getattr(model, "is_scale_upscaled", False)
    card = card_info(source, method, base_model, custom_code, model)
    print(f"[export] writing {method} to {out}" + (" (with modeling_scale.py)" if custom_code else ""))
    export_model(model, out, tokenizer=tokenizer, dtype=dtype, max_shard_size=settings.max_shard_size, card=card)
    remote = ", trust_remote_code=True" if custom_code else ""
    print(f"[export] done: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}{remote})")
    return out
