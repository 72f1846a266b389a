"""The Llama family as transformers implements it: Llama (SmolLM2, Llama-3.2), Mistral, Qwen2."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scale_cl.tuner.arch.spec import ArchSpec, LinearSpec, MlpSpec
from scale_cl.tuner.streams import StreamsApartLayer, attention_pair


class LlamaLayerApart(StreamsApartLayer):
    """Llama, Mistral and Qwen2's decoder layer (pre-norm, sequential residual), streams apart."""

    attention_name = "self_attn"
    attention_linears = ("q_proj", "k_proj", "v_proj", "o_proj")

    def forward_apart(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        norm = self.input_layernorm
        x, x_up = hidden_states.split((norm.hidden_size, norm.hidden_up), dim=-1)
        normed = norm.project(x, x_up)
        attended = llama_attention_pair(self.self_attn, *normed, position_embeddings, attention_mask, cache, kwargs)
        x, x_up = x + attended[0], x_up + attended[1]  # the residual first, as the stock layer adds it
        mlp = self.mlp.project(*self.post_attention_layernorm.project(x, x_up))
        return torch.cat((x + mlp[0], x_up + mlp[1]), dim=-1)


def llama_attention_pair(
    attention: nn.Module,
    x: torch.Tensor,
    x_up: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any,
    cache: Any,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama-family attention module's forward on the normalised input's two parts: its output's two parts."""
    rows = x.shape[:-1]

    def heads(part: torch.Tensor) -> torch.Tensor:
        return part.view(*rows, -1, attention.head_dim).transpose(1, 2)

    query, query_up = map(heads, attention.q_proj.project(x, x_up))
    key, key_up = map(heads, attention.k_proj.project(x, x_up))
    value, value_up = map(heads, attention.v_proj.project(x, x_up))
    extra = {"dropout": attention.attention_dropout if attention.training else 0.0, "scaling": attention.scaling}
    extra.update(_sliding_window(attention))
    original, added = attention_pair(
        attention,
        (query, key, value),
        (query_up, key_up, value_up),
        position_embeddings,
        attention_mask,
        cache,
        {"kwargs": kwargs},
        {**extra, **kwargs},
    )
    return attention.o_proj.project(original.reshape(*rows, -1), added.reshape(*rows, -1))


def _sliding_window(attention: nn.Module) -> dict[str, Any]:
    """The ``sliding_window`` the stock forward passes its attention function: Qwen2's module's own, Mistral's
    config's; none for Llama, whose config has no such field."""
    if "sliding_window" in vars(attention):
        return {"sliding_window": attention.sliding_window}
    config = getattr(attention.config, "model_config", attention.config)
    return {"sliding_window": config.sliding_window} if hasattr(config, "sliding_window") else {}


LLAMA = ArchSpec(
    family="llama",
    backbone="model",
    final_norm="norm",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    norm_kind="rms",
    linears=(
        LinearSpec("self_attn.q_proj", "attn", "hidden", "q"),
        LinearSpec("self_attn.k_proj", "attn", "hidden", "kv"),
        LinearSpec("self_attn.v_proj", "attn", "hidden", "kv"),
        LinearSpec("self_attn.o_proj", "attn", "q", "hidden"),
        LinearSpec("mlp.gate_proj", "ffn", "hidden", "ffn"),
        LinearSpec("mlp.up_proj", "ffn", "hidden", "ffn"),
        LinearSpec("mlp.down_proj", "ffn", "ffn", "hidden"),
    ),
    mlp=MlpSpec("mlp", gate="gate_proj", up="up_proj", down="down_proj", act="act_fn"),
    attention="self_attn",
    layer_apart=LlamaLayerApart,
)
