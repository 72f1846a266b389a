"""transformers' private code that scale-cl reads (`scale_cl.tuner.hf_compat`), checked on the installed release: a
release that moves one fails here, naming it, instead of a streams-apart layer silently running the stock forward."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from scale_cl.tuner import hf_compat
from scale_cl.tuner.hf_compat import RECORDING_HOOK, TransformersChanged, family_function, recording_attentions
from scale_cl.tuner.scale_state import decoder_layers
from scale_cl.tuner.streams import LEGACY_CACHE_ARGUMENT, StreamsApartLayer, stock_class
from tests.conftest import ARCHS, make_model, token_batch, upscaled_copy


def _first_layer(arch: str) -> tuple[nn.Module, nn.Module]:
    model = upscaled_copy(make_model(arch), "preserve")
    layer = decoder_layers(model)[0]
    return model, layer


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_familys_file_has_the_functions_its_attention_forward_calls(arch):
    _, layer = _first_layer(arch)
    attention = getattr(layer, type(layer).attention_name)
    for name in ("apply_rotary_pos_emb", "eager_attention_forward"):
        assert callable(family_function(attention, name)), name


def test_a_name_that_moved_raises_naming_it():
    with pytest.raises(TransformersChanged, match=r"no_such_function beside Linear .*install a transformers version"):
        family_function(nn.Linear(1, 1), "no_such_function")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_streams_apart_forward_takes_every_argument_of_the_stock_layers_forward(arch):
    """A renamed argument (the cache's was ``past_key_values``, now ``cache``) would reach ``**kwargs`` unread."""
    _, layer = _first_layer(arch)
    assert isinstance(layer, StreamsApartLayer)
    stock = inspect.signature(stock_class(type(layer)).forward).parameters
    apart = inspect.signature(type(layer).forward_apart).parameters
    named = {name for name, p in stock.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert named <= set(apart), named - set(apart)
    assert LEGACY_CACHE_ARGUMENT not in named  # this transformers hands the layer its cache by the name above


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_transformers_records_attentions_through_the_collector_and_its_named_hook(arch):
    model, layer = _first_layer(arch)
    attention = getattr(layer, type(layer).attention_name)
    seen = []
    handle = attention.register_forward_pre_hook(lambda *_: seen.append(recording_attentions()))
    ids, mask = token_batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    handle.remove()
    assert seen == [False, True]
    hooks = [*attention._forward_hooks.values(), *attention._forward_pre_hooks.values()]
    assert RECORDING_HOOK in {getattr(hook, "__name__", "") for hook in hooks}


def test_the_collector_is_where_transformers_keeps_it():
    assert hf_compat._active_collector().get() is None  # outside any forward pass
