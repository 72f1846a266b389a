"""Token-level datasets of the biography benchmark: packed biographies and answer-only-loss QA."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

IGNORE = -100


class PackedText(Dataset):
    """Documents joined with EOS and cut into fixed-length blocks (the last partial block is dropped)."""

    def __init__(self, documents: Sequence[list[int]], eos_id: int, block: int) -> None:
        stream = [token for doc in documents for token in (*doc, eos_id)]
        self.blocks = [stream[i : i + block] for i in range(0, len(stream) - block + 1, block)]
        if not self.blocks:
            raise ValueError(f"not enough text for one block of {block} tokens ({len(stream)} tokens)")

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


class AnswerOnlyQA(Dataset):
    """``prompt + answer + EOS`` with the loss on the answer and EOS only (the prompt is masked)."""

    def __init__(self, pairs: Sequence[tuple[list[int], list[int]]], eos_id: int) -> None:
        self.items = [
            {"input_ids": [*prompt, *answer, eos_id], "labels": [IGNORE] * len(prompt) + [*answer, eos_id]}
            for prompt, answer in pairs
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


class PadCollator:
    """Right-pads ``input_ids`` (with ``pad_id``) and ``labels`` (with -100); builds the attention mask."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, item in enumerate(batch):
            n = len(item["input_ids"])
            ids[row, :n] = torch.tensor(item["input_ids"])
            labels[row, :n] = torch.tensor(item["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
