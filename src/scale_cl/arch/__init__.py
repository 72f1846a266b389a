"""Where each supported architecture keeps its linears, norms, embedding and head.

An `ArchSpec` is data, not code: `scale_cl.upscale` walks a model with it. Adding a family means
adding one file with one `ArchSpec` and one entry in `SPECS`.
"""

from __future__ import annotations

from scale_cl.arch.gpt_neox import GPT_NEOX
from scale_cl.arch.llama import LLAMA
from scale_cl.arch.spec import ArchSpec, LinearSpec, MlpSpec

# transformers class name -> spec
SPECS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "GPTNeoXForCausalLM": GPT_NEOX,
}


def spec_for(model: object) -> ArchSpec:
    """The spec of ``model``'s architecture, or a ValueError naming the supported ones."""
    name = type(model).__name__
    if getattr(model, "is_scale_upscaled", False):
        raise ValueError(f"this {name} is already upscaled by scale_cl; upscale the base model instead")
    if name not in SPECS:
        raise ValueError(
            f"scale_cl cannot upscale {name}: supported architectures are {', '.join(sorted(SPECS))} "
            "(transformers causal LMs)"
        )
    return SPECS[name]


__all__ = ["SPECS", "ArchSpec", "LinearSpec", "MlpSpec", "spec_for"]
