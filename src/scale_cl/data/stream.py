"""A training split packed on the fly from streamed sources, that resumes where it stopped without re-reading.

For ``data.streaming``: each source file is read, tokenised and packed as it trains, shuffled in windows and drawn by
weight as `datasets.interleave_datasets` draws; a bookmark every `STRIDE` blocks lets ``resume(position)`` start at
the checkpoint's block without tokenising what came before (docs/design.md §7, "Corpora through `datasets`").
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from scale_cl.data.packing import BlockCutter, KeyFilter
from scale_cl.data.sources import load_documents
from scale_cl.data.tokens import encode, eos_id

logger = logging.getLogger(__name__)

TOKENIZE_BATCH = 256  # documents per tokenizer call
STRIDE = 64  # blocks between two bookmarks: a resume packs at most this many (and one tokenizer batch) again
HISTORY = 512  # bookmarks kept: they reach back past what the data loader read ahead of the step
WINDOWS = 64  # shuffle windows whose first bookmark is kept
CHOICE_BATCH = 1000  # sources drawn per call, as datasets.interleave_datasets draws them


def _shard_documents(source: str, index: int, count: int, text_field: str, txt_documents: str) -> Any:
    documents = load_documents(source, text_field, txt_documents=txt_documents, streaming=True)
    return documents.shard(num_shards=count, index=index) if count > 1 else documents


def encoded_batch(
    texts: list[str | None], tokenizer: Any, keep: KeyFilter, eos: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(flat tokens, lengths, keys) of the kept documents of one batch of texts, or None when none is kept."""
    encoded = encode(texts, tokenizer, eos)
    lengths = np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)
    mask = (lengths > 0) & keep(encoded["key"])
    if not mask.any():
        return None
    flat = [t for ids, m in zip(encoded["input_ids"], mask, strict=True) if m for t in ids]
    return np.array(flat, dtype=np.int64), lengths[mask], encoded["key"][mask]


def encoded_batches(
    documents: Any, tokenizer: Any, keep: KeyFilter, batch_size: int = TOKENIZE_BATCH
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`encoded_batch` over a stream of ``text`` records (the form `scale_cl.data.packing.token_batches` reads from a
    cache)."""
    eos = eos_id(tokenizer)
    for batch in documents.iter(batch_size=batch_size):
        if (found := encoded_batch(batch["text"], tokenizer, keep, eos)) is not None:
            yield found


def source_shards(source: str, text_field: str, txt_documents: str) -> list[tuple[str, int, int]]:
    """(source, index, count) of each shard of a streamed source: its files (one shard when it mixes formats)."""
    documents = load_documents(source, text_field, txt_documents=txt_documents, streaming=True)
    count = getattr(documents, "n_shards", 1) or 1
    try:
        documents.shard(num_shards=count, index=0)
    except (ValueError, IndexError, NotImplementedError):
        count = 1
    return [(source, index, count) for index in range(count)]


@dataclass(frozen=True)
class Bookmark:
    """Where a tokenizer batch starts in one pass: the file (its place in the pass's order), the documents of it
    read before, the tokens waiting for a block, and the blocks the pass yielded before."""

    shard: int
    documents: int
    carry: tuple[int, ...]
    blocks: int


START = Bookmark(0, 0, (), 0)


def _bookmark(saved: dict[str, Any]) -> Bookmark:
    return Bookmark(**{**saved, "carry": tuple(saved["carry"])})


class _Pass:
    """What one pass over a stream leaves behind to say where its blocks start (bounded: the newest bookmarks)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.bookmarks: deque[Bookmark] = deque(maxlen=HISTORY)
        self.windows: dict[int, Bookmark] = {}  # shuffle window -> a bookmark at or before its first block
        self.ended_at: int | None = None  # blocks yielded, once the pass is over


class BlockStream(IterableDataset):
    """The blocks of streamed shards as ``{"input_ids", "labels"}`` tensors (module doc), at most ``limit`` a pass
    (0 = all)."""

    def __init__(
        self,
        shards: Sequence[tuple[str, int, int]],
        tokenizer: Any,
        seq_len: int,
        *,
        text_field: str = "text",
        txt_documents: str = "auto",
        keep: KeyFilter | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        limit: int = 0,
    ) -> None:
        self.shards, self.tokenizer, self.seq_len = list(shards), tokenizer, seq_len
        self.text_field, self.txt_documents, self.keep = text_field, txt_documents, keep or KeyFilter()
        self.shuffle_buffer, self.seed, self.limit = shuffle_buffer, seed, limit
        self.epoch = 0
        self._pass: _Pass | None = None
        self._resume: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The pass's order (the Trainer calls it before each pass)."""
        self.epoch = epoch

    def _order(self) -> list[int]:
        order = np.arange(len(self.shards))
        if self.shuffle_buffer:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        return [int(i) for i in order]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self._order()
        worker = get_worker_info()
        if worker is not None and worker.num_workers > 1:  # each worker its own files; no position kept
            order, resume, run = order[worker.id :: worker.num_workers], None, None
        else:
            resume, self._resume = self._resume, None
            run = self._pass = _Pass(self.epoch)
        emitted = 0 if resume is None else resume["emitted"]
        start = START if resume is None else _bookmark(resume["bookmark"])
        if run is not None:
            run.bookmarks.append(start)
        blocks = self._read(order, start, run)
        if self.shuffle_buffer:
            window = emitted // self.shuffle_buffer
            if resume is not None:  # the first window is read again whole, from its bookmark
                blocks = islice(blocks, window * self.shuffle_buffer - start.blocks, None)
            blocks = islice(self._windows(blocks, window, run), emitted - window * self.shuffle_buffer, None)
        elif resume is not None:
            blocks = islice(blocks, emitted - start.blocks, None)
        for block in blocks:
            if self.limit and emitted >= self.limit:
                break
            tensor = torch.from_numpy(block)
            yield {"input_ids": tensor, "labels": tensor}
            emitted += 1
        if run is not None:
            run.ended_at = emitted

    def _read(self, order: list[int], start: Bookmark, run: _Pass | None) -> Iterator[np.ndarray]:
        """The pass's blocks in file order from ``start``, leaving a bookmark every `STRIDE` blocks."""
        eos = eos_id(self.tokenizer)
        count, marked = start.blocks, start.blocks  # ``start`` is the pass's first bookmark
        for shard in range(start.shard, len(order)):
            first = shard == start.shard
            read = start.documents if first else 0
            cutter = BlockCutter(self.seq_len, np.array(start.carry, dtype=np.int64) if first else None)
            documents = _shard_documents(*self.shards[order[shard]], self.text_field, self.txt_documents)
            if read:
                documents = documents.skip(read)
            for batch in documents.iter(batch_size=TOKENIZE_BATCH):
                if run is not None and count - marked >= STRIDE:
                    run.bookmarks.append(Bookmark(shard, read, tuple(cutter.carry.tolist()), count))
                    marked = count
                read += len(batch["text"])
                if (found := encoded_batch(batch["text"], self.tokenizer, self.keep, eos)) is None:
                    continue
                for block in cutter.cut(found[0]):
                    yield block
                    count += 1

    def _windows(self, blocks: Iterator[np.ndarray], window: int, run: _Pass | None) -> Iterator[np.ndarray]:
        """``blocks`` from window ``window`` on, each window of `shuffle_buffer` permuted by (seed, epoch, window)."""
        while True:
            if run is not None:  # no block of this window is read yet: the newest bookmark is at or before its first
                run.windows[window] = run.bookmarks[-1]
                run.windows.pop(window - WINDOWS, None)
            held = list(islice(blocks, self.shuffle_buffer))
            for i in np.random.default_rng([self.seed, self.epoch, window]).permutation(len(held)):
                yield held[i]
            if len(held) < self.shuffle_buffer:
                return
            window += 1

    def position(self, consumed: int) -> dict[str, Any] | None:
        """Where block ``consumed`` of the first pass starts, or None when this stream cannot say
        (docs/design.md §7)."""
        run = self._pass
        if run is None or run.epoch != 0 or (run.ended_at is not None and consumed >= run.ended_at):
            return None
        if self.shuffle_buffer:
            bookmark = run.windows.get(consumed // self.shuffle_buffer)
        else:  # any bookmark at or before the block is exact; the newest re-reads least
            bookmark = next((b for b in reversed(run.bookmarks) if b.blocks <= consumed), None)
        if bookmark is None:
            logger.warning("the stream's position at block %d was not kept: a resume reads up to it", consumed)
            return None
        return {"emitted": consumed, "bookmark": {**asdict(bookmark), "carry": list(bookmark.carry)}}

    def resume(self, position: dict[str, Any]) -> None:
        """Start the next pass at ``position`` (what `position` returned)."""
        self._resume = position


class MixedStream(IterableDataset):
    """Several streams, each block's stream drawn with ``probabilities`` from ``seed`` (as
    ``datasets.interleave_datasets`` draws them), until a source's last block; at most ``limit`` blocks a pass."""

    def __init__(self, streams: Sequence[BlockStream], probabilities: Sequence[float], seed: int, limit: int = 0):
        self.streams, self.probabilities, self.seed, self.limit = list(streams), list(probabilities), seed, limit
        self.epoch = 0
        self._resume: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for stream in self.streams:
            stream.set_epoch(epoch)

    def _choices(self) -> Iterator[int]:
        rng = np.random.default_rng(self.seed if self.epoch == 0 else [self.seed, self.epoch])
        while True:
            yield from (int(i) for i in rng.choice(len(self.streams), size=CHOICE_BATCH, p=self.probabilities))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        resume, self._resume = self._resume, None
        emitted = 0
        if resume is not None:
            emitted = resume["emitted"]
            for stream, position in zip(self.streams, resume["sources"], strict=True):
                stream.resume(position)
        readers = [iter(stream) for stream in self.streams]
        ahead: list[Any] = [None] * len(readers)  # each source's next block, read to know when it runs out
        for choice in islice(self._choices(), emitted, None):
            if self.limit and emitted >= self.limit:
                return
            item = ahead[choice] if ahead[choice] is not None else next(readers[choice], None)
            ahead[choice] = None if item is None else next(readers[choice], None)
            if item is not None:
                yield item
                emitted += 1
            if ahead[choice] is None:  # the source ran out with this block: the mix ends there
                return

    def position(self, consumed: int) -> dict[str, Any] | None:
        counts = np.bincount(list(islice(self._choices(), consumed)), minlength=len(self.streams))
        positions = [stream.position(int(count)) for stream, count in zip(self.streams, counts, strict=True)]
        return None if any(p is None for p in positions) else {"emitted": consumed, "sources": positions}

    def resume(self, position: dict[str, Any]) -> None:
        self._resume = position


def stream_blocks(
    sources: list[str],
    tokenizer: Any,
    seq_len: int,
    *,
    text_field: str = "text",
    txt_documents: str = "auto",
    keep: KeyFilter | None = None,
    limit: int = 0,
    shuffle_buffer: int = 0,
    seed: int = 0,
) -> BlockStream:
    """The blocks of ``sources`` read as one stream (module doc), at most ``limit`` (0 = all)."""
    shards = [shard for source in sources for shard in source_shards(source, text_field, txt_documents)]
    return BlockStream(
        shards,
        tokenizer,
        seq_len,
        text_field=text_field,
        txt_documents=txt_documents,
        keep=keep,
        shuffle_buffer=shuffle_buffer,
        seed=seed,
        limit=limit,
    )
