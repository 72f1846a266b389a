"""A training split packed on the fly from streamed sources: a `datasets` ``IterableDataset`` of blocks.

For a corpus read as it trains (``data.streaming``): no cache is built, each source's records are read as they are
consumed, tokenised in batches and cut into blocks (`scale_cl.data.packing.BlockCutter`). The stream's shards are the
sources' files (every file of every source, in order), so:

* on several processes accelerate gives each rank its own files when there are at least as many as ranks (else every
  rank reads the stream and keeps its share of the batches);
* with ``dataloader_num_workers`` each worker reads its own files;
* ``shuffle_buffer`` > 0 shuffles the order of the files and then the blocks through a buffer of that many, from the
  run's seed and the epoch (the Trainer sets it), the same on every run: a resumed run skips to the very blocks it
  stopped at by reading the stream up to there.

Each file (shard) is packed apart, its last partial block dropped: the blocks are the same whatever the number of
processes and workers that read them (only their order changes), and for a source of one file they are the blocks
the cached path packs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from scale_cl.data.packing import BlockCutter, KeyFilter
from scale_cl.data.sources import load_documents
from scale_cl.data.tokens import encode, eos_id

TOKENIZE_BATCH = 256  # documents per tokenizer call


def _shard_documents(source: str, index: int, count: int, text_field: str, txt_documents: str) -> Any:
    documents = load_documents(source, text_field, txt_documents=txt_documents, streaming=True)
    return documents.shard(num_shards=count, index=index) if count > 1 else documents


def encoded_batches(
    documents: Any, tokenizer: Any, keep: KeyFilter, batch_size: int = TOKENIZE_BATCH
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(flat tokens, lengths, keys) of the kept documents of a stream of ``text`` records, tokenised a batch at a time
    (the form `scale_cl.data.packing.token_batches` reads from a cache)."""
    eos = eos_id(tokenizer)
    for batch in documents.iter(batch_size=batch_size):
        encoded = encode(batch["text"], tokenizer, eos)
        lengths = np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)
        mask = (lengths > 0) & keep(encoded["key"])
        if mask.any():
            flat = [t for ids, m in zip(encoded["input_ids"], mask, strict=True) if m for t in ids]
            yield np.array(flat, dtype=np.int64), lengths[mask], encoded["key"][mask]


def _generate(
    shards: list[tuple[str, int, int]],
    text_field: str,
    txt_documents: str,
    tokenizer: Any,
    seq_len: int,
    keep: KeyFilter,
) -> Iterator[dict[str, np.ndarray]]:
    """The blocks of ``shards`` (source, shard index, shards of the source), each shard packed apart."""
    for source, index, count in shards:
        cutter = BlockCutter(seq_len)
        for flat, _, _ in encoded_batches(
            _shard_documents(source, index, count, text_field, txt_documents), tokenizer, keep
        ):
            for block in cutter.add(flat):
                yield {"input_ids": block, "labels": block}


def source_shards(source: str, text_field: str, txt_documents: str) -> list[tuple[str, int, int]]:
    """(source, index, count) of each shard of a streamed source: its files (one shard when it mixes formats)."""
    documents = load_documents(source, text_field, txt_documents=txt_documents, streaming=True)
    count = getattr(documents, "n_shards", 1) or 1
    try:
        documents.shard(num_shards=count, index=0)
    except (ValueError, IndexError, NotImplementedError):
        count = 1
    return [(source, index, count) for index in range(count)]


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
) -> Any:
    """The blocks of ``sources`` read as a stream (module doc): ``{"input_ids", "labels"}`` tensors, at most ``limit``
    (0 = all)."""
    import datasets

    shards = [shard for source in sources for shard in source_shards(source, text_field, txt_documents)]
    stream = datasets.IterableDataset.from_generator(
        _generate,
        gen_kwargs={
            "shards": shards,
            "text_field": text_field,
            "txt_documents": txt_documents,
            "tokenizer": tokenizer,
            "seq_len": seq_len,
            "keep": keep or KeyFilter(),
        },
    )
    if shuffle_buffer:
        stream = stream.shuffle(seed=seed, buffer_size=shuffle_buffer)
    if limit:
        stream = stream.take(limit)
    return stream.with_format("torch")
