"""Hard first-token accuracy, the paper's metric for the biography benchmark.

A question counts as answered when the argmax of the logits at the last prompt token equals the
first token of the answer (with its leading space). Reported overall and per attribute.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QAExample:
    """A tokenised question: prompt token ids and the answer's first token id."""

    prompt_ids: tuple[int, ...]
    answer_token: int
    attribute: str


@torch.no_grad()
def first_token_accuracy(
    model: nn.Module, examples: Sequence[QAExample], pad_token_id: int, batch_size: int = 256
) -> dict[str, float]:
    """``{"overall": acc, <attribute>: acc, ...}`` over ``examples`` (left-padded batches, eval mode)."""
    if not examples:
        raise ValueError("first_token_accuracy needs at least one example")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits: dict[str, list[bool]] = defaultdict(list)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        width = max(len(e.prompt_ids) for e in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, example in enumerate(chunk):
            ids[row, width - len(example.prompt_ids) :] = torch.tensor(example.prompt_ids)
            mask[row, width - len(example.prompt_ids) :] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=1).logits
        predicted = logits[:, -1].argmax(-1).cpu()
        for example, guess in zip(chunk, predicted.tolist(), strict=True):
            hits[example.attribute].append(guess == example.answer_token)
    model.train(was_training)
    result = {"overall": sum(sum(h) for h in hits.values()) / len(examples)}
    result.update({attribute: sum(h) / len(h) for attribute, h in sorted(hits.items())})
    return result
