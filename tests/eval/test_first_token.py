"""The paper's metric on a hand-built model whose answers are known."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from scale_cl.eval import QAExample, first_token_accuracy

VOCAB = 10
PAD = 0


class NextTokenModel(nn.Module):
    """Predicts ``(last real token + 1) % VOCAB`` at every position; pads predict PAD."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.calls: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask, logits_to_keep=0):
        self.calls.append(attention_mask.clone())
        target = torch.where(attention_mask.bool(), (input_ids + 1) % VOCAB, PAD)
        logits = nn.functional.one_hot(target, VOCAB).float()
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_accuracy_counts_exactly_the_right_answers_per_attribute():
    examples = [
        QAExample((3, 4), 5, "city"),  # right
        QAExample((7,), 8, "city"),  # right
        QAExample((1, 2, 3, 9), 1, "city"),  # wrong: predicts 0
        QAExample((5, 6), 2, "major"),  # wrong: predicts 7
        QAExample((2,), 3, "major"),  # right
    ]
    model = NextTokenModel()
    result = first_token_accuracy(model, examples, pad_token_id=PAD, batch_size=2)
    assert result == pytest.approx({"overall": 3 / 5, "city": 2 / 3, "major": 1 / 2})
    # Prompts of different lengths are left-padded, so the last position is always a real token.
    assert all(bool(mask[:, -1].all()) for mask in model.calls)
    assert len(model.calls) == 3


def test_accuracy_restores_training_mode_and_rejects_no_examples():
    model = NextTokenModel().train()
    first_token_accuracy(model, [QAExample((1,), 2, "a")], pad_token_id=PAD)
    assert model.training
    with pytest.raises(ValueError, match="at least one"):
        first_token_accuracy(model, [], pad_token_id=PAD)
