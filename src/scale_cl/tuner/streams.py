"""The decoder layer with the original and the added stream kept apart (docs/design.md §1.4).

The layer splits its input once, hands the pair ``(x, x_up)`` through the norms, the attention and the FFN, adds each
residual per part and joins once at its output; the forward is the stock layer's bitwise. Each family's forward is a
`StreamsApartLayer` in its architecture's file (`scale_cl.tuner.arch.llama`, `scale_cl.tuner.arch.gpt_neox`); the
stock forward runs where the pair cannot serve (`streams_apart_now`).
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
    streams apart where `streams_apart_now` allows (docs/design.md §1.4), else calls the stock forward."""

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


_CLASSES: dict[type, type] = {}


def streams_apart_class(cls: type, layer_apart: type[StreamsApartLayer] | None) -> type:
    """A subclass of the decoder layer's class ``cls`` with the forward of its family's `StreamsApartLayer` (its
    `ArchSpec`'s ``layer_apart``). It keeps the class's name, which accelerate's FSDP wrapping finds the layers by
    (the model's ``_no_split_modules``). A family with no such forward keeps its class (its widened modules join and
    split)."""
    if issubclass(cls, StreamsApartLayer) or layer_apart is None:
        return cls
    if cls not in _CLASSES:
        name = cls.__name__
        _CLASSES[cls] = type(name, (layer_apart, cls), {"__module__": __name__, "__qualname__": name})
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
