"""Freeze (Zheng et al. 2025, "spurious forgetting"): freeze the input embedding and the bottom layers."""

from __future__ import annotations

from torch import nn

from scale_cl.tuner.arch import spec_for
from scale_cl.tuner.vocab import new_row_parameters, split_vocab


def prepare_freeze(model: nn.Module, *, layers: int = 3) -> nn.Module:
    """Freeze the input embedding and decoder layers ``0 .. layers - 1``; train everything else.

    Why: Zheng et al. find that forgetting is largely a misalignment of the bottom layers, so keeping
    them (and the embedding) fixed while fully fine-tuning the rest reduces it; the paper uses 3.

    Layers are chosen by their index in the decoder's ``ModuleList`` (the module objects), never by
    matching parameter names, so ``layers=2`` freezes layers 0 and 1 and leaves 10, 11, ... alone.
    A tied LM head *is* the embedding's weight, so with tied embeddings the head is frozen too.
    ``layers=0`` freezes only the embedding; more than the model's number of layers is an error.
    With an extended vocabulary (`scale_cl.tuner.vocab`) only the original rows are the frozen embedding:
    the new tokens' rows (``weight_new``) train.
    """
    if isinstance(layers, bool) or not isinstance(layers, int):
        raise ValueError(f"freeze: layers must be an int (how many bottom decoder layers to freeze), got {layers!r}")
    spec = spec_for(model)
    decoder = getattr(model, spec.backbone).layers
    if not 0 <= layers <= len(decoder):
        raise ValueError(f"freeze: layers={layers} must be between 0 and the model's {len(decoder)} decoder layers")
    split_vocab(model)
    frozen = {id(p) for p in model.get_input_embeddings().parameters()}
    frozen -= {id(p) for p in new_row_parameters(model)}
    for layer in decoder[:layers]:
        frozen.update(id(p) for p in layer.parameters())
    for param in model.parameters():
        param.requires_grad_(id(param) not in frozen)
    return model


def describe_freeze(model: nn.Module, options: dict) -> str:
    """The bench's one-line description of the prepared model."""
    return f"embedding + bottom {options['layers']} layers frozen"
