"""Text corpora for continual pre-training: sources read by `datasets`, tokenised once, held out, packed into blocks.

`CorpusConfig` names new-domain sources, old-domain evaluation sets and replay sources; `build_corpus` reads,
tokenises, holds out, packs and mixes them into the `Corpus` the trainer reads, raising every input error before
training (the steps and why: docs/design.md §7, "Corpora through `datasets`").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from scale_cl.bounds import check_fields
from scale_cl.data.packing import (
    Blocks,
    DocumentMaskCollator,
    KeyFilter,
    PackedDataset,
    first_blocks,
    packed_blocks,
    token_batches,
)
from scale_cl.data.sources import (
    HUB_PREFIX,
    TXT_DOCUMENTS,
    HubSource,
    check_source,
    eval_sets,
    explain_source,
    load_documents,
    parse_hub_source,
)
from scale_cl.data.stream import MixedStream, encoded_batches, stream_blocks
from scale_cl.data.tokens import (
    document_key,
    encode,
    eos_id,
    is_heldout,
    process_place,
    tokenized_documents,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "HUB_PREFIX",
    "Blocks",
    "Corpus",
    "CorpusConfig",
    "CorpusStats",
    "DocumentMaskCollator",
    "HubSource",
    "PackedDataset",
    "build_corpus",
    "check_corpus",
    "document_key",
    "eos_id",
    "eval_sets",
    "is_heldout",
    "is_stream",
    "pack",
    "parse_hub_source",
    "read_documents",
    "split_documents",
]

logger = logging.getLogger(__name__)
CACHE_FOLDER = "scale-cl"  # under the datasets cache, unless cache_dir names another folder


@dataclass
class CorpusConfig:
    """Text for continual pre-training: new-domain sources, old-domain evaluation sets, replay, packing."""

    section: ClassVar[str] = "data."  # where its settings are given (messages name them so)

    train: list[str] = field(
        default_factory=list,
        metadata={
            "help": "new-domain sources: .txt, .jsonl, .jsonl.gz, .parquet or .arrow files, globs of them, folders "
            "written by save_to_disk, or hf:PATH[:CONFIG[:SPLIT]] (datasets.load_dataset)"
        },
    )
    weights: list[float] = field(
        default_factory=list,
        metadata={
            "type": float,
            "gt": 0,
            "le": 1,
            "help": "one weight per train source, summing to 1: blocks are drawn from the sources with these "
            "probabilities (drawn as datasets.interleave_datasets draws, the run's seed); empty = the sources read "
            "as one, in order",
        },
    )
    old_eval: list[str] = field(
        default_factory=list,
        metadata={"help": "old-domain evaluation sets, one source each; NAME=SOURCE gives one a name"},
    )
    text_field: str = field(default="text", metadata={"help": "JSONL field / parquet or dataset column of the text"})
    txt_documents: str = field(
        default="auto",
        metadata={
            "help": "what one document of a .txt file is: file (the whole file), paragraph (text between blank "
            "lines), line, or auto: file when a source names several files; for a single file, paragraph if it has "
            "a blank line, else line",
            "choices": TXT_DOCUMENTS,
        },
    )
    seq_len: int = field(default=512, metadata={"ge": 2, "help": "tokens per packed training sequence"})
    max_train_tokens: int = field(
        default=0, metadata={"ge": 0, "help": "read only this many training tokens (whole sequences); 0 = all"}
    )
    heldout_fraction: float = field(
        default=0.01,
        metadata={"ge": 0, "lt": 1, "help": "fraction of new-domain documents held out (by text hash); 0 = none"},
    )
    max_eval_sequences: int = field(
        default=64, metadata={"ge": 1, "help": "sequences in the held-out set and in each old-domain set, at most"}
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "read, tokenise and pack the training split as it trains (no cache; needs max_steps or a token "
            "budget): for a corpus too large to tokenise ahead, or a hub dataset not to download whole"
        },
    )
    shuffle_buffer: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "with streaming: shuffle the files' order and the blocks in windows of this many blocks "
            "(the run's seed); 0 = corpus order. Without streaming the Trainer shuffles the blocks whole",
        },
    )
    num_proc: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "processes that tokenise (datasets.map num_proc), per training process; 0 = as many CPUs as "
            "the corpus keeps busy (one per 10,000 documents)",
        },
    )
    loader_workers: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "DataLoader worker processes per training process (a stream: each reads its own files); 0 = the "
            "training process reads the blocks itself",
        },
    )
    cache_dir: str = field(
        default="",
        metadata={
            "help": "folder of the datasets cache (sources converted to Arrow, their tokens, packed blocks); "
            "empty = the datasets default (HF_DATASETS_CACHE), in its scale-cl folder for tokens and blocks"
        },
    )
    document_mask: bool = field(
        default=False,
        metadata={
            "help": "attention does not cross a document boundary inside a packed block (position_ids restart "
            "after every EOS; transformers masks by them); off = a block attends across its EOS, as GPT-2 does"
        },
    )
    replay: list[str] = field(
        default_factory=list,
        metadata={
            "help": "old-domain sources to replay during training (NAME=SOURCE or SOURCE); documents any "
            "old-domain evaluation set reads are left out"
        },
    )
    replay_weights: list[float] = field(
        default_factory=list,
        metadata={
            "type": float,
            "gt": 0,
            "le": 1,
            "help": "one weight per replay source, summing to 1 (as weights for train); empty = read in order",
        },
    )
    replay_ratio: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "lt": 1,
            "help": "share of the training sequences (hence tokens) taken from the replay sources: exact in every "
            "batch when ratio x train.batch_size is whole, else exact over the run (0.01 or 0.05 with a batch of 8); "
            "0 = no replay",
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)  # every field's type (train, old_eval, replay lists) and declared range
        if self.txt_documents not in TXT_DOCUMENTS:
            raise ValueError(f"{self.section}txt_documents must be one of {TXT_DOCUMENTS}, got {self.txt_documents!r}")
        if 0 < self.max_train_tokens < self.seq_len:
            raise ValueError(
                f"data.max_train_tokens must be 0 (all) or at least data.seq_len={self.seq_len} (one sequence), "
                f"got {self.max_train_tokens}"
            )
        if not self.text_field:
            raise ValueError("text_field must name the JSONL field / column that holds the text")
        if isinstance(self.replay_ratio, int) and not isinstance(self.replay_ratio, bool):
            self.replay_ratio = float(self.replay_ratio)  # 0 and 0.0 are one setting (cache keys, run folders)
        self.weights = [float(w) for w in self.weights]
        self.replay_weights = [float(w) for w in self.replay_weights]
        check_weights(self.weights, self.train, "weights", "train")
        check_weights(self.replay_weights, self.replay, "replay_weights", "replay")
        if self.replay_ratio > 0 and not self.replay:
            raise ValueError(
                f"replay_ratio={self.replay_ratio} needs old-domain text to replay: set replay to NAME=SOURCE"
            )
        if self.replay and self.streaming and not self.max_train_tokens:
            raise ValueError("replay with streaming needs max_train_tokens: it bounds the replay text read into memory")
        if self.shuffle_buffer and not self.streaming:
            raise ValueError(
                "data.shuffle_buffer shuffles a stream (data.streaming); without streaming the Trainer shuffles every "
                "block already: drop data.shuffle_buffer or set data.streaming"
            )

    @property
    def max_train_sequences(self) -> int:
        """The training cap in whole sequences; 0 = no cap."""
        return self.max_train_tokens // self.seq_len

    def cache(self) -> Path:
        """The folder of the tokens and blocks this corpus caches."""
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        import datasets

        return Path(datasets.config.HF_DATASETS_CACHE) / CACHE_FOLDER


def is_stream(data: Any) -> bool:
    """Whether training data is read as a stream (no length: the Trainer needs max_steps)."""
    return not hasattr(data, "__len__")


def check_weights(weights: Sequence[float], sources: Sequence[str], name: str, of: str) -> None:
    """Weights are one per source, positive and summing to 1 (within rounding)."""
    if not weights:
        return
    if len(weights) != len(sources):
        raise ValueError(
            f"data.{name} gives {len(weights)} weight(s) for {len(sources)} data.{of} source(s): give one per source"
        )
    if any(w <= 0 for w in weights) or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
        raise ValueError(f"data.{name} must be positive and sum to 1, got {list(weights)} (sum {sum(weights):g})")


@dataclass
class CorpusStats:
    """What one split holds, for the run log: documents, tokens, and the blocks taken."""

    documents: int = 0  # documents with text in this split
    skipped_empty: int = 0  # empty or whitespace-only documents of its sources
    tokens: int = 0  # tokens of its documents, one EOS each included
    sequences: int = 0  # packed blocks of seq_len tokens used (a stream: counted as read)
    skipped_evaluated: int = 0  # replay documents left out because an old-domain evaluation set read them
    streamed: bool = False  # read as it trains: documents and tokens are not counted ahead

    def summary(self) -> str:
        if self.streamed:
            return f"streamed: read only as far as needed ({self.sequences:,} sequences taken ahead)"
        evaluated = f", {self.skipped_evaluated:,} evaluated on" if self.skipped_evaluated else ""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens -> {self.sequences:,} sequences "
            f"(skipped: {self.skipped_empty:,} empty{evaluated})"
        )


@dataclass
class Corpus:
    """Everything the trainer reads: training blocks, the held-out split, old-domain sets, and their stats."""

    train: Any  # Blocks (from the cache) or a datasets IterableDataset (streaming) or a mixture of them
    heldout: PackedDataset | None
    old_eval: dict[str, PackedDataset]
    stats: dict[str, CorpusStats]  # "train", "heldout", "old_eval/NAME", "replay"
    replay: Any = None  # old-domain blocks to mix into training (none evaluated on)
    collator: Any = None  # batches the training blocks (document masking); None = the Trainer's default

    def summary(self) -> list[str]:
        return [f"{name}: {stats.summary()}" for name, stats in self.stats.items()]


# ---------------------------------------------------------------------------------------------
# Documents (what the other readers of the text use: vocabulary extension, the clean base)


def read_documents(
    source: str, text_field: str = "text", txt_documents: str = "auto", streaming: bool = False
) -> Iterator[str]:
    """The documents with text of one source, in order (read by `datasets`)."""
    documents = load_documents(source, text_field, txt_documents=txt_documents, streaming=streaming)
    for batch in documents.iter(batch_size=1024):
        yield from (text for text in batch["text"] if text is not None and text.strip())


def split_documents(config: CorpusConfig, split: str) -> Iterator[str]:
    """The new-domain documents of ``split`` ("train" or "heldout"), all train sources in order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    for source in config.train:
        for text in read_documents(source, config.text_field, config.txt_documents, config.streaming):
            if is_heldout(text, config.heldout_fraction) == (split == "heldout"):
                yield text


def pack(documents: Sequence[str], tokenizer: PreTrainedTokenizerBase, seq_len: int, max_sequences: int = 0) -> Any:
    """Documents packed into a ``[n, seq_len]`` LongTensor, the first ``max_sequences`` (0 = all): the blocks every
    path cuts (`scale_cl.data.packing`), for texts in memory."""
    encoded = encode(list(documents), tokenizer, eos_id(tokenizer))
    lengths = np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)
    flat = np.array([t for ids in encoded["input_ids"] for t in ids], dtype=np.int64)
    keys = np.array(encoded["key"], dtype=np.uint64)
    nonempty = lengths > 0
    return first_blocks([(flat, lengths[nonempty], keys[nonempty])], seq_len, max_sequences)[0]


# ---------------------------------------------------------------------------------------------
# Checks before loading a model


def check_corpus(config: CorpusConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Cheap checks to run before loading a model: sources exist and have the text field, the tokenizer has EOS.

    A corpus too small for one sequence is found by `build_corpus`, which reads the data before training starts.
    """
    if not config.train:
        raise ValueError("no new-domain training data: set train to files, globs or hf:PATH[:CONFIG[:SPLIT]]")
    if tokenizer is not None:
        eos_id(tokenizer)
    for source in [*config.train, *eval_sets(config.old_eval).values(), *eval_sets(config.replay).values()]:
        check_source(source, config.text_field)


# ---------------------------------------------------------------------------------------------
# The corpus


class _Reader:
    """One corpus's sources, each tokenised once (cached) and read from there."""

    def __init__(self, config: CorpusConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.cache = config.cache()
        self._tokens: dict[str, Any] = {}

    def documents(self, source: str, streaming: bool = False) -> Any:
        c = self.config
        return load_documents(
            source,
            c.text_field,
            txt_documents=c.txt_documents,
            streaming=streaming,
            cache_dir=c.cache_dir or None,
            num_proc=c.num_proc or None,
        )

    def tokens(self, source: str) -> Any:
        """The source's token cache (`scale_cl.data.tokens`)."""
        if source not in self._tokens:
            self._tokens[source] = tokenized_documents(
                self.documents(source),
                self.tokenizer,
                self.cache,
                self.config.num_proc,
                desc=f"tokenising {source}",
                explain=lambda: explain_source(source, self.config.text_field),
            )
        return self._tokens[source]

    def batches(self, sources: Sequence[str], keep: KeyFilter) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The kept documents' tokens: from the caches, or (streaming) read and tokenised as they come."""
        if not self.config.streaming:
            for source in sources:
                yield from token_batches(self.tokens(source), keep)
            return
        for source in sources:
            yield from encoded_batches(self.documents(source, streaming=True), self.tokenizer, keep)

    def stats(self, sources: Sequence[str], keep: KeyFilter) -> CorpusStats:
        """Documents, empty ones and tokens of the kept side of ``sources`` (from the caches: a few columns)."""
        import pyarrow.compute as pc

        stats = CorpusStats()
        for source in sources:
            tokens = self.tokens(source)
            lengths = pc.list_value_length(tokens.data.column("input_ids")).to_numpy(zero_copy_only=False)
            keys = tokens.data.column("key").to_numpy()
            empty = lengths == 0
            kept = ~empty & keep(keys)
            stats.skipped_empty += int(empty.sum())
            stats.documents += int(kept.sum())
            stats.tokens += int(lengths[kept].sum())
        return stats


def _require_sequences(name: str, stats: CorpusStats, seq_len: int, cause: str = "") -> None:
    """A clear error for a split too small for one sequence, naming why."""
    if stats.sequences:
        return
    if not stats.documents:
        raise ValueError(f"{name} has no documents with text ({stats.skipped_empty} empty skipped){cause}")
    raise ValueError(
        f"{name} has {stats.tokens} tokens ({stats.documents} documents, one EOS each), but one sequence needs "
        f"seq_len={seq_len} tokens; add text or lower seq_len"
    )


def _heldout_cause(config: CorpusConfig, stats: CorpusStats) -> str:
    hint = (
        " (a .txt file is one document unless data.txt_documents is paragraph or line)"
        if any(source.lower().endswith(".txt") for source in config.train)
        else ""
    )
    return (
        f": the held-out split takes each document whose text hash falls below heldout_fraction="
        f"{config.heldout_fraction}, and none of the new-domain documents does{hint}; give more documents, raise "
        "data.heldout_fraction, or set it to 0 to measure no held-out perplexity"
    )


def build_corpus(config: CorpusConfig, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> Corpus:
    """Read, split and pack the corpus (docs/design.md §7); every input error is raised here, before training.

    ``seed`` draws the weighted mixture of sources (``weights``, ``replay_weights``).
    """
    check_corpus(config, tokenizer)
    reader = _Reader(config, tokenizer)
    c = config
    stats: dict[str, CorpusStats] = {}
    heldout = None
    if c.heldout_fraction > 0:
        side = KeyFilter(c.heldout_fraction, "heldout")
        blocks, _ = first_blocks(reader.batches(c.train, side), c.seq_len, c.max_eval_sequences)
        stats["heldout"] = _split_stats(reader, c.train, side, len(blocks))
        name = f"held-out split (heldout_fraction={c.heldout_fraction} of the new-domain documents)"
        _require_sequences(name, stats["heldout"], c.seq_len, _heldout_cause(c, stats["heldout"]))
        heldout = PackedDataset(blocks)

    train_side = KeyFilter(c.heldout_fraction, "train")
    name = "new-domain training data" + (" after the held-out split" if c.heldout_fraction > 0 else "")
    train, stats["train"] = _training_blocks(reader, c.train, c.weights, train_side, c.max_train_sequences, seed)
    _require_sequences(name, stats["train"], c.seq_len)

    old_eval, evaluated = {}, set()
    for set_name, source in eval_sets(c.old_eval).items():
        key = f"old_eval/{set_name}"
        blocks, used = first_blocks(reader.batches([source], KeyFilter()), c.seq_len, c.max_eval_sequences)
        evaluated |= used
        stats[key] = _split_stats(reader, [source], KeyFilter(), len(blocks))
        _require_sequences(f"old-domain evaluation set {set_name!r}", stats[key], c.seq_len)
        old_eval[set_name] = PackedDataset(blocks)

    replay = None
    if c.replay:
        sources = list(eval_sets(c.replay).values())
        keep = KeyFilter(exclude=evaluated)
        wanted = c.max_train_sequences if c.streaming else len(train)
        replay, stats["replay"] = _training_blocks(reader, sources, c.replay_weights, keep, wanted, seed, memory=False)
        stats["replay"].skipped_evaluated = _excluded(reader, sources, evaluated)
        _require_sequences("replay text (after leaving out the evaluated documents)", stats["replay"], c.seq_len)
    collator = DocumentMaskCollator(eos_id(tokenizer)) if c.document_mask else None
    return Corpus(train, heldout, old_eval, stats, replay, collator)


def _split_stats(reader: _Reader, sources: Sequence[str], keep: KeyFilter, sequences: int) -> CorpusStats:
    if reader.config.streaming:  # read only as far as the blocks needed: documents and tokens not counted
        return CorpusStats(sequences=sequences, documents=int(sequences > 0), streamed=True)
    stats = reader.stats(sources, keep)
    stats.sequences = sequences
    return stats


def _excluded(reader: _Reader, sources: Sequence[str], evaluated: set[int]) -> int:
    """Documents of ``sources`` left out because an evaluation set read them (streamed: not counted)."""
    if reader.config.streaming or not evaluated:
        return 0
    found = np.array(sorted(evaluated), dtype=np.uint64)
    return sum(int(np.isin(reader.tokens(s).data.column("key").to_numpy(), found).sum()) for s in sources)


def _training_blocks(
    reader: _Reader,
    sources: Sequence[str],
    weights: Sequence[float],
    keep: KeyFilter,
    limit: int,
    seed: int,
    memory: bool = True,
) -> tuple[Any, CorpusStats]:
    """The blocks of a training split (or replay): one stream of the sources in order, or with ``weights`` each
    source's blocks drawn with those probabilities; from the cache, or streamed (``memory``: a streamed replay split
    is small and bounded, so it is read into memory)."""
    import datasets

    c = reader.config
    groups = [list(sources)] if not weights else [[s] for s in sources]
    if c.streaming:
        if memory:
            streams = [
                stream_blocks(
                    group,
                    reader.tokenizer,
                    c.seq_len,
                    text_field=c.text_field,
                    txt_documents=c.txt_documents,
                    keep=keep,
                    shuffle_buffer=c.shuffle_buffer,
                    seed=seed,
                )
                for group in groups
            ]
            if len(streams) == 1:
                stream = streams[0]
                stream.limit = limit
            else:
                stream = MixedStream(streams, list(weights), seed, limit)
            if next(iter(stream), None) is not None:  # reads the first documents only
                return stream, CorpusStats(sequences=1, documents=1, streamed=True)
            lengths = [length for _, found, _ in reader.batches(sources, keep) for length in found.tolist()]
            return stream, CorpusStats(documents=len(lengths), tokens=sum(lengths))  # not one block: the cause
        blocks, _ = first_blocks(reader.batches(sources, keep), c.seq_len, limit)
        return PackedDataset(blocks), CorpusStats(sequences=len(blocks), documents=int(len(blocks) > 0), streamed=True)
    stats = reader.stats(sources, keep)
    if stats.tokens < c.seq_len:  # not one block: the caller names the cause
        return PackedDataset(torch.empty((0, c.seq_len), dtype=torch.long)), stats
    parts = []
    for group in groups:
        if weights and reader.stats(group, keep).tokens < c.seq_len:
            raise ValueError(f"{group[0]} has fewer tokens than one sequence (seq_len={c.seq_len}): add text to it")
        tokens = [reader.tokens(source) for source in group]
        with _one_process_first():  # one process packs into the cache, the others read it
            parts.append(packed_blocks(tokens, c.seq_len, reader.cache, keep=keep, limit=0 if weights else limit))
    if len(parts) == 1:
        rows = parts[0]
    else:
        rows = datasets.interleave_datasets(parts, probabilities=list(weights), seed=seed)
        rows = rows.select(range(min(limit, len(rows)))) if limit else rows
    stats.sequences = len(rows)
    return Blocks(rows), stats


@contextmanager
def _one_process_first() -> Iterator[None]:
    """Under several processes, the main one first (it writes what the others then read); alone, nothing."""
    if process_place()[1] > 1:
        from accelerate import PartialState

        with PartialState().main_process_first():
            yield
    else:
        yield
