"""The Llama family as transformers implements it: Llama (SmolLM2, Llama-3.2), Mistral, Qwen2."""

from scale_cl.tuner.arch.spec import ArchSpec, LinearSpec, MlpSpec

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
)
