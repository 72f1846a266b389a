"""An upscaled model's weights merged into the stock shapes of `scale_cl.export.modeling_scale`, and its config.

Every SCALE module becomes the one stock tensor it computes with: a `ScaleLinear` its block matrix
``[[W, W12], [W21, W22]]`` (W12 taken as zero where the method does not use it) and bias ``[b; bias_up]``,
a `SplitNorm` its gains (and biases) concatenated (a grown model's earlier groups first), the embedding
``[E, E_up]`` and the head ``[W_out, alpha W_out_up]`` (``up_logit_scale`` folded in; an extended vocabulary's rows
appended to ``E``/``W_out``). Everything else is taken as it is. The result is checked against the exported class
itself (`exported_model`), so a mismatch fails before anything is written. The config's ``auto_map`` names the base
model (``AutoModel``) beside the causal LM, and ``scale_vllm_servable`` says whether vLLM's Transformers backend can
serve the model (`modeling_scale.mixes_logits`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from scale_cl.export import modeling_scale
from scale_cl.tuner.layers import INNER, ScaleEmbedding, ScaleHead, ScaleLinear, SplitNorm
from scale_cl.tuner.routing import router_named
from scale_cl.tuner.scale_state import scale_state_of
from scale_cl.tuner.vocab import extension_record

# The stock class an upscaled model was made from -> the exported (config, model) classes.
FAMILIES: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "LlamaForCausalLM": (modeling_scale.ScaleLlamaConfig, modeling_scale.ScaleLlamaForCausalLM),
    "MistralForCausalLM": (modeling_scale.ScaleMistralConfig, modeling_scale.ScaleMistralForCausalLM),
    "Qwen2ForCausalLM": (modeling_scale.ScaleQwen2Config, modeling_scale.ScaleQwen2ForCausalLM),
    "GPTNeoXForCausalLM": (modeling_scale.ScaleGPTNeoXConfig, modeling_scale.ScaleGPTNeoXForCausalLM),
}
MODELING_FILE = "modeling_scale.py"
# Config entries of an upscaled model that the exported config does not take over.
_DROPPED = (
    "keys_to_ignore_at_inference",
    "architectures",
    "model_type",
    "transformers_version",
    "auto_map",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "tie_word_embeddings",
)


def _family(model: nn.Module) -> tuple[type[PreTrainedConfig], type[PreTrainedModel]]:
    base = scale_state_of(model).base_class
    if base not in FAMILIES:
        raise ValueError(f"cannot export an upscaled {base}: supported are {', '.join(FAMILIES)}")
    return FAMILIES[base]


def _token_rows(module: ScaleEmbedding | ScaleHead) -> torch.Tensor:
    """``E`` or ``W_out``: the original rows and an extended vocabulary's new ones."""
    new = module.weight_new
    return module.weight if new is None else torch.cat((module.weight, new))


def _merged(module: nn.Module) -> dict[str, torch.Tensor | None] | None:
    """The stock tensors of one SCALE module (None for any other module)."""
    if isinstance(module, ScaleLinear):
        weight, bias = module.merged_weight()
        return {"weight": weight, "bias": bias}
    if isinstance(module, SplitNorm):
        return _norm_gains(module)
    if isinstance(module, ScaleEmbedding):
        return {"weight": torch.cat((_token_rows(module), module.weight_up), dim=1)}
    if isinstance(module, ScaleHead):
        if module.bias is not None:
            raise ValueError("cannot export an LM head with a bias (no supported architecture has one)")
        alpha = module.setting("up_logit_scale", 1.0)  # Z + alpha Z_up = [W_out, alpha W_out_up] [x; x_up]
        weight_up = module.weight_up if alpha == 1 else module.weight_up * alpha
        return {"weight": torch.cat((_token_rows(module), weight_up), dim=1)}
    return None


def _norm_gains(norm: SplitNorm) -> dict[str, torch.Tensor | None]:
    """A `SplitNorm`'s gains (and biases) concatenated, a grown model's earlier groups first."""
    inner = getattr(norm, INNER, None)
    weight, bias = (norm.weight, getattr(norm, "bias", None)) if inner is None else _norm_gains(inner).values()
    if norm.norm_kind != "layer":
        return {"weight": torch.cat((weight, norm.weight_up)), "bias": None}
    return {"weight": torch.cat((weight, norm.weight_up)), "bias": torch.cat((bias, norm.bias_up))}


def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The upscaled ``model``'s weights under the exported model's names and shapes (fresh tensors, CPU)."""
    state = model.state_dict()
    done: list[str] = []  # merged modules: their submodules (a grown model's earlier norms) are merged with them
    with torch.no_grad():
        for name, module in model.named_modules():
            merged = None if any(name.startswith(f"{prefix}.") for prefix in done) else _merged(module)
            if merged is None:
                continue
            done.append(name)
            prefix = f"{name}." if name else ""
            for key in module.state_dict():  # w12, weight_up, ...: the module's own entries, replaced
                del state[prefix + key]
            state.update({prefix + key: value for key, value in merged.items() if value is not None})
        return {k: v.detach().to(device="cpu", dtype=dtype or v.dtype).contiguous() for k, v in state.items()}


def export_config(model: nn.Module) -> PreTrainedConfig:
    """The exported config: the upscaled model's widened one, the original sizes and the method's settings."""
    config_class, model_class = _family(model)
    state = scale_state_of(model)
    cfg, dims = state.config, state.dims  # the sizes the last stage grew
    earlier = [[stage.config.hidden_up, stage.config.up_norm] for stage in state.stages]
    # Eq. 5 from route_tau and route_exact, or the mixture the router declares (`Router.mixture` refuses the rest)
    mixture = router_named(cfg.router).mixture(lambda name: getattr(cfg, name)) if cfg.routed else None
    if cfg.method == "route" and cfg.route_exact and cfg.preserve_layers >= model.config.num_hidden_layers:
        raise ValueError(
            "cannot export SCALE-Route with route_exact and no collaborative layer: every token would route to the "
            "preserve path and get the base model's logits; export the base model, or lower preserve_layers"
        )
    extension = extension_record(model)
    fields = {k: v for k, v in model.config.to_dict().items() if k not in _DROPPED}
    config = config_class.from_dict(
        {
            **fields,
            "tie_word_embeddings": False,  # the head [W_out, W_out_up] is not the embedding [E, E_up]
            "scale_method": cfg.method,
            "scale_hidden_size": dims.hidden,
            "scale_intermediate_size": dims.ffn,
            "scale_num_attention_heads": dims.heads,
            "scale_num_key_value_heads": dims.kv_heads,
            "scale_preserve_layers": cfg.preserve_layers,
            "scale_route_vocab_size": extension["base_rows"] if extension else 0,
            "scale_up_norm": cfg.up_norm,
            "scale_norm_groups": earlier or None,
            "scale_router": cfg.router,
            "scale_route_tau": cfg.route_tau,
            "scale_route_exact": cfg.route_exact,
            "scale_mixture": mixture,
        }
    )
    # vLLM's Transformers backend cannot serve a model that mixes at the logits (modeling_scale's module doc)
    config.scale_vllm_servable = not modeling_scale.mixes_logits(config.scale_method, config.scale_mixture)
    module = MODELING_FILE.removesuffix(".py")
    config.auto_map = {  # the base model (AutoModel, which vLLM's Transformers backend builds) before the causal LM
        "AutoConfig": f"{module}.{config_class.__name__}",
        "AutoModel": f"{module}.{model_class.base_class.__name__}",
        "AutoModelForCausalLM": f"{module}.{model_class.__name__}",
    }
    config.architectures = [model_class.__name__]
    return config


def exported_model(model: nn.Module, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The exported class holding ``model``'s merged weights, to save (`save_pretrained`) and nothing else.

    Built on the meta device and then given the merged tensors, so no weight exists twice; its
    non-persistent buffers (rotary frequencies) stay on the meta device, which saving never reads.
    Raises a ValueError naming the tensors that do not fit.
    """
    config = export_config(model)
    state = merged_state_dict(model, dtype)
    with torch.device("meta"):
        target = _family(model)[1](config)
    try:
        target.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(f"the merged weights do not fit {type(target).__name__}: {err}") from err
    target.generation_config = model.generation_config
    return target.eval()
