"""Each document's tokens, computed once with ``datasets.map`` and kept in the datasets cache.

`tokenized_documents` turns a source's ``text`` column into two: ``input_ids`` (the document's token ids, no special
tokens, then EOS; empty for an empty or whitespace-only document) and ``key`` (a 64-bit hash of the text, which the
held-out split and replay's exclusions read). The result is stored in Arrow files under the cache folder, named by a
fingerprint of the source's own fingerprint and the tokenizer, so a second launch, a resume or another run over the
same text memory-maps them and tokenises nothing.

On several processes (``torchrun``, ``accelerate launch``) each rank tokenises its own contiguous shard of the
documents (``num_proc`` workers each), then every rank reads all the shards in order: no rank tokenises the whole
corpus, and the result is the one process's, row for row. A manifest written last marks the cache complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scale_cl.files import write_json

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VERSION = 1  # of the cached columns' meaning; a change makes new caches
MANIFEST = "shards.json"


def document_key(text: str) -> int:
    """A hash of a document's text as a 64-bit number: equal texts, equal keys."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def is_heldout(text: str, fraction: float) -> bool:
    """Whether a document is in the held-out split: its key, as a number in [0, 1), is below ``fraction``.

    A hash of the text alone: the same split whatever the file order, cap or streaming, and exact copies of a document
    always land on the same side.
    """
    return heldout_key(document_key(text), fraction)


def heldout_key(key: int | np.ndarray, fraction: float) -> Any:
    """`is_heldout` of documents by their keys (a number or an array of them)."""
    return (
        key < np.uint64(min(int(fraction * 2**64), 2**64 - 1))
        if isinstance(key, np.ndarray)
        else key < fraction * 2**64
    )


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token, which separates packed documents; set tokenizer.eos_token")
    return tokenizer.eos_token_id


def encode(texts: list[str | None], tokenizer: PreTrainedTokenizerBase, eos: int) -> dict[str, Any]:
    """``input_ids`` (tokens then EOS; empty for a document with no text) and ``key`` of a batch of documents."""
    kept = [i for i, text in enumerate(texts) if text is not None and text.strip()]
    encoded = tokenizer([texts[i] for i in kept], add_special_tokens=False, verbose=False)["input_ids"] if kept else []
    ids: list[list[int]] = [[] for _ in texts]
    keys = [0] * len(texts)
    for i, tokens in zip(kept, encoded, strict=True):
        ids[i] = [*tokens, eos]
        keys[i] = document_key(texts[i])
    return {"input_ids": ids, "key": np.array(keys, dtype=np.uint64)}


def _encode_batch(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, eos: int) -> dict[str, Any]:
    return encode(batch["text"], tokenizer, eos)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what the tokenizer does: its full definition (fast tokenizers) and its EOS."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # a slow tokenizer: its vocabulary and class
        definition = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    return hashlib.sha256(f"{definition}|eos={tokenizer.eos_token_id}".encode()).hexdigest()[:16]


def features() -> Any:
    import datasets

    return datasets.Features({"input_ids": datasets.List(datasets.Value("int32")), "key": datasets.Value("uint64")})


def process_place() -> tuple[int, int]:
    """(rank, world size) of this process in a ``torchrun`` / ``accelerate launch`` run; (0, 1) alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    from accelerate import PartialState

    state = PartialState(cpu=not __import__("torch").cuda.is_available())
    return state.process_index, state.num_processes


def _wait_for_everyone() -> None:
    if process_place()[1] > 1:
        from accelerate import PartialState

        PartialState().wait_for_everyone()


def auto_num_proc(rows: int, num_proc: int) -> int:
    """``num_proc`` workers, or with 0 as many as the CPUs the rows can keep busy (10,000 documents each)."""
    if num_proc > 0:
        return num_proc
    return max(1, min(len(os.sched_getaffinity(0)), rows // 10_000))


def tokenized_documents(
    documents: Any,
    tokenizer: PreTrainedTokenizerBase,
    cache: Path,
    num_proc: int = 0,
    desc: str = "tokenising",
    explain: Callable[[], str | None] | None = None,
) -> Any:
    """``documents`` (a ``Dataset`` with a ``text`` column) tokenised into the cache, or read from it (module doc).

    ``explain()``: what is wrong with the source when tokenising fails (text that is not UTF-8 passes some builders
    and fails here), named in the error instead of the codec's message.
    """
    import datasets

    eos = eos_id(tokenizer)
    key = hashlib.sha256(f"{documents._fingerprint}|{tokenizer_fingerprint(tokenizer)}|v{VERSION}".encode())
    folder = Path(cache) / f"tokens-{key.hexdigest()[:20]}"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        rank, world = process_place()
        folder.mkdir(parents=True, exist_ok=True)
        shard = documents.shard(world, rank, contiguous=True) if world > 1 else documents
        workers = auto_num_proc(len(shard), num_proc)
        try:
            done = shard.map(
                _encode_batch,
                batched=True,
                remove_columns=shard.column_names,
                features=features(),
                fn_kwargs={"tokenizer": tokenizer, "eos": eos},
                num_proc=workers if workers > 1 else None,
                cache_file_name=str(folder / f"part-{rank:05d}-of-{world:05d}.arrow"),
                new_fingerprint=f"{key.hexdigest()[:16]}-{rank}-{world}",
                desc=desc + (f" (rank {rank} of {world})" if world > 1 else ""),
            )
        except Exception as err:
            problem = explain() if explain is not None else None
            if problem is None:
                raise
            raise ValueError(problem) from err
        write_json(
            folder / f"part-{rank:05d}-of-{world:05d}.json", [Path(f["filename"]).name for f in done.cache_files]
        )
        _wait_for_everyone()
        if rank == 0:
            files = [
                n for r in range(world) for n in json.loads((folder / f"part-{r:05d}-of-{world:05d}.json").read_text())
            ]
            write_json(manifest, {"files": files, "rows": len(documents)})
        _wait_for_everyone()
    files = json.loads(manifest.read_text())["files"]
    parts = [datasets.Dataset.from_file(str(folder / name)) for name in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
