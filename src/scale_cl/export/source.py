"""What ``scale-cl export`` reads: a finished run's model or a SCALE checkpoint, found and loaded with its records.

Accepted folders (anything else is refused, naming what was expected, before anything is loaded):

* a finished ``scale-cl cpt`` method folder ``<out>/<method>``, or a finished ``scale-cl train`` run folder (its
  ``model/`` and ``result.json``);
* a folder written by `scale_cl.models.save_trained` (``scale_cl_run.json``; the ``model`` folder of a run);
* a SCALE checkpoint written by ``model.save_pretrained(dir)`` (`scale_cl.tuner.io`: ``scale_config.json``).

A run's ``result.json`` (learning and forgetting measured during training) and the run folder's
``cpt_config.json`` (its data and settings) feed the model card where they exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scale_cl.export.card import CardInfo, read_json
from scale_cl.models import RUN_FILE, read_run_file
from scale_cl.tuner.io import CONFIG_NAME, read_meta
from scale_cl.tuner.scale_state import scale_config_of

MODEL_DIR = "model"  # a cpt method folder's saved model
RESULT_FILE = "result.json"  # a finished cpt method's summary (scale_cl.experiments.train.method.RESULT_FILE)
RUN_CONFIG = "cpt_config.json"  # a cpt run folder's settings (scale_cl.experiments.cpt.pipeline.CONFIG_FILE)
TRAIN_CONFIG = "train_config.json"  # a `scale-cl train` run's settings, in its own folder (scale_cl.experiments.train)
TRAINING_CHECKPOINT = "checkpoint.json"  # a resumable training checkpoint (scale_cl.train.trainer)
EXPECTED = (
    f"a finished `scale-cl cpt` method folder (<out>/<method>, holding {MODEL_DIR}/{RUN_FILE}), a model folder "
    f"written by scale_cl.models.save_trained (holding {RUN_FILE}), or a SCALE checkpoint written by "
    f"model.save_pretrained(dir) (holding {CONFIG_NAME})"
)


@dataclass(frozen=True)
class Source:
    """A folder to export: ``kind`` is ``"run"`` (`save_trained`'s format) or ``"checkpoint"``
    (`scale_cl.tuner.io`'s)."""

    model_dir: Path
    kind: str
    result: Path | None = None  # the method's result.json
    run_config: Path | None = None  # the run folder's cpt_config.json


def _run_records(model_dir: Path) -> tuple[Path | None, Path | None]:
    """result.json and the settings (cpt_config.json, or a train run's train_config.json) of the run a
    ``<out>/<method>/model`` (``<out>/model``) folder belongs to."""
    method_dir = model_dir.parent
    result = method_dir / RESULT_FILE if model_dir.name == MODEL_DIR else None
    if result is None or not result.is_file():
        return None, None
    config = next((c for c in (method_dir.parent / RUN_CONFIG, method_dir / TRAIN_CONFIG) if c.is_file()), None)
    return result, config


def find_source(path: str | os.PathLike) -> Source:
    """The model ``path`` holds, or a ValueError / FileNotFoundError saying what was expected instead."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; expected {EXPECTED}")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; expected a folder: {EXPECTED}")
    if (path / RUN_FILE).is_file():
        return Source(path, "run", *_run_records(path))
    if (path / MODEL_DIR / RUN_FILE).is_file():
        return Source(path / MODEL_DIR, "run", *_run_records(path / MODEL_DIR))
    if (path / CONFIG_NAME).is_file():
        return Source(path, "checkpoint")
    raise ValueError(f"{path} is not a finished run or checkpoint: {_why_not(path)}; expected {EXPECTED}")


def _why_not(path: Path) -> str:
    """What ``path`` looks like instead, to say in the error."""
    if (path / RUN_CONFIG).is_file():
        methods = sorted(p.parent.parent.name for p in path.glob(f"*/{MODEL_DIR}/{RUN_FILE}"))
        if methods:
            return f"it is a cpt run folder of several methods; pass one of them ({', '.join(methods)})"
        return "it is a cpt run folder in which no method has finished (nor saved its model)"
    if (path / TRAINING_CHECKPOINT).is_file():
        return "it is a resumable training checkpoint (only the trainable weights); export the finished method folder"
    if (path / RESULT_FILE).is_file():
        return f"the method finished without saving its model ({MODEL_DIR}/ is missing; a sweep keeps only metrics)"
    if (path / "run").is_dir():
        return "the method has not finished (re-run its command to finish it)"
    return "no scale-cl model found in it"


def load_source(source: Source, dtype: torch.dtype | None = None) -> tuple[nn.Module, str, str | None]:
    """(model, method, base model name) of ``source``; the base model is loaded from where the run named it."""
    try:
        if source.kind == "run":
            from scale_cl.models import load_trained

            run = read_run_file(source.model_dir)
            model, _, method = load_trained(source.model_dir, **({"dtype": dtype} if dtype else {}))
            return model, method, _base_name(run["base"])
        from scale_cl.tuner.restore import load

        meta = read_meta(source.model_dir)
        model = load(source.model_dir).eval()
        return model, f"scale_{meta['scale_config']['method']}", _base_name(meta["base_model"]) or None
    except OSError as err:  # FileNotFoundError included: the base model (or a file of it) cannot be had
        raise FileNotFoundError(
            f"cannot load {source.model_dir}: {err}. A SCALE or LoRA model is rebuilt from its base model, which must "
            "be where the run found it (a local folder or a hub id in the local cache)"
        ) from err


def _base_name(base: dict[str, Any]) -> str:
    name = base.get("name_or_path") or ""
    return f"{name}/{base['gguf_file']}" if name and base.get("gguf_file") else name


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved beside the model, as saved (no pad token added), or None when there is none."""
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def card_info(source: Source, method: str, base_model: str | None, custom_code: bool, model: nn.Module) -> CardInfo:
    """The model card's facts: the method and base, the SCALE settings, the run's settings and results."""
    scale = scale_config_of(model) if getattr(model, "is_scale_upscaled", False) else None
    return CardInfo(
        method=method,
        custom_code=custom_code,
        base_model=base_model,
        scale=scale,
        run_settings=read_json(source.run_config),
        result=read_json(source.result),
    )
