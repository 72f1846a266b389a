"""The checkpoint format of an upscaled model: only what SCALE added, plus a JSON config naming the base model.

`save` writes it, `read_meta` / `read_tensors` read and verify it, `scale_cl.tuner.restore.load` rebuilds the model::

    scale_config.json                  the ScaleConfig, the base model and its fingerprint, tensors, files' SHA-256
    model.safetensors                  the parameters SCALE added (and new token rows), under the live model's names
    base_model.safetensors             only with full=True: the frozen base weights
    scale_frozen_stages.safetensors    only for a model grown more than once: the earlier stages' frozen blocks

Written atomically, nothing pickled (docs/design.md §5; the names and format versions: §7).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from scale_cl.files import atomic_write, sha256_of
from scale_cl.tuner.layers import is_new_parameter
from scale_cl.tuner.scale_state import scale_state_of
from scale_cl.tuner.stages import STAGES_KEY, frozen_parts
from scale_cl.tuner.vocab.rows import EXTENSION_KEY

FORMAT = "scale-cl"
VERSION = 2
READABLE_VERSIONS = (1, 2)
CONFIG_NAME = "scale_config.json"
WEIGHTS_NAME = "model.safetensors"
V1_WEIGHTS_NAME = "scale_model.safetensors"  # format version 1's name of the same file
BASE_WEIGHTS_NAME = "base_model.safetensors"
FROZEN_WEIGHTS_NAME = "scale_frozen_stages.safetensors"


def _unique_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())  # named_parameters lists a tied weight once


def check_tensors(found: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Raise a ValueError naming the missing, unexpected and wrongly shaped tensors of ``found``.

    Both map tensor names to shapes (any sequence of ints); ``where`` names the file or folder.
    """
    found = {n: tuple(s) for n, s in found.items()}
    expected = {n: tuple(s) for n, s in expected.items()}
    if found == expected:
        return
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
    raise ValueError(
        f"{where} does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}, "
        f"wrong shape {[(n, found[n], expected[n]) for n in wrong[:5]]}; was it written for another method or model?"
    )


def save(
    model: PreTrainedModel,
    save_directory: str | os.PathLike,
    full: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save an upscaled model's new parameters (and with ``full`` its base weights); see module doc."""
    state = scale_state_of(model)
    cfg, base = state.config, state.base
    if full and state.base_quant != "none":
        raise ValueError(
            f"full=True writes the base weights dense, but this model's base is quantized ({base['base_quant']}): save "
            "with full=False (a load quantizes the named base model again, the same way)"
        )
    values = state_dict if state_dict is not None else _unique_parameters(model)
    params = _unique_parameters(model)
    new = {n: values[n].detach().contiguous().cpu() for n in params if is_new_parameter(n)}
    original = {n: values[n].detach().contiguous().cpu() for n in params if not is_new_parameter(n)}
    stages = [stage.to_dict() for stage in state.stages]
    frozen = {}
    if stages:  # a grown model: its frozen tensors are the original base's widened by the earlier stages
        hub, added = frozen_parts(model)
        original, frozen = ({n: t.detach().contiguous().cpu() for n, t in part.items()} for part in (hub, added))

    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    base, vocab = _unextended(base, model)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "scale_config": cfg.to_dict(),
        "base_model": base,
        **({"vocab": vocab} if vocab else {}),
        **({STAGES_KEY: stages, "frozen_tensors": {n: list(t.shape) for n, t in frozen.items()}} if stages else {}),
        "full": full,
        "tensors": {n: list(t.shape) for n, t in new.items()},
        "sha256": {},
    }
    # Weights first, the config last: a directory whose config names them is complete.
    (directory / CONFIG_NAME).unlink(missing_ok=True)
    files = {
        WEIGHTS_NAME: new,
        **({FROZEN_WEIGHTS_NAME: frozen} if stages else {}),
        **({BASE_WEIGHTS_NAME: original} if full else {}),
    }
    for name, tensors in files.items():
        atomic_write(directory / name, lambda p, t=tensors: save_file(t, p, metadata={"format": "pt"}))
        meta["sha256"][name] = sha256_of(directory / name)
    (directory / V1_WEIGHTS_NAME).unlink(missing_ok=True)  # an older save into the same folder
    if not full:
        (directory / BASE_WEIGHTS_NAME).unlink(missing_ok=True)
    if not stages:
        (directory / FROZEN_WEIGHTS_NAME).unlink(missing_ok=True)
    atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(meta, indent=2)))
    return directory


def _unextended(base: dict[str, Any], model: nn.Module) -> tuple[dict[str, Any], dict[str, int] | None]:
    """The base record as the base model was before a vocabulary extension, and the extension's sizes.

    Loading rebuilds the base from that record (or from the base model it names) and then grows it by
    ``new_rows`` (`scale_cl.tuner.vocab.grow_embeddings`), whichever order extension and upscaling came in.
    """
    embedding = model.get_input_embeddings()
    new = getattr(embedding, "weight_new", None)
    if new is None:
        return base, None
    rows = embedding.weight.shape[0]
    config = {k: v for k, v in base["config"].items() if k != EXTENSION_KEY}
    return {**base, "config": {**config, "vocab_size": rows}}, {"base_rows": rows, "new_rows": new.shape[0]}


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(
            f"{directory} is not a scale-cl checkpoint: {CONFIG_NAME} is missing "
            "(save one with model.save_pretrained(dir))"
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the checkpoint is corrupted") from err
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a scale-cl checkpoint config (format={meta.get('format')!r})")
    if meta.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{path} has format version {meta.get('version')}; this scale-cl reads versions {READABLE_VERSIONS}"
        )
    return meta


def weights_name(meta: dict[str, Any]) -> str:
    """The new parameters' file in a checkpoint of ``meta``'s format version."""
    return V1_WEIGHTS_NAME if meta["version"] == 1 else WEIGHTS_NAME


def saved_names(model: nn.Module) -> list[str]:
    """The names of the tensors `save` writes into `WEIGHTS_NAME` for ``model``: its new parameters."""
    return [name for name in _unique_parameters(model) if is_new_parameter(name)]


def read_tensors(path: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    expected = meta["sha256"].get(path.name)
    if expected is None or sha256_of(path) != expected:
        raise ValueError(
            f"{path} does not match the SHA-256 recorded in {CONFIG_NAME}: the file is corrupted or was "
            "replaced after saving"
        )
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}; the file is corrupted or not safetensors") from err
