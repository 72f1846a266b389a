"""Token-level datasets of the biography benchmark: packed biographies and QA with the loss on its answers (or on
every token)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from scale_cl.data.replay import REPLAY_KEY

IGNORE = -100


class PackedText(Dataset):
    """Documents joined with EOS and cut into fixed-length blocks (the last partial block is dropped).

    ``shuffle_seed=None`` packs the documents once, in the order given. With a seed, it packs them
    as the original biography benchmark does (zzz47zzz/spurious-forgetting): all documents in one
    global random order, drawn afresh for every epoch from ``(shuffle_seed, epoch)`` (the Trainer
    calls `set_epoch`), so a block mixes biographies of different people and no two epochs share a
    packing. The number of blocks is the same in every epoch (it depends only on the token count).
    """

    def __init__(
        self, documents: Sequence[list[int]], eos_id: int, block: int, shuffle_seed: int | None = None
    ) -> None:
        docs = [torch.tensor([*doc, eos_id], dtype=torch.int64) for doc in documents]
        self.lengths = torch.tensor([len(doc) for doc in docs])
        self.stream = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.int64)
        self.starts = torch.cumsum(self.lengths, 0) - self.lengths
        self.block, self.shuffle_seed = block, shuffle_seed
        self.count = len(self.stream) // block
        if not self.count:
            raise ValueError(f"not enough text for one block of {block} tokens ({len(self.stream)} tokens)")
        self.set_epoch(0)

    def document_order(self, epoch: int) -> torch.Tensor:
        """The order in which epoch ``epoch`` packs the documents (indices into the documents given)."""
        if self.shuffle_seed is None:
            return torch.arange(len(self.lengths))
        generator = torch.Generator().manual_seed(self.shuffle_seed * 1_000_003 + epoch)
        return torch.randperm(len(self.lengths), generator=generator)

    def set_epoch(self, epoch: int) -> None:
        """Pack the documents in epoch ``epoch``'s order (nothing changes without a shuffle seed)."""
        if self.shuffle_seed is None and hasattr(self, "blocks"):
            return
        order = self.document_order(epoch)
        stream = torch.cat(
            [self.stream[s : s + n] for s, n in zip(self.starts[order], self.lengths[order], strict=True)]
        )
        self.blocks = stream[: self.count * self.block].view(self.count, self.block)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        block = self.blocks[index].tolist()
        return {"input_ids": block, "labels": block}


QA_LOSSES = ("answer", "all")


class QATraining(Dataset):
    """``prompt + answer + EOS`` with the loss on the answer and EOS only (``loss_on="answer"``: the prompt is
    masked, as the original benchmark trains QA), or on every token (``"all"``: the question text is learnt too,
    the evidence a prefix router reads)."""

    def __init__(self, pairs: Sequence[tuple[list[int], list[int]]], eos_id: int, loss_on: str = "answer") -> None:
        if loss_on not in QA_LOSSES:
            raise ValueError(f"loss_on={loss_on!r}: choose one of {', '.join(QA_LOSSES)}")
        self.items = [
            {
                "input_ids": [*prompt, *answer, eos_id],
                "labels": ([IGNORE] * len(prompt) if loss_on == "answer" else list(prompt)) + [*answer, eos_id],
            }
            for prompt, answer in pairs
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


class PadCollator:
    """Right-pads ``input_ids`` (with ``pad_id``) and ``labels`` (with -100); builds the attention mask; a replay
    mark (`scale_cl.data.replay.REPLAY_KEY`) on the examples is passed on as a tensor."""

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
        batch_out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if REPLAY_KEY in batch[0]:
            batch_out[REPLAY_KEY] = torch.tensor([item[REPLAY_KEY] for item in batch])
        return batch_out
