"""Attention with no backward through the original heads where they are constant (docs/design.md §1.4).

A widened attention layer runs the original heads and the new ones in one call of the model's attention function
(SDPA, flash-attention, eager, ...). Where the original heads' queries, keys and values depend on no trainable
parameter (SCALE-Preserve everywhere; below the first layer whose W12 is used; the preserve half of SCALE-Route's
stacked batch), their attention needs no backward, but one call over all heads takes it for all of them: at
Llama-3.2-1B's shape 32 of SCALE-Preserve's 36 query heads, and the kernel keeps their queries, keys and values for
it. So in training the call is made apart on the constant part (detached: no backward, nothing kept) and on the rest,
and the outputs are joined along the heads. Each head's arithmetic is the call's own either way. The original heads
are the first ``heads`` query heads and ``kv_heads`` key/value heads (`upscale` appends the new ones), and query
head ``i`` reads key/value head ``i // group``, so neither part reads the other's.

How it is reached: transformers' attention modules look their function up by the name their config gives
(``config._attn_implementation``) at every forward. A widened attention module reads the model's config through
`HeadSplitConfig`, which names `split_heads_attention` and passes everything else through to the model's config, live;
masks, generation and the model itself see the model's own implementation, which `split_heads_attention` calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from scale_cl.tuner.hf_compat import ALL_ATTENTION_FUNCTIONS, family_function

SPLIT_HEADS = "scale_split_heads"


@dataclass
class HeadSplit:
    """A widened attention module's original heads, and where they are constant (set by `set_method`)."""

    heads: int  # the original query heads: the first ``heads`` of the call's
    kv_heads: int  # the original key/value heads
    constant: bool = False  # constant on every row of the batch
    constant_half: bool = False  # constant on the first half of the rows: route's preserve path


class HeadSplitConfig:
    """The model's config as a widened attention module reads it: its attention function is `split_heads_attention`;
    every other attribute is the model config's own (read and written through, live)."""

    _attn_implementation = SPLIT_HEADS

    def __init__(self, config: Any) -> None:
        self.__dict__["model_config"] = config

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("model_config")  # absent while copy/pickle rebuild the object
        if config is None:
            raise AttributeError(name)
        return getattr(config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.model_config, name, value)


def install(attention: nn.Module, config: Any, heads: int, kv_heads: int) -> None:
    """Give ``attention`` (a decoder layer's attention module) the split of `split_heads_attention`: its first
    ``heads`` query and ``kv_heads`` key/value heads are the original ones."""
    attention.config = config if isinstance(config, HeadSplitConfig) else HeadSplitConfig(config)
    attention.scale_heads = HeadSplit(heads, kv_heads)


def model_attention(module: nn.Module) -> Callable[..., Any]:
    """The attention function the model's config names, as the module would have called it (its own file's eager
    function for ``eager``)."""
    name = module.config.model_config._attn_implementation
    if name not in (None, "eager", SPLIT_HEADS) and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return family_function(module, "eager_attention_forward")


def _rows(value: Any, rows: slice, batch: int) -> Any:
    """``value``'s rows of the batch when it has a row per sequence (masks, position ids); shared ones as they are."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[rows]
    return value


def _call(
    inner: Callable[..., Any], module: nn.Module, tensors: tuple[torch.Tensor, ...], constant: bool, mask: Any, kwargs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if constant:
        tensors = tuple(t.detach() for t in tensors)
    return inner(module, *tensors, mask, **kwargs)


def _join(parts: list[tuple[torch.Tensor, torch.Tensor | None]], dim: int) -> tuple[torch.Tensor, Any]:
    """Outputs (batch, tokens, heads, size) and weights (batch, heads, tokens, keys) of calls on parts: ``dim`` 0
    joins rows, 1 joins heads."""
    output = torch.cat([out for out, _ in parts], dim=0 if dim == 0 else 2)
    weights = [w for _, w in parts]
    return output, None if any(w is None for w in weights) else torch.cat(weights, dim=dim)


def split_heads_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's attention function, called apart on the original heads where they are constant (module doc)."""
    split = getattr(module, "scale_heads", None)
    if split is None or not torch.is_grad_enabled() or not (split.constant or split.constant_half):
        return model_attention(module)(module, query, key, value, attention_mask, **kwargs)
    heads, kv = split.heads, split.kv_heads
    original = (query[:, :heads], key[:, :kv], value[:, :kv])
    added = (query[:, heads:], key[:, kv:], value[:, kv:])
    return _join(list(attend_apart(module, original, added, attention_mask, kwargs)), dim=1)


def attend_apart(
    module: nn.Module,
    original: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    added: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    attention_mask: Any,
    kwargs: dict[str, Any],
) -> tuple[tuple[torch.Tensor, Any], tuple[torch.Tensor, Any]]:
    """The model's attention function on the original heads' (query, key, value) and on the added heads' apart:
    each call's (output, weights). In training the original heads' inputs are taken as the constants they are
    (`HeadSplit`): detached on every row, or on route's preserve half."""
    inner, split = model_attention(module), module.scale_heads
    grad = torch.is_grad_enabled()
    batch = original[0].shape[0]
    halves = grad and split.constant_half and not split.constant
    if not halves or batch % 2 or any(name.startswith("cu_seq_lens") for name in kwargs):
        # every row alike, or rows that cannot be halved (packed sequences): the original heads in one call
        original_out = _call(inner, module, original, grad and split.constant, attention_mask, kwargs)
    else:  # route's stacked batch: the preserve half constant, the adapt half not
        parts = []
        for rows, constant in ((slice(None, batch // 2), True), (slice(batch // 2, None), False)):
            part = tuple(t[rows] for t in original)
            mask, rest = _rows(attention_mask, rows, batch), {k: _rows(v, rows, batch) for k, v in kwargs.items()}
            parts.append(_call(inner, module, part, constant, mask, rest))
        original_out = _join(parts, dim=0)
    return original_out, inner(module, *added, attention_mask, **kwargs)


AttentionInterface.register(SPLIT_HEADS, split_heads_attention)
