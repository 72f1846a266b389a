"""Text corpora for continual pre-training: read documents, hold some out, pack them into token blocks.

Sources (``CorpusConfig.train`` and ``CorpusConfig.old_eval``), one string each:

- a file: ``notes.txt`` (the whole file is one document), ``docs.jsonl`` (one JSON object per line,
  the document in its ``text_field``), ``docs.parquet`` (the document in column ``text_field``);
- a glob of such files, read in sorted order: ``data/*.jsonl``, ``data/**/*.parquet``;
- ``hf:PATH[:CONFIG[:SPLIT]]``: ``datasets.load_dataset(PATH, CONFIG, split=SPLIT)``, split ``train``
  by default. ``hf:wikimedia/wikipedia:20231101.ko:train``, ``hf:user/corpus::validation`` (no
  config), ``hf:./my_folder`` (a local folder of parquet/jsonl/... files that ``load_dataset``
  reads), split slices too: ``hf:user/corpus::train[:1%]``. A folder written by ``save_to_disk``
  is loaded with ``load_from_disk``. ``streaming=True`` streams hub datasets instead of
  downloading them whole. Local files are always read lazily, one record at a time.

Packing: each document is tokenised (no special tokens), followed by EOS, the documents are
concatenated in order and cut into blocks of ``seq_len`` tokens; the last partial block is dropped.
A block may span documents (attention crosses the EOS, as in GPT-2 / nanoGPT pre-training).
Labels are the input ids; the model shifts them.

Held-out split of the new-domain data ("learning perplexity"): a document is held out when a hash of
its text falls below ``heldout_fraction`` (``is_heldout``). The split is made on documents before
packing, so no block mixes held-out and training text; it depends on the text alone (not on file
order, caps or streaming), and copies of a document land on the same side, so duplicates cannot
leak. The held-out and old-domain sets are packed the same way and capped at
``max_eval_sequences`` blocks each.

Caps: ``max_train_tokens`` (rounded down to whole blocks) stops reading as soon as enough blocks are
packed; documents are tokenised in batches that grow from 8 to 1024, so a small cap reads little.

Replay (``replay`` sources, ``replay_ratio``): old-domain text packed the same way, as many blocks as
the training split has (``max_train_tokens`` when streaming), leaving out every document that any
old-domain evaluation set read (by a hash of its text), so replayed text is never evaluated on; the
training loop mixes it in at an exact share of every batch (`scale_cl.data.replay`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from scale_cl.bounds import check_fields

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

HUB_PREFIX = "hf:"
EXTENSIONS = (".txt", ".jsonl", ".parquet")
DECODE_POLICIES = ("error", "skip")
FIRST_BATCH, MAX_BATCH = 8, 1024  # documents per tokenizer call: small first, so a small cap reads little
_NAMED = re.compile(r"^([\w.-]+)=(.+)$")  # "name=source" for old-domain evaluation sets
_DECODE_HINT = "fix the file (e.g. `iconv -f latin1 -t utf-8`) or set on_decode_error='skip' to skip such documents"


@dataclass
class CorpusConfig:
    """Text for continual pre-training: new-domain sources, old-domain evaluation sets, packing."""

    section: ClassVar[str] = "data."  # where its settings are given (messages name them so)

    train: list[str] = field(
        default_factory=list,
        metadata={"help": "new-domain sources: .txt/.jsonl/.parquet files, globs, or hf:PATH[:CONFIG[:SPLIT]]"},
    )
    old_eval: list[str] = field(
        default_factory=list,
        metadata={"help": "old-domain evaluation sets, one source each; NAME=SOURCE gives one a name"},
    )
    text_field: str = field(default="text", metadata={"help": "JSONL field / parquet or dataset column of the text"})
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
        default=False, metadata={"help": "pack training data on the fly (needs max_steps); streams hub datasets"}
    )
    on_decode_error: str = field(
        default="error",
        metadata={"help": f"a document that is not UTF-8 or a JSONL line that is not JSON: one of {DECODE_POLICIES}"},
    )
    replay: list[str] = field(
        default_factory=list,
        metadata={
            "help": "old-domain sources to replay during training (NAME=SOURCE or SOURCE); documents any "
            "old-domain evaluation set reads are left out"
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
        if self.on_decode_error not in DECODE_POLICIES:
            raise ValueError(f"on_decode_error must be one of {DECODE_POLICIES}, got {self.on_decode_error!r}")
        if 0 < self.max_train_tokens < self.seq_len:
            raise ValueError(
                f"data.max_train_tokens must be 0 (all) or at least data.seq_len={self.seq_len} (one sequence), "
                f"got {self.max_train_tokens}"
            )
        if not self.text_field:
            raise ValueError("text_field must name the JSONL field / column that holds the text")
        if isinstance(self.replay_ratio, int) and not isinstance(self.replay_ratio, bool):
            self.replay_ratio = float(self.replay_ratio)  # 0 and 0.0 are one setting (cache keys, run folders)
        if self.replay_ratio > 0 and not self.replay:
            raise ValueError(
                f"replay_ratio={self.replay_ratio} needs old-domain text to replay: set replay to NAME=SOURCE"
            )
        if self.replay and self.streaming and not self.max_train_tokens:
            raise ValueError("replay with streaming needs max_train_tokens: it bounds the replay text read into memory")

    @property
    def max_train_sequences(self) -> int:
        """The training cap in whole sequences; 0 = no cap."""
        return self.max_train_tokens // self.seq_len


@dataclass
class CorpusStats:
    """What the reader saw for one split, for the run log.

    The held-out and training splits are read in separate passes over the same sources, so both
    may count the same skipped documents.
    """

    documents: int = 0  # documents tokenised into this split (the last one may be cut by a cap)
    skipped_decode: int = 0  # not UTF-8 or not JSON, skipped under on_decode_error="skip"
    skipped_empty: int = 0  # empty or whitespace-only documents
    tokens: int = 0  # tokens of the documents tokenised, one EOS each included
    sequences: int = 0  # packed blocks of seq_len tokens
    skipped_evaluated: int = 0  # replay documents left out because an old-domain evaluation set read them

    def summary(self) -> str:
        evaluated = f", {self.skipped_evaluated:,} evaluated on" if self.skipped_evaluated else ""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens -> {self.sequences:,} sequences "
            f"(skipped: {self.skipped_decode:,} undecodable, {self.skipped_empty:,} empty{evaluated})"
        )


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class HubSource:
    """``hf:PATH[:CONFIG[:SPLIT]]``: arguments of ``datasets.load_dataset``."""

    path: str
    config: str | None = None
    split: str = "train"


def parse_hub_source(source: str) -> HubSource:
    """Split ``hf:PATH[:CONFIG[:SPLIT]]``; the split keeps any further colons (``train[:10%]``)."""
    path, config, split = ([*source.removeprefix(HUB_PREFIX).split(":", 2), "", ""])[:3]
    if not path:
        example = "hf:wikimedia/wikipedia:20231101.ko:train"
        raise ValueError(f"{source!r}: expected hf:PATH[:CONFIG[:SPLIT]], like {example}")
    return HubSource(path, config or None, split or "train")


def resolve_files(source: str) -> list[Path]:
    """The files of a path or glob, sorted; every one must have a supported extension."""
    if glob.has_magic(source):
        paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not paths:
            raise FileNotFoundError(f"no file matches {source!r} (relative to {Path.cwd()})")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{source}: no such file (relative to {Path.cwd()})")
        if path.is_dir():
            raise ValueError(
                f"{source} is a folder: give a glob such as {source}/*.jsonl, "
                f"or {HUB_PREFIX}{source} to read it with datasets.load_dataset"
            )
        paths = [path]
    for path in paths:
        if path.suffix.lower() not in EXTENSIONS:
            raise ValueError(
                f"{path}: unsupported file type {path.suffix!r}; use one of {EXTENSIONS}, "
                f"or {HUB_PREFIX}PATH for anything datasets.load_dataset reads"
            )
    return paths


def eval_sets(sources: Sequence[str]) -> dict[str, str]:
    """``{name: source}`` of the old-domain sets (evaluation or replay): ``NAME=SOURCE``, or the source as its name."""
    named: dict[str, str] = {}
    for entry in sources:
        match = _NAMED.match(entry)
        name, source = match.groups() if match else (entry, entry)
        if name in named:
            raise ValueError(f"two old-domain sources are named {name!r}; name them with NAME=SOURCE")
        named[name] = source
    return named


# ---------------------------------------------------------------------------------------------
# Readers: each yields the raw text of every record, "" for a null, None for a skipped undecodable one.


def _decode(data: bytes, where: str, policy: str, count_lines: bool = False) -> str | None:
    """UTF-8 text of ``data``; None under the skip policy, else an error naming the place (and line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if policy == "skip":
            return None
        if count_lines:
            line = data[: err.start].count(b"\n") + 1
            where = f"{where} line {line}"
        bad = data[err.start : err.start + 4]
        raise ValueError(f"{where}: not valid UTF-8 (bytes {bad!r} at offset {err.start}); {_DECODE_HINT}") from None


def _read_txt(path: Path, text_field: str, policy: str) -> Iterator[str | None]:
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path} is empty (0 bytes); remove it or fill it")
    yield _decode(data, str(path), policy, count_lines=True)


def _read_jsonl(path: Path, text_field: str, policy: str) -> Iterator[str | None]:
    records = 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            records += 1
            where = f"{path} line {number}"
            line = _decode(raw, where, policy)
            if line is None:
                yield None
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                if policy == "skip":
                    yield None
                    continue
                raise ValueError(f"{where}: not valid JSON ({err.msg}); {_DECODE_HINT}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object with a {text_field!r} field, got {line[:80]!r}")
            yield _text_of(record, text_field, where)
    if not records:
        raise ValueError(f"{path} is empty (no JSON lines); remove it or fill it")


def _read_parquet(path: Path, text_field: str, policy: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    _require_column(file.schema_arrow.names, text_field, str(path))
    if file.metadata.num_rows == 0:
        raise ValueError(f"{path} is empty (0 rows); remove it or fill it")
    row = 0
    for batch in file.iter_batches(batch_size=MAX_BATCH, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, bytes):  # a binary column: decode it ourselves, with the policy
                value = _decode(value, f"{path} row {row}", policy)
                if value is None:
                    yield None
                    continue
            yield _text_of({text_field: value}, text_field, f"{path} row {row}")


def _load_hub(spec: HubSource, streaming: bool) -> Any:
    """``load_dataset`` (or ``load_from_disk`` for a ``save_to_disk`` folder); errors name the source."""
    import datasets

    local = Path(spec.path).expanduser()
    if not local.exists() and spec.path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{HUB_PREFIX}{spec.path}: no such folder (relative to {Path.cwd()})")
    try:
        if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
            dataset = datasets.load_from_disk(str(local))
            if isinstance(dataset, datasets.DatasetDict):
                if spec.split not in dataset:
                    raise ValueError(f"no split {spec.split!r}; the splits are {sorted(dataset)}")
                dataset = dataset[spec.split]
            return dataset.to_iterable_dataset() if streaming else dataset
        return datasets.load_dataset(spec.path, spec.config, split=spec.split, streaming=streaming)
    except Exception as err:
        raise ValueError(
            f"cannot load {HUB_PREFIX}{spec.path} (config {spec.config!r}, split {spec.split!r}): {err}"
        ) from err


def _read_hub(spec: HubSource, text_field: str, streaming: bool) -> Iterator[str | None]:
    dataset = _load_hub(spec, streaming)
    where = f"{HUB_PREFIX}{spec.path}"
    if dataset.column_names is not None:  # None: a stream whose features are unknown until read
        _require_column(dataset.column_names, text_field, where)
        dataset = dataset.select_columns([text_field])
    row = 0
    for batch in dataset.iter(batch_size=MAX_BATCH):
        _require_column(list(batch), text_field, where)
        for value in batch[text_field]:
            row += 1
            yield _text_of({text_field: value}, text_field, f"{where} row {row}")


def _require_column(names: Sequence[str], text_field: str, where: str) -> None:
    if text_field not in names:
        raise ValueError(
            f"{where} has no field {text_field!r}; its fields are {sorted(names)}. "
            "Set text_field to the one that holds the text"
        )


def _text_of(record: dict, text_field: str, where: str) -> str:
    _require_column(list(record), text_field, where)
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} must hold text, got {type(value).__name__}")
    return value


_READERS: dict[str, Callable[[Path, str, str], Iterator[str | None]]] = {
    ".txt": _read_txt,
    ".jsonl": _read_jsonl,
    ".parquet": _read_parquet,
}


def read_documents(
    source: str,
    text_field: str = "text",
    on_decode_error: str = "error",
    streaming: bool = False,
    stats: CorpusStats | None = None,
) -> Iterator[str]:
    """The documents of one source, in order, read lazily; skipped ones are counted in ``stats``."""
    if on_decode_error not in DECODE_POLICIES:
        raise ValueError(f"on_decode_error must be one of {DECODE_POLICIES}, got {on_decode_error!r}")
    stats = stats if stats is not None else CorpusStats()
    if source.startswith(HUB_PREFIX):
        records = _read_hub(parse_hub_source(source), text_field, streaming)
    else:
        paths = resolve_files(source)
        records = (r for path in paths for r in _READERS[path.suffix.lower()](path, text_field, on_decode_error))
    for text in records:
        if text is None:
            stats.skipped_decode += 1
        elif not text.strip():
            stats.skipped_empty += 1
        else:
            yield text


def document_key(text: str) -> bytes:
    """A hash of a document's text: equal texts, equal keys (the held-out split and replay's exclusions use it)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


def recording(documents: Iterable[str], keys: set[bytes]) -> Iterator[str]:
    """``documents``, adding each one's `document_key` to ``keys`` as it is read."""
    for text in documents:
        keys.add(document_key(text))
        yield text


def is_heldout(text: str, fraction: float) -> bool:
    """Whether a document is in the held-out split: its text's hash, as a number in [0, 1), is below ``fraction``.

    A hash of the text alone: the same split whatever the file order, cap or streaming, and exact
    copies of a document always land on the same side.
    """
    return int.from_bytes(document_key(text), "big") < fraction * 2**64


def split_documents(config: CorpusConfig, split: str, stats: CorpusStats | None = None) -> Iterator[str]:
    """The new-domain documents of ``split`` ("train" or "heldout"), all train sources in order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    for source in config.train:
        for text in read_documents(source, config.text_field, config.on_decode_error, config.streaming, stats):
            if is_heldout(text, config.heldout_fraction) == want_heldout:
                yield text


# ---------------------------------------------------------------------------------------------
# Tokenising and packing


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token, which separates packed documents; set tokenizer.eos_token")
    return tokenizer.eos_token_id


def tokenize_documents(
    documents: Iterable[str], tokenizer: PreTrainedTokenizerBase, stats: CorpusStats | None = None
) -> Iterator[list[int]]:
    """Each document's token ids followed by EOS; batched for speed, in growing batches so a cap reads little."""
    eos = eos_id(tokenizer)
    stats = stats if stats is not None else CorpusStats()
    documents, size = iter(documents), FIRST_BATCH
    while batch := list(islice(documents, size)):
        for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            stats.documents += 1
            stats.tokens += len(ids) + 1
            yield [*ids, eos]
        size = min(2 * size, MAX_BATCH)


def pack_blocks(token_documents: Iterable[list[int]], seq_len: int) -> Iterator[list[int]]:
    """Concatenate the documents' tokens and cut them into blocks of ``seq_len``; the remainder is dropped."""
    buffer: list[int] = []
    for ids in token_documents:
        buffer.extend(ids)
        full = len(buffer) // seq_len * seq_len
        for start in range(0, full, seq_len):
            yield buffer[start : start + seq_len]
        del buffer[:full]


def pack(
    documents: Iterable[str],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    max_sequences: int = 0,
    stats: CorpusStats | None = None,
    desc: str = "packing",
) -> torch.Tensor:
    """The documents packed into a ``[n, seq_len]`` LongTensor; stops reading at ``max_sequences`` (0 = all)."""
    stats = stats if stats is not None else CorpusStats()
    blocks = pack_blocks(tokenize_documents(documents, tokenizer, stats), seq_len)
    if max_sequences:
        blocks = islice(blocks, max_sequences)
    progress = tqdm(blocks, total=max_sequences or None, desc=desc, unit="seq", disable=None, leave=False)
    rows = [torch.tensor(block, dtype=torch.long) for block in progress]
    stats.sequences = len(rows)
    return torch.stack(rows) if rows else torch.empty((0, seq_len), dtype=torch.long)


def _require_sequences(name: str, stats: CorpusStats, seq_len: int) -> None:
    """A clear error for a split too small for one sequence."""
    if stats.sequences:
        return
    if not stats.documents:
        raise ValueError(
            f"{name} has no documents with text ({stats.skipped_empty} empty, "
            f"{stats.skipped_decode} undecodable skipped)"
        )
    raise ValueError(
        f"{name} has {stats.tokens} tokens ({stats.documents} documents, one EOS each), but one sequence needs "
        f"seq_len={seq_len} tokens; add text or lower seq_len"
    )


# ---------------------------------------------------------------------------------------------
# Datasets for the HF Trainer


class PackedDataset(Dataset):
    """Map-style dataset over packed blocks ``[n, seq_len]``: ``{"input_ids", "labels"}``, labels = inputs."""

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dtype != torch.long or blocks.dim() != 2:
            raise ValueError(f"blocks must be a [n, seq_len] LongTensor, got {blocks.dtype} {tuple(blocks.shape)}")
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


class PackedStream(IterableDataset):
    """Blocks packed on the fly from re-readable documents, for corpora larger than memory.

    It has no length, so the HF Trainer needs ``max_steps``. Corpus order is kept (no shuffling).
    Each ``__iter__`` reads from the start, and resets ``stats``. With several DataLoader workers
    every worker reads the stream and keeps every ``num_workers``-th block, so none is duplicated.
    """

    def __init__(
        self,
        documents: Callable[[CorpusStats], Iterable[str]],
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        max_sequences: int = 0,
    ) -> None:
        self.documents, self.tokenizer, self.seq_len, self.max_sequences = documents, tokenizer, seq_len, max_sequences
        self.stats = CorpusStats()

    def blocks(self) -> Iterator[list[int]]:
        vars(self.stats).update(vars(CorpusStats()))  # in place: callers may hold this object
        blocks = pack_blocks(tokenize_documents(self.documents(self.stats), self.tokenizer, self.stats), self.seq_len)
        return islice(blocks, self.max_sequences) if self.max_sequences else blocks

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = get_worker_info()
        for index, block in enumerate(self.blocks()):
            self.stats.sequences = index + 1
            if worker is None or index % worker.num_workers == worker.id:
                ids = torch.tensor(block, dtype=torch.long)
                yield {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------------------------------------
# Up-front checks and the whole corpus


def check_source(source: str, text_field: str = "text", on_decode_error: str = "error") -> None:
    """Fail fast on a source that cannot be read: it resolves, no file is empty, its first record has the text.

    Reads one record per file (and loads a hub dataset as a stream), not the whole corpus.
    """
    if source.startswith(HUB_PREFIX):
        next(_read_hub(parse_hub_source(source), text_field, streaming=True), None)
        return
    for path in resolve_files(source):
        next(_READERS[path.suffix.lower()](path, text_field, on_decode_error), None)


def check_corpus(config: CorpusConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Cheap checks to run before loading a model: sources exist and have the text field, the tokenizer has EOS.

    Decoding errors and a corpus too small for one sequence are found by ``build_corpus``, which
    reads the data before training starts (only the first block when streaming).
    """
    if not config.train:
        raise ValueError("no new-domain training data: set train to files, globs or hf:PATH[:CONFIG[:SPLIT]]")
    if tokenizer is not None:
        eos_id(tokenizer)
    for source in [*config.train, *eval_sets(config.old_eval).values(), *eval_sets(config.replay).values()]:
        check_source(source, config.text_field, config.on_decode_error)


@dataclass
class Corpus:
    """Everything the trainer reads: training blocks, the held-out split, old-domain sets, and their stats."""

    train: PackedDataset | PackedStream
    heldout: PackedDataset | None
    old_eval: dict[str, PackedDataset]
    stats: dict[str, CorpusStats]  # "train", "heldout", "old_eval/NAME", "replay"; streaming train fills as read
    replay: PackedDataset | None = None  # old-domain blocks to mix into training (none evaluated on)

    def summary(self) -> list[str]:
        return [f"{name}: {stats.summary()}" for name, stats in self.stats.items()]


def build_corpus(config: CorpusConfig, tokenizer: PreTrainedTokenizerBase) -> Corpus:
    """Read, split and pack the corpus; every input error is raised here, before training.

    In memory the training split is packed whole (up to ``max_train_tokens``); with ``streaming``
    it is packed on the fly and only its first block is read here, to check it has one.
    """
    check_corpus(config, tokenizer)
    stats: dict[str, CorpusStats] = {}
    heldout = None
    if config.heldout_fraction > 0:
        stats["heldout"] = CorpusStats()
        blocks = pack(
            split_documents(config, "heldout", stats["heldout"]),
            tokenizer,
            config.seq_len,
            config.max_eval_sequences,
            stats["heldout"],
            desc="held-out",
        )
        name = f"held-out split (heldout_fraction={config.heldout_fraction} of the new-domain documents)"
        _require_sequences(name, stats["heldout"], config.seq_len)
        heldout = PackedDataset(blocks)

    name = "new-domain training data" + (" after the held-out split" if config.heldout_fraction > 0 else "")
    if config.streaming:
        train: PackedDataset | PackedStream = PackedStream(
            lambda s: split_documents(config, "train", s), tokenizer, config.seq_len, config.max_train_sequences
        )
        probe = PackedStream(lambda s: split_documents(config, "train", s), tokenizer, config.seq_len, 1)
        if not any(True for _ in probe):
            _require_sequences(name, probe.stats, config.seq_len)
        stats["train"] = train.stats
    else:
        stats["train"] = CorpusStats()
        blocks = pack(
            split_documents(config, "train", stats["train"]),
            tokenizer,
            config.seq_len,
            config.max_train_sequences,
            stats["train"],
            desc="training data",
        )
        _require_sequences(name, stats["train"], config.seq_len)
        train = PackedDataset(blocks)

    old_eval, evaluated = {}, set()
    for set_name, source in eval_sets(config.old_eval).items():
        key = f"old_eval/{set_name}"
        stats[key] = CorpusStats()
        documents = read_documents(source, config.text_field, config.on_decode_error, config.streaming, stats[key])
        blocks = pack(
            recording(documents, evaluated), tokenizer, config.seq_len, config.max_eval_sequences, stats[key], set_name
        )
        _require_sequences(f"old-domain evaluation set {set_name!r}", stats[key], config.seq_len)
        old_eval[set_name] = PackedDataset(blocks)

    replay = None
    if config.replay:
        stats["replay"] = CorpusStats()
        wanted = config.max_train_sequences if config.streaming else len(train)
        replay = PackedDataset(
            pack(
                replay_documents(config, evaluated, stats["replay"]),
                tokenizer,
                config.seq_len,
                wanted,
                stats["replay"],
                "replay",
            )
        )
        _require_sequences("replay text (after leaving out the evaluated documents)", stats["replay"], config.seq_len)

    for split, split_stats in stats.items():
        if split_stats.skipped_decode:
            logger.warning("%s: skipped %d undecodable documents", split, split_stats.skipped_decode)
    return Corpus(train, heldout, old_eval, stats, replay)


def replay_documents(config: CorpusConfig, evaluated: set[bytes], stats: CorpusStats) -> Iterator[str]:
    """The replay sources' documents in order, without those an old-domain evaluation set read (``evaluated``)."""
    for source in eval_sets(config.replay).values():
        for text in read_documents(source, config.text_field, config.on_decode_error, config.streaming, stats):
            if document_key(text) in evaluated:
                stats.skipped_evaluated += 1
            else:
                yield text
