"""The embedding and LM head of a plain (not upscaled) model whose vocabulary was extended.

A PyTorch parameter trains or not as a whole, and AdamW's weight decay moves a parameter whose
gradient is zero, so the original rows and the new rows are two parameters: ``weight`` (the
original ``V`` rows, frozen by the methods that freeze the original) and ``weight_new`` (the ``N``
new rows). In a saved checkpoint (``state_dict``) they are one ``weight`` of ``V + N`` rows, as in
any transformers model of that vocabulary, so ``save_pretrained`` / ``from_pretrained`` need
nothing from this project; `scale_cl.tuner.vocab.split_vocab` makes the two parameters again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scale_cl.tuner.layers import ScaleEmbedding


class _MergedState(nn.Module):
    """Saves ``weight`` and ``weight_new`` as one ``weight`` of all rows, and loads either form."""

    weight: nn.Parameter
    weight_new: nn.Parameter

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        weight = torch.cat((self.weight, self.weight_new))
        destination[prefix + "weight"] = weight if keep_vars else weight.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        merged = state_dict.get(prefix + "weight")
        if merged is not None and prefix + "weight_new" not in state_dict and merged.shape[0] == self.num_rows:
            state_dict = {**state_dict}  # the caller's dict is left as it was
            state_dict[prefix + "weight"], state_dict[prefix + "weight_new"] = merged.split(
                (self.weight.shape[0], self.weight_new.shape[0])
            )
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0] + self.weight_new.shape[0]


class VocabEmbedding(_MergedState):
    """Token -> ``[weight; weight_new][token]``: ids below ``weight``'s rows read the original table."""

    def __init__(self, base: nn.Embedding, weight_new: nn.Parameter) -> None:
        super().__init__()
        self.weight = base.weight
        self.weight_new = weight_new
        self.padding_idx = base.padding_idx
        self.embedding_dim = base.embedding_dim

    @property
    def num_embeddings(self) -> int:
        return self.num_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return ScaleEmbedding.lookup(input_ids, self.weight, self.weight_new, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}+{self.weight_new.shape[0]}, {self.embedding_dim}"


class VocabHead(_MergedState):
    """Logits ``[weight x; weight_new x]``: the original vocabulary's logits are computed as before, the new
    tokens' appended (one copy of the logits more than a plain head, the price of the separate parameters)."""

    def __init__(self, base: nn.Linear, weight_new: nn.Parameter) -> None:
        super().__init__()
        if base.bias is not None:
            raise ValueError("vocabulary extension does not support an LM head with a bias")
        self.weight = base.weight
        self.weight_new = weight_new
        self.in_features = base.in_features
        self.bias = None

    @property
    def out_features(self) -> int:
        return self.num_rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((F.linear(hidden, self.weight), F.linear(hidden, self.weight_new)), dim=-1)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.weight.shape[0]}+{self.weight_new.shape[0]}"
