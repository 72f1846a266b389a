"""GPT-NeoX (Pythia): fused per-head q/k/v, LayerNorm with bias, parallel or sequential residual.

The fused ``query_key_value`` output is viewed by transformers as ``(..., heads, 3 * head_size)``,
i.e. rows ``[q_h; k_h; v_h]`` per head, so new heads append ``3 * head_size`` rows each ("qkv").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scale_cl.tuner.arch.spec import ArchSpec, LinearSpec, MlpSpec
from scale_cl.tuner.streams import StreamsApartLayer, attention_pair


class NeoXLayerApart(StreamsApartLayer):
    """GPT-NeoX's layer (parallel or sequential residual), streams apart."""

    attention_name = "attention"
    attention_linears = ("query_key_value", "dense")

    def streams_apart_now(self, kwargs: dict[str, Any]) -> bool:
        hidden_dropout = self.post_attention_dropout.p or self.post_mlp_dropout.p
        return not (self.training and hidden_dropout) and super().streams_apart_now(kwargs)

    def forward_apart(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = False,
        layer_past: Any = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        norm = self.input_layernorm
        x, x_up = hidden_states.split((norm.hidden_size, norm.hidden_up), dim=-1)
        normed = norm.project(x, x_up)
        attended = neox_attention_pair(self.attention, *normed, position_embeddings, attention_mask, layer_past, kwargs)
        if self.use_parallel_residual:  # mlp + attention + input, in the stock layer's order
            mlp = self.mlp.project(*self.post_attention_layernorm.project(x, x_up))
            return torch.cat((mlp[0] + attended[0] + x, mlp[1] + attended[1] + x_up), dim=-1)
        x, x_up = attended[0] + x, attended[1] + x_up
        mlp = self.mlp.project(*self.post_attention_layernorm.project(x, x_up))
        return torch.cat((mlp[0] + x, mlp[1] + x_up), dim=-1)


def neox_attention_pair(
    attention: nn.Module,
    x: torch.Tensor,
    x_up: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any,
    cache: Any,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX's attention module's forward on the normalised input's two parts: its output's two parts. Its fused
    rows hold ``[q_h; k_h; v_h]`` per head, so each part's rows are its own heads' queries, keys and values."""
    rows = x.shape[:-1]

    def heads(part: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return part.view(*rows, -1, 3 * attention.head_size).transpose(1, 2).chunk(3, dim=-1)

    fused, fused_up = attention.query_key_value.project(x, x_up)
    extra = {"scaling": attention.scaling, "dropout": attention.attention_dropout if attention.training else 0.0}
    original, added = attention_pair(
        attention, heads(fused), heads(fused_up), position_embeddings, attention_mask, cache, {}, {**extra, **kwargs}
    )
    return attention.dense.project(original.reshape(*rows, -1), added.reshape(*rows, -1))


GPT_NEOX = ArchSpec(
    family="gpt_neox",
    backbone="gpt_neox",
    final_norm="final_layer_norm",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    norm_kind="layer",
    linears=(
        LinearSpec("attention.query_key_value", "attn", "hidden", "qkv"),
        LinearSpec("attention.dense", "attn", "q", "hidden"),
        LinearSpec("mlp.dense_h_to_4h", "ffn", "hidden", "ffn"),
        LinearSpec("mlp.dense_4h_to_h", "ffn", "ffn", "hidden"),
    ),
    mlp=MlpSpec("mlp", gate=None, up="dense_h_to_4h", down="dense_4h_to_h", act="act"),
    attention="attention",
    parallel_residual="use_parallel_residual",
    config_kv_heads=None,
    config_norm_eps="layer_norm_eps",
    layer_apart=NeoXLayerApart,
)
