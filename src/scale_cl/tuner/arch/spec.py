"""The data an architecture family gives `upscale`: module paths and how each linear grows."""

from __future__ import annotations

from dataclasses import dataclass

# How a linear's input or output grows, in units resolved by `upscale`:
#   "hidden": the residual width u;  "q": u (u / head_dim new query heads of head_dim each);
#   "kv": u / group (new key/value heads);  "qkv": 3u (fused per-head [q; k; v] rows, GPT-NeoX);
#   "ffn": the FFN width f.
GROWTHS = ("hidden", "q", "kv", "qkv", "ffn")


@dataclass(frozen=True)
class LinearSpec:
    path: str  # relative to a decoder layer, e.g. "self_attn.q_proj"
    module: str  # "attn" or "ffn": the `collab_modules` name it belongs to
    grow_in: str
    grow_out: str


@dataclass(frozen=True)
class MlpSpec:
    """Where a decoder layer keeps its FFN and the names of its parts (`scale_cl.tuner.layers.ScaleMLP`)."""

    path: str  # relative to a decoder layer, e.g. "mlp"
    gate: str | None  # the gate projection of a gated MLP (SwiGLU), None for a plain one
    up: str
    down: str
    act: str  # the activation module's attribute


@dataclass(frozen=True)
class ArchSpec:
    family: str
    backbone: str  # attribute of the causal LM holding the decoder (e.g. "model")
    final_norm: str  # attribute of the backbone
    layer_norms: tuple[str, ...]  # attributes of a decoder layer: the attention's norm, then the FFN's
    norm_kind: str  # "rms" or "layer"
    linears: tuple[LinearSpec, ...]
    mlp: MlpSpec
    attention: (
        str  # the attention module, relative to a decoder layer (its heads are split: `scale_cl.tuner.attention`)
    )
    # the config attribute that says the FFN reads the layer's input beside attention (parallel residual), if any
    parallel_residual: str | None = None
    # config attributes that `upscale` widens: (hidden, ffn, query heads, kv heads or None)
    config_hidden: str = "hidden_size"
    config_ffn: str = "intermediate_size"
    config_heads: str = "num_attention_heads"
    config_kv_heads: str | None = "num_key_value_heads"
    config_norm_eps: str = "rms_norm_eps"
    # the decoder layer's forward with the two streams apart (a `scale_cl.tuner.streams.StreamsApartLayer` in the
    # family's file); None: its widened modules join and split the streams
    layer_apart: type | None = None
