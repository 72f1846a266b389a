"""Where text comes from: every source a corpus names, read by the `datasets` library into one ``text`` column.

A source is a file (``.txt``, ``.jsonl(.gz)``, ``.json``, ``.parquet``, ``.arrow``), a glob of them, a
``save_to_disk`` folder, or ``hf:PATH[:CONFIG[:SPLIT]]``. Reading is datasets' own builders; ours is the checking
(`check_source`, `explain_failure`), which names a bad file or line before a model loads (docs/design.md §7).
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

HUB_PREFIX = "hf:"
# the datasets builder of each file type
BUILDERS = {
    ".txt": "text",
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
TXT_DOCUMENTS = ("auto", "file", "paragraph", "line")  # what one document of a .txt file is
_SAMPLE_BY = {"file": "document", "paragraph": "paragraph", "line": "line"}  # the text builder's names
_NAMED = re.compile(r"^([\w.-]+)=(.+)$")  # "name=source" for old-domain evaluation sets
APART_BYTES = 64 * 2**20  # files at least this large are converted in a process of their own (`_apart`)
_UTF8_HINT = "convert it (e.g. `iconv -f latin1 -t utf-8`) or drop the bad bytes (`iconv -c -f utf-8 -t utf-8`)"


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


def file_type(path: Path) -> str:
    """The extension that names ``path``'s builder (``.jsonl.gz`` whole), or the last suffix when none does."""
    name = path.name.lower()
    return next((ext for ext in sorted(BUILDERS, key=len, reverse=True) if name.endswith(ext)), path.suffix.lower())


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


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
                f"{source} is a folder but not one written by save_to_disk: give a glob such as {source}/*.jsonl, "
                f"or {HUB_PREFIX}{source} to read it with datasets.load_dataset"
            )
        paths = [path]
    for path in paths:
        if file_type(path) not in BUILDERS:
            raise ValueError(
                f"{path}: unsupported file type {file_type(path)!r}; use one of {tuple(BUILDERS)}, "
                f"or {HUB_PREFIX}PATH for anything datasets.load_dataset reads"
            )
    return paths


# ---------------------------------------------------------------------------------------------
# Loading


def load_documents(
    source: str,
    text_field: str = "text",
    *,
    txt_documents: str = "auto",
    streaming: bool = False,
    cache_dir: str | None = None,
    num_proc: int | None = None,
) -> Any:
    """The documents of one source as a `datasets` ``Dataset`` (``IterableDataset`` with ``streaming``) with one
    column, ``text``, in the source's order; errors name the source and what to change."""
    import datasets

    if txt_documents not in TXT_DOCUMENTS:
        raise ValueError(f"txt_documents must be one of {TXT_DOCUMENTS}, got {txt_documents!r}")
    if source.startswith(HUB_PREFIX):
        spec = parse_hub_source(source)
        dataset = _load_hub(spec, streaming, cache_dir)
        return _text_column(dataset, text_field, f"{HUB_PREFIX}{spec.path}")
    path = Path(source).expanduser()
    if path.is_dir() and is_saved_dataset(path):
        return _text_column(_load_saved(path, "train", streaming), text_field, source)
    paths = resolve_files(source)
    parts = []
    for builder, group in groupby(paths, key=lambda p: BUILDERS[file_type(p)]):
        files = [str(p) for p in group]
        kwargs: dict[str, Any] = {}
        if builder == "text":
            kwargs["sample_by"] = _SAMPLE_BY[txt_unit(txt_documents, paths)]
        load = functools.partial(
            datasets.load_dataset,
            builder,
            data_files=files,
            split="train",
            streaming=streaming,
            cache_dir=cache_dir,
            num_proc=None if streaming or (num_proc or 1) <= 1 else min(num_proc, len(files)),
            **kwargs,
        )
        if not streaming and sum(os.path.getsize(f) for f in files) >= APART_BYTES:
            _apart(load)  # converted into the cache by a process of its own; read back below
        try:
            dataset = load()
        except Exception as err:  # the builders' errors do not say which line; find it
            raise ValueError(explain_failure(files, text_field) or f"cannot read {files[0]}: {err}") from err
        where = files[0] if len(files) == 1 else f"{source} ({files[0]}, ...)"
        parts.append(_text_column(dataset, text_field, where, builder == "text"))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _apart(load: Callable[[], Any]) -> None:
    """Run ``load`` (a ``load_dataset`` that converts files into the cache) in a forked process and wait for it. The
    conversion holds each chunk of text and arrow's buffers while it works, and the allocators keep some of that after;
    in a process of its own none of it stays in the training process, whose memory then does not grow with the
    corpus. A failure is left to the call in this process, which names it."""
    import multiprocessing

    process = multiprocessing.get_context("fork").Process(target=load)
    process.start()
    process.join()


def txt_unit(txt_documents: str, paths: Sequence[Path]) -> str:
    """What one document of the .txt files of a source is, with ``auto`` resolved (docs/design.md §7)."""
    if txt_documents != "auto":
        return txt_documents
    if len(paths) > 1:
        return "file"
    return "paragraph" if has_blank_line(paths[0]) else "line"


def has_blank_line(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether a text file has an empty line (two line breaks in a row), read until the first one."""
    tail = b""
    with path.open("rb") as file:
        while data := file.read(chunk):
            text = (tail + data).replace(b"\r\n", b"\n")
            if b"\n\n" in text:
                return True
            tail = text[-1:]
    return False


def _load_hub(spec: HubSource, streaming: bool, cache_dir: str | None) -> Any:
    """``load_dataset`` (or ``load_from_disk`` for a ``save_to_disk`` folder); errors name the source."""
    import datasets

    local = Path(spec.path).expanduser()
    if not local.exists() and spec.path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{HUB_PREFIX}{spec.path}: no such folder (relative to {Path.cwd()})")
    if is_saved_dataset(local):
        return _load_saved(local, spec.split, streaming)
    try:
        return datasets.load_dataset(spec.path, spec.config, split=spec.split, streaming=streaming, cache_dir=cache_dir)
    except Exception as err:
        raise ValueError(
            f"cannot load {HUB_PREFIX}{spec.path} (config {spec.config!r}, split {spec.split!r}): {err}"
        ) from err


def _load_saved(path: Path, split: str, streaming: bool) -> Any:
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"cannot load {path}: no split {split!r}; the splits are {sorted(dataset)}")
        dataset = dataset[split]
    return dataset.to_iterable_dataset() if streaming else dataset


def _text_column(dataset: Any, text_field: str, where: str, plain_text: bool = False) -> Any:
    """``dataset`` with only its text field, named ``text``; a clear error if the field is absent or not text."""
    import datasets

    field = "text" if plain_text else text_field  # the text builder names its column "text"
    features = dataset.features
    names = list(features) if features is not None else None
    if names is not None:
        if field not in names:
            raise ValueError(
                f"{where} has no field {field!r}; its fields are {sorted(names)}. Set text_field to the one that "
                "holds the text"
            )
        kind = features[field]
        if not (isinstance(kind, datasets.Value) and kind.dtype in ("string", "large_string")):
            raise ValueError(f"{where}: field {field!r} must hold text, it holds {kind}")
    dataset = dataset.select_columns([field])
    return dataset.rename_column(field, "text") if field != "text" else dataset


# ---------------------------------------------------------------------------------------------
# Checks before anything heavy runs


def check_source(source: str, text_field: str = "text") -> None:
    """Fail fast on a source that cannot be read: it resolves, no file is empty, its first record has the text.

    Reads one record per file (a hub dataset: its first record, streamed), not the corpus.
    """
    if source.startswith(HUB_PREFIX):
        dataset = load_documents(source, text_field, streaming=True)
        next(iter(dataset), None)
        return
    path = Path(source).expanduser()
    if path.is_dir() and is_saved_dataset(path):
        load_documents(source, text_field)
        return
    for file in resolve_files(source):
        _check_file(file, text_field)


def _check_file(path: Path, text_field: str) -> None:
    kind = file_type(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (0 bytes); remove it or fill it")
    if kind == ".parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        _require_field(file.schema_arrow.names, text_field, str(path))
        if file.metadata.num_rows == 0:
            raise ValueError(f"{path} is empty (0 rows); remove it or fill it")
    elif kind == ".arrow":
        import pyarrow as pa

        with pa.memory_map(str(path)) as source:
            _require_field(pa.ipc.open_stream(source).schema.names, text_field, str(path))
    elif BUILDERS[kind] == "json":
        first = next(_json_records(path, text_field), None)
        if first is None:
            raise ValueError(f"{path} is empty (no JSON lines); remove it or fill it")
        if isinstance(first, str):  # a problem with the first line, named
            raise ValueError(first)


def _require_field(names: Sequence[str], text_field: str, where: str) -> None:
    if text_field not in names:
        raise ValueError(
            f"{where} has no field {text_field!r}; its fields are {sorted(names)}. Set text_field to the one that "
            "holds the text"
        )


def _open(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def _json_records(path: Path, text_field: str) -> Iterator[dict | str]:
    """Each non-blank line's object, or a message naming the line's problem (and then nothing more)."""
    with _open(path) as file:
        for number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = raw[err.start : err.start + 4]
                yield f"{where}: not valid UTF-8 (bytes {bad!r} at offset {err.start}); {_UTF8_HINT}"
                return
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield f"{where}: not valid JSON ({err.msg}); fix or remove the line"
                return
            if not isinstance(record, dict):
                yield f"{where}: expected a JSON object with a {text_field!r} field, got {line[:80]!r}"
                return
            if text_field not in record:
                yield f"{where} has no field {text_field!r}; its fields are {sorted(record)}. Set text_field to the one that holds the text"  # noqa: E501
                return
            if record[text_field] is not None and not isinstance(record[text_field], str):
                yield f"{where}: field {text_field!r} must hold text, got {type(record[text_field]).__name__}"
                return
            yield record


def explain_source(source: str, text_field: str) -> str | None:
    """`explain_failure` for a source's files (None for a hub dataset or a saved one)."""
    if source.startswith(HUB_PREFIX) or (Path(source).expanduser().is_dir()):
        return None
    return explain_failure([str(p) for p in resolve_files(source)], text_field)


def explain_failure(files: Sequence[str], text_field: str) -> str | None:
    """What is wrong with the first bad file of a group a datasets builder could not read, naming the line; None
    when nothing is found (the builder's own error is shown then)."""
    for name in files:
        path = Path(name)
        kind = BUILDERS.get(file_type(path))
        if kind == "json":
            problem = next((r for r in _json_records(path, text_field) if isinstance(r, str)), None)
            if problem:
                return problem
        elif kind == "text":
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                line = data[: err.start].count(b"\n") + 1
                bad = data[err.start : err.start + 4]
                return f"{path} line {line}: not valid UTF-8 (bytes {bad!r} at offset {err.start}); {_UTF8_HINT}"
    return None
