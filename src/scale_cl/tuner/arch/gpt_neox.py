"""GPT-NeoX (Pythia): fused per-head q/k/v, LayerNorm with bias, parallel or sequential residual.

The fused ``query_key_value`` output is viewed by transformers as ``(..., heads, 3 * head_size)``,
i.e. rows ``[q_h; k_h; v_h]`` per head, so new heads append ``3 * head_size`` rows each ("qkv").
"""

from scale_cl.tuner.arch.spec import ArchSpec, LinearSpec, MlpSpec

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
)
