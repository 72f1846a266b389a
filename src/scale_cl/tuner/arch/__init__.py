"""Where each supported architecture keeps its linears, norms, embedding and head.

An `ArchSpec` is data: `scale_cl.tuner.upscale` walks a model with it. Adding a family means adding one file with
its `ArchSpec` and, optionally, its decoder layer's forward with the two streams apart (a
`scale_cl.tuner.streams.StreamsApartLayer`, the spec's ``layer_apart``; without one the layer joins and splits the
streams in every widened module), and one entry in `SPECS` (docs/design.md §0, "Add a family").
"""

from __future__ import annotations

from typing import Any

from scale_cl.tuner.arch.gpt_neox import GPT_NEOX
from scale_cl.tuner.arch.llama import LLAMA
from scale_cl.tuner.arch.spec import ArchSpec, LinearSpec, MlpSpec

# transformers class name -> spec
SPECS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "GPTNeoXForCausalLM": GPT_NEOX,
}
# config.model_type -> spec, to check settings against a config before any model is built
SPECS_BY_MODEL_TYPE: dict[str, ArchSpec] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gpt_neox": GPT_NEOX}


EXPORTED = (
    "this {name} was exported by scale-cl: its blocks are merged into stock tensors and it cannot be upscaled or "
    "grown again. Grow the upscaled model it was exported from (scale_cl.load(its saved folder), then upscale), or "
    "train the export with fft, freeze or lora"
)


def is_export(config: Any) -> bool:
    """Whether a transformers config is one of a folder ``scale-cl export`` wrote (``modeling_scale.py``'s classes)."""
    return bool(getattr(config, "scale_hidden_size", 0))  # a field of the exported configs only (the original width)


def refuse_export(config: Any, name: str | None = None) -> None:
    """A ValueError saying what to do where ``config`` is an export's (see `EXPORTED`); upscaling one is refused."""
    if is_export(config):
        raise ValueError(EXPORTED.format(name=name or f"{config.model_type!r} model"))


def spec_for(model: object) -> ArchSpec:
    """The spec of ``model``'s architecture, or a ValueError naming the supported ones."""
    name = type(model).__name__
    if getattr(model, "is_scale_upscaled", False):
        raise ValueError(f"this {name} is already upscaled by scale_cl; use the base model (upscale grows it again)")
    refuse_export(getattr(model, "config", None), name)
    if name not in SPECS:
        raise ValueError(
            f"scale_cl cannot upscale {name}: supported architectures are {', '.join(sorted(SPECS))} "
            "(transformers causal LMs)"
        )
    return SPECS[name]


def spec_for_config(config: Any) -> ArchSpec:
    """The spec of the family a transformers config describes, or a ValueError naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if is_export(config):  # merged into stock-shaped tensors: its family's shapes (`refuse_export` for upscaling)
        stock = [getattr(cls, "model_type", None) for cls in type(config).__mro__[1:]]  # its stock config class's
        model_type = next((name for name in stock if name in SPECS_BY_MODEL_TYPE), model_type)
    if model_type not in SPECS_BY_MODEL_TYPE:
        raise ValueError(
            f"scale_cl cannot upscale a {model_type!r} model: supported model types are "
            f"{', '.join(sorted(SPECS_BY_MODEL_TYPE))}"
        )
    return SPECS_BY_MODEL_TYPE[model_type]


__all__ = [
    "SPECS",
    "SPECS_BY_MODEL_TYPE",
    "ArchSpec",
    "LinearSpec",
    "MlpSpec",
    "is_export",
    "refuse_export",
    "spec_for",
    "spec_for_config",
]
