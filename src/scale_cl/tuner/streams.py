"""The decoder layer with the original and the added stream kept apart (docs/design.md §1.4).

transformers' decoder layer hands one hidden tensor from module to module, so every widened module joins its
output's two parts, ``[x; x_up]``, and the next splits them again: per layer two norms, the attention's linears
and the FFN each concatenate, the attention joins its original and added heads, and in training the backward of
every split writes a full-width gradient whose constant original part is zeros. Here the layer splits its input
once, hands the pair ``(x, x_up)`` through the norms (`SplitNorm.project`), the attention (each linear's
`ScaleLinear.project`, the rotary embedding and the attention function on the original heads and the added ones
apart, `scale_cl.tuner.attention.attend_apart`) and the FFN (`ScaleMLP.project`), adds each residual per part, and
joins the two once, at the layer's output. A KV cache stores every head as one tensor: the keys and values are
joined for it and split again. One mixin per family: `LlamaLayerApart` (Llama, Mistral, Qwen2) and `NeoXLayerApart`
(GPT-NeoX: fused per-head query-key-value rows, a parallel or sequential residual).

The forward arithmetic is the stock layer's, element for element: the logits are equal bitwise. The backward sums
each part's gradient from its consumers in another order than the stock layer sums its full-width ones, so in fp32
the gradients differ from the stock layer's by rounding, and lie as close to the exact ones (tests/tuner/test_streams.py
derives the bound against float64).

The stock forward runs instead where the pair cannot serve: where a linear takes the merged inference form (one
product over the whole input), while transformers records the attention weights (its hook on the attention
module), where anything else hooks the attention module or its linears (DeepSpeed ZeRO-3 gathers each module's
weights in its hooks), in training with GPT-NeoX's hidden dropout on (one mask over the whole width), or when
``keep_streams_apart`` is False.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from scale_cl.tuner.attention import attend_apart
from scale_cl.tuner.hf_compat import RECORDING_HOOK, family_function, recording_attentions
from scale_cl.tuner.layers import MERGED, ScaleLinear

# transformers before 5.2x passed a decoder layer its cache by this name, and its cache's ``update`` took other
# arguments than `attention_pair` gives: the stock forward runs there
LEGACY_CACHE_ARGUMENT = "past_key_values"


def _hooked(module: nn.Module) -> bool:
    """Whether anything but transformers' idle recording hook runs around ``module``'s forward."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(getattr(hook, "__name__", "") != RECORDING_HOOK for hook in hooks)


class StreamsApartLayer:
    """Mixed into a decoder layer's class by `upscale` (`streams_apart_class`): a family's forward keeps the two
    streams apart where `streams_apart_now` allows (module doc), else calls the stock forward."""

    keep_streams_apart: bool = True
    attention_name: ClassVar[str]  # the layer's attention module
    attention_linears: ClassVar[tuple[str, ...]]  # the attention module's linears

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The family's `forward_apart` (the stock forward's arguments, by name), or the stock forward."""
        if args or not self.streams_apart_now(kwargs):
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]
        return self.forward_apart(hidden_states, **kwargs)

    def forward_apart(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def streams_apart_now(self, kwargs: dict[str, Any]) -> bool:
        """Whether this call keeps the streams apart (module doc: where it cannot, the stock forward runs)."""
        if not self.keep_streams_apart or LEGACY_CACHE_ARGUMENT in kwargs:
            return False
        attention, mlp = getattr(self, self.attention_name), self.mlp
        linears = [getattr(attention, name) for name in self.attention_linears]
        linears += [getattr(mlp, name) for name in mlp.names[:3] if name is not None]
        if any(not isinstance(linear, ScaleLinear) or linear.form() == MERGED for linear in linears):
            return False
        return not (recording_attentions() or _hooked(attention) or any(_hooked(linear) for linear in linears))


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


def attention_pair(
    attention: nn.Module,
    original: tuple[torch.Tensor, ...],
    added: tuple[torch.Tensor, ...],
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any,
    cache: Any,
    update: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention outputs of the original heads' and the added heads' (query, key, value) (batch, heads, tokens,
    size): each rotated by the module's own rotary function, the keys and values through the KV cache (``update``:
    its ``update``'s extra arguments) joined and split again, and each part's heads attending apart."""
    (query, key, value), (query_up, key_up, value_up) = original, added
    rotate = family_function(attention, "apply_rotary_pos_emb")  # the module's own, as its forward's
    cos, sin = position_embeddings
    query, key = rotate(query, key, cos, sin)
    query_up, key_up = rotate(query_up, key_up, cos, sin)
    if cache is not None:
        split = (key.shape[1], key_up.shape[1])
        joined = (torch.cat((key, key_up), 1), torch.cat((value, value_up), 1))
        key, value = cache.update(*joined, attention.layer_idx, **update)
        (key, key_up), (value, value_up) = key.split(split, 1), value.split(split, 1)
    outputs = attend_apart(attention, (query, key, value), (query_up, key_up, value_up), attention_mask, kwargs)
    return outputs[0][0], outputs[1][0]


def _sliding_window(attention: nn.Module) -> dict[str, Any]:
    """The ``sliding_window`` the stock forward passes its attention function: Qwen2's module's own, Mistral's
    config's; none for Llama, whose config has no such field."""
    if "sliding_window" in vars(attention):
        return {"sliding_window": attention.sliding_window}
    config = getattr(attention.config, "model_config", attention.config)
    return {"sliding_window": config.sliding_window} if hasattr(config, "sliding_window") else {}


FAMILIES: dict[str, type[StreamsApartLayer]] = {"llama": LlamaLayerApart, "gpt_neox": NeoXLayerApart}
_CLASSES: dict[type, type] = {}


def streams_apart_class(cls: type, family: str) -> type:
    """A subclass of the decoder layer's class ``cls`` with the forward of its family's (an `ArchSpec`'s ``family``)
    `StreamsApartLayer`. It keeps the class's name, which accelerate's FSDP wrapping finds the layers by (the model's
    ``_no_split_modules``). A family with no such forward keeps its class (its widened modules join and split)."""
    if issubclass(cls, StreamsApartLayer) or family not in FAMILIES:
        return cls
    if cls not in _CLASSES:
        name = cls.__name__
        _CLASSES[cls] = type(name, (FAMILIES[family], cls), {"__module__": __name__, "__qualname__": name})
    return _CLASSES[cls]


def stock_class(cls: type) -> type:
    """The decoder layer's own class under `streams_apart_class`'s."""
    return cls.__bases__[1] if issubclass(cls, StreamsApartLayer) else cls


def __getattr__(name: str) -> type:
    """``scale_cl.tuner.streams.<LayerClass>`` resolves to the class made for it (so pickle finds it)."""
    for made in _CLASSES.values():
        if made.__name__ == name:
            return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
