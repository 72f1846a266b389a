"""Packed blocks: the documents' tokens concatenated in order and cut into blocks of ``seq_len`` tokens.

Each document is its tokens then EOS (`scale_cl.data.tokens`); the documents of a split are concatenated in order
and cut into blocks of ``seq_len`` tokens; the last partial block is dropped. A block may span documents (attention
crosses the EOS, as in GPT-2 / nanoGPT pre-training) unless document masking is on (`DocumentMaskCollator`). Labels
are the input ids; the model shifts them.

A training split is written once into the datasets cache as a ``Dataset`` of fixed-length ``input_ids`` rows
(`packed_blocks`) and read from there by `Blocks`, a row at a time: the blocks are never held whole in memory. An
evaluation set is small (capped) and packed into a tensor (`first_blocks`). A stream is packed on the fly
(`stream_blocks`). All three cut blocks the same way (`BlockCutter`), so a split packs to the same blocks in memory,
from the cache or streamed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from scale_cl.files import atomic_write

PACK_VERSION = 1
WRITE_BYTES = 8 * 2**20  # the blocks written a record batch at a time


class BlockCutter:
    """Concatenates token arrays and cuts full blocks of ``seq_len``; the remainder waits for more tokens."""

    def __init__(self, seq_len: int, carry: np.ndarray | None = None) -> None:
        self.seq_len = seq_len
        self._pending: list[np.ndarray] = [carry] if carry is not None and len(carry) else []
        self._count = sum(len(part) for part in self._pending)

    @property
    def carry(self) -> np.ndarray:
        """The tokens waiting for the next block (fewer than ``seq_len``): with them a new cutter continues this one."""
        return np.concatenate(self._pending) if self._pending else np.empty(0, dtype=np.int64)

    def cut(self, tokens: np.ndarray) -> np.ndarray:
        """Add one run of tokens; return every block now complete as a ``[n, seq_len]`` array (n may be 0)."""
        if len(tokens):
            self._pending.append(tokens)
            self._count += len(tokens)
        if self._count < self.seq_len:
            return np.empty((0, self.seq_len), dtype=tokens.dtype)
        joined = np.concatenate(self._pending)
        full = len(joined) // self.seq_len * self.seq_len
        rest = joined[full:]
        self._pending, self._count = ([rest] if len(rest) else []), len(rest)
        return joined[:full].reshape(-1, self.seq_len)

    def add(self, tokens: np.ndarray) -> Iterator[np.ndarray]:
        """Add one run of tokens; yield every block now complete."""
        yield from self.cut(tokens)


def _record_batches(tokens: Any) -> Iterator[Any]:
    """The token cache's record batches in order, read from its Arrow files with plain reads, not memory-mapped: a
    pass over a large cache keeps one batch resident at a time (a memory map would count every page it touched as the
    process's resident memory). ``tokens`` is a cache as `scale_cl.data.tokens` returns it: whole files, in order."""
    import pyarrow as pa

    files = [entry["filename"] for entry in tokens.cache_files]
    if not files or tokens._indices is not None:
        yield from tokens.data.to_batches()
        return
    rows = 0
    for name in files:
        with pa.OSFile(name) as handle:
            for batch in pa.ipc.open_stream(handle):
                rows += batch.num_rows
                yield batch
    if rows != len(tokens):
        raise ValueError(f"the token cache's files hold {rows} rows, the dataset {len(tokens)}: not its whole files")


def token_batches(
    tokens: Any, keep: Callable[[np.ndarray], np.ndarray] | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(flat tokens, lengths, keys) of the kept documents of a token cache (`scale_cl.data.tokens`), a record batch at
    a time, in order; ``keep(keys) -> bool mask`` picks documents (every document with tokens when None)."""
    import pyarrow.compute as pc

    for batch in _record_batches(tokens):
        ids, keys = batch.column("input_ids"), batch.column("key").to_numpy()
        lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        mask = lengths > 0
        if keep is not None:
            mask &= keep(keys)
        if not mask.any():
            continue
        chosen = ids if mask.all() else pc.filter(ids, mask)
        flat = pc.list_flatten(chosen).to_numpy(zero_copy_only=False).astype(np.int64)
        yield flat, lengths[mask], keys[mask]


def first_blocks(
    batches: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int, limit: int
) -> tuple[torch.Tensor, set[int]]:
    """The first ``limit`` blocks (all with 0) as a ``[n, seq_len]`` LongTensor, and the keys of the documents whose
    tokens are in them (replay leaves those out)."""
    cutter, blocks, used = BlockCutter(seq_len), [], set()
    for flat, lengths, keys in batches:
        offset = 0
        for length, key in zip(lengths.tolist(), keys.tolist(), strict=True):
            if limit and len(blocks) >= limit:
                break
            used.add(key)
            blocks.extend(cutter.add(flat[offset : offset + length]))
            offset += length
        if limit and len(blocks) >= limit:
            break
    blocks = blocks[:limit] if limit else blocks
    if not blocks:
        return torch.empty((0, seq_len), dtype=torch.long), used
    return torch.from_numpy(np.stack(blocks)).long(), used


class KeyFilter:
    """A picklable ``keep(keys)``: documents on one side of the held-out split, without the excluded keys."""

    def __init__(self, fraction: float = 0.0, side: str = "all", exclude: Iterable[int] = ()) -> None:
        from scale_cl.data.tokens import heldout_key

        self.fraction, self.side, self.exclude = fraction, side, np.array(sorted(exclude), dtype=np.uint64)
        self._heldout = heldout_key

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        mask = np.ones(len(keys), dtype=bool)
        if self.side != "all":
            held = self._heldout(keys, self.fraction)
            mask &= held if self.side == "heldout" else ~held
        if len(self.exclude):
            mask &= ~np.isin(keys, self.exclude)
        return mask

    def describe(self) -> str:
        digest = hashlib.sha256(self.exclude.tobytes()).hexdigest()[:12]
        return f"{self.side}:{self.fraction!r}:{digest}"


def packed_blocks(
    tokens: list[Any],
    seq_len: int,
    cache: Path,
    *,
    keep: KeyFilter | None = None,
    limit: int = 0,
    desc: str = "packing",
) -> Any:
    """The blocks of the kept documents of ``tokens`` (token caches, concatenated in order), at most ``limit`` (0 =
    all), as a ``Dataset`` of ``input_ids`` rows written once into the cache (read from there afterwards)."""
    import datasets

    keep = keep or KeyFilter()
    parts = tokens[0] if len(tokens) == 1 else datasets.concatenate_datasets(tokens)
    fingerprint = hashlib.sha256(
        "|".join(
            [*(t._fingerprint for t in tokens), str(seq_len), str(limit), keep.describe(), f"v{PACK_VERSION}"]
        ).encode()
    ).hexdigest()[:20]
    path = Path(cache) / f"blocks-{fingerprint}.arrow"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: write_blocks(tmp, token_batches(parts, keep), seq_len, limit, desc, len(parts)))
    return datasets.Dataset.from_file(str(path))


def write_blocks(
    path: str, batches: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int, limit: int, desc: str,
    documents: int,
) -> int:  # fmt: skip
    """Cut ``batches`` into blocks and write them to ``path`` as the Arrow stream a ``datasets`` file is (fixed-length
    int32 ``input_ids`` rows, about `WRITE_BYTES` a record batch); returns the blocks written. Written with pyarrow
    from the arrays themselves: a writer that goes through Python objects (``Dataset.from_generator``) costs about a
    Python integer a token, far too slow and large for billions of tokens."""
    import datasets
    import pyarrow as pa

    schema = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"), length=seq_len)}).arrow_schema
    rows_per_batch = max(1, WRITE_BYTES // (4 * seq_len))
    cutter, pending, ready, written = BlockCutter(seq_len), [], 0, 0

    def flush(writer: Any, blocks: list[np.ndarray]) -> None:
        values = pa.array(np.concatenate(blocks).astype(np.int32, copy=False).reshape(-1))
        writer.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(values, seq_len)], schema=schema))

    with (
        pa.OSFile(path, "wb") as sink,
        pa.ipc.new_stream(sink, schema) as writer,
        tqdm(total=documents, desc=desc, unit="doc", disable=None, leave=False) as bar,
    ):
        for flat, lengths, _ in batches:
            bar.update(len(lengths))
            blocks = cutter.cut(flat)
            if limit:
                blocks = blocks[: limit - written - ready]
            pending.append(blocks)
            ready += len(blocks)
            while ready >= rows_per_batch:
                joined = np.concatenate(pending)
                flush(writer, [joined[:rows_per_batch]])
                pending, ready, written = [joined[rows_per_batch:]], ready - rows_per_batch, written + rows_per_batch
            if limit and written + ready >= limit:
                break
        if ready:
            flush(writer, pending)
            written += ready
    return written


class Blocks(Dataset):
    """Packed blocks read from the datasets cache a row at a time: ``{"input_ids", "labels"}``, labels = inputs."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows.with_format("numpy")

    def __len__(self) -> int:
        return len(self.rows)

    def _item(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        tensor = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        return {"input_ids": tensor, "labels": tensor}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._item(self.rows[int(index)]["input_ids"])

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """A batch in one read (the DataLoader asks for it so)."""
        return [self._item(ids) for ids in self.rows[list(map(int, indices))]["input_ids"]]

    @property
    def blocks(self) -> torch.Tensor:
        """Every block as one ``[n, seq_len]`` tensor: in memory, for the small sets that need it whole."""
        return torch.from_numpy(np.asarray(self.rows[:]["input_ids"], dtype=np.int64)).reshape(len(self), -1)


class PackedDataset(Dataset):
    """Map-style dataset over packed blocks ``[n, seq_len]`` in memory: ``{"input_ids", "labels"}``, labels = inputs."""

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dtype != torch.long or blocks.dim() != 2:
            raise ValueError(f"blocks must be a [n, seq_len] LongTensor, got {blocks.dtype} {tuple(blocks.shape)}")
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


class DocumentMaskCollator:
    """Stacks packed blocks and adds ``position_ids`` that restart after every EOS: transformers then builds an
    attention mask in which no token attends across a document boundary (its packed-sequence detection, for every
    attention implementation) and rotary positions count from each document's start. It also asks for no KV cache
    (``use_cache=False``): transformers reads packed positions only without one."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        from transformers import default_data_collator

        batch = default_data_collator(features)
        batch["position_ids"] = document_positions(batch["input_ids"], self.eos)
        batch["use_cache"] = False
        return batch


def document_positions(input_ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Each token's position within its document: 0 at a block's start and after every EOS (the EOS ends its own)."""
    batch, length = input_ids.shape
    index = torch.arange(length).expand(batch, length)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index
