"""The model shapes the benchmark times, built from configs with random weights.

Timing depends on shapes, not on trained values, so random weights (seeded, identical in every
process) stand in for the real checkpoints and nothing is downloaded. Each shape also carries the
SCALE widths the issue's targets name and how many bottom layers Freeze keeps fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)


@dataclass(frozen=True)
class Shape:
    """A base model's shape and the method settings used with it."""

    name: str
    description: str
    make_config: Callable[[], PretrainedConfig]
    model_class: type[PreTrainedModel]
    hidden_up: int  # SCALE width added to the residual stream (a multiple of head_dim x GQA group)
    ffn_up: int  # SCALE width added to every FFN
    freeze_layers: int  # Freeze: bottom decoder layers kept fixed (with the embedding)
    hub_ids: tuple[str, ...] = ()  # the hub models of this shape (a plan uses it where their config cannot be read)

    @property
    def layers(self) -> int:
        return self.make_config().num_hidden_layers

    def with_vocab(self, vocab: int) -> Shape:
        """This shape with another vocabulary (the results record it: `BenchConfig.vocab`)."""
        make = self.make_config

        def config() -> PretrainedConfig:
            made = make()
            made.vocab_size = vocab
            return made

        return replace(self, make_config=config)


def _tiny() -> GPTNeoXConfig:
    return GPTNeoXConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def _smollm2() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        pad_token_id=0,
    )


def _llama_1b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        pad_token_id=0,
    )


SHAPES: dict[str, Shape] = {
    "tiny": Shape(
        "tiny", "GPT-NeoX, 4 layers, hidden 128, 4 heads, FFN 512, vocab 1024", _tiny, GPTNeoXForCausalLM, 32, 128, 1
    ),
    "smollm2": Shape(
        "smollm2",
        "SmolLM2-135M: Llama, 30 layers, hidden 576, 9 / 3 heads, FFN 1536, vocab 49152, tied",
        _smollm2,
        LlamaForCausalLM,
        192,  # SmolLM2's minimal head-aligned width (3 KV heads x 64), as in the cpt preset
        192,
        6,  # as in the cpt smollm2 preset (the paper's 3 of 16, scaled)
        ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ),
    "llama-1b": Shape(
        "llama-1b",
        "Llama-3.2-1B: 16 layers, hidden 2048, 32 / 8 heads, FFN 8192, vocab 128256, tied, rope 500000",
        _llama_1b,
        LlamaForCausalLM,
        256,  # the paper's setting for Llama-3.2-1B (hidden_up 256, ffn_up 1024)
        1024,
        3,
        ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    ),
}


def shape_of_hub_id(name: str) -> Shape | None:
    """The shape of a hub model this module knows (``meta-llama/Llama-3.2-1B``), or None."""
    return next((shape for shape in SHAPES.values() if name in shape.hub_ids), None)


def build_base(shape: Shape, seed: int = 0) -> PreTrainedModel:
    """The base model of ``shape`` with random weights from ``seed`` (float32, CPU, eval mode off)."""
    torch.manual_seed(seed)
    model = shape.model_class(shape.make_config())
    return model


def parameter_count(shape: Shape) -> int:
    """Parameters of the base model, computed on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = shape.model_class(shape.make_config())
    return sum(p.numel() for p in model.parameters())
