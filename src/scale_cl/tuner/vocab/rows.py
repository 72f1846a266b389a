"""Grow a model's embedding and LM head by new token rows: a plain model or an upscaled one, in either order.

What a grown model keeps (``V`` original rows, ``N`` new ones):

* the original rows are the same tensors' values, bitwise, in separate parameters from the new
  rows (``weight`` / ``weight_new``), so a method can freeze them and train the new rows;
* a tied embedding stays tied: the head's ``weight_new`` is the embedding's;
* ``config.vocab_size`` is ``V + N`` and ``config.vocab_extension`` records
  ``{"base_rows": V, "new_rows": N}`` (saved in ``config.json``, so a reloaded model knows its new rows).

A new row starts as the mean of the rows of the base tokens it was merged from (Gee et al. 2022,
"Fast Vocabulary Transfer"; `VocabExtension.pieces`), or, without pieces, as the mean of all original
rows (what `resize_token_embeddings` on an upscaled model does). On an upscaled model the embedding's
``weight_up`` grows the same way and the head's ``weight_up`` by zero rows, as `upscale` starts it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scale_cl.tuner.layers import ScaleEmbedding, ScaleHead
from scale_cl.tuner.scale_state import stage_records
from scale_cl.tuner.vocab.embedding import VocabEmbedding, VocabHead

EXTENSION_KEY = "vocab_extension"


@dataclass(frozen=True)
class VocabExtension:
    """The tokens an extension added: their strings (the tokenizer's internal form, e.g. ``Ġkato``), the first
    new id, and for each the base-tokenizer ids it is made of (what its new embedding row starts from)."""

    first_id: int
    tokens: tuple[str, ...]
    pieces: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.tokens)

    @property
    def ids(self) -> list[int]:
        return list(range(self.first_id, self.first_id + self.count))


def vocab_rows(model: nn.Module) -> int:
    """How many token rows the model's input embedding has (new rows included): the first id an extension gets."""
    embedding = model.get_input_embeddings()
    return embedding.num_embeddings if hasattr(embedding, "num_embeddings") else embedding.weight.shape[0]


def extension_record(model: nn.Module) -> dict[str, int] | None:
    """``{"base_rows", "new_rows"}`` of an extended model, None for one never extended."""
    return getattr(model.config, EXTENSION_KEY, None)


def new_token_ids(model: nn.Module) -> list[int]:
    record = extension_record(model)
    return [] if record is None else list(range(record["base_rows"], record["base_rows"] + record["new_rows"]))


def new_row_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters holding new tokens' rows (``weight_new`` of the embedding and an untied head), each once."""
    found = {id(p): p for name, p in model.named_parameters(remove_duplicate=False) if name.endswith(".weight_new")}
    return list(found.values())


def _rows_from(weight: torch.Tensor, pieces: Sequence[Sequence[int]] | None, count: int) -> torch.Tensor:
    """New rows: each the mean of ``weight``'s rows of its pieces, or all the mean of ``weight``'s rows."""
    with torch.no_grad():
        source = weight.detach()
        if pieces is None:
            return source.float().mean(0, keepdim=True).expand(count, -1).to(source.dtype).clone()
        return torch.stack([source[list(p)].float().mean(0) for p in pieces]).to(source.dtype)


def _append(param: nn.Parameter | None, rows: torch.Tensor) -> nn.Parameter:
    """A new parameter of ``param``'s rows followed by ``rows`` (``rows`` alone when there is no ``param``)."""
    data = rows if param is None else torch.cat((param.detach(), rows.to(param)))
    return nn.Parameter(data, requires_grad=True if param is None else param.requires_grad)


def _record(model: nn.Module, count: int) -> None:
    record = extension_record(model)
    base = vocab_rows(model) - count if record is None else record["base_rows"]
    new = count + (0 if record is None else record["new_rows"])
    setattr(model.config, EXTENSION_KEY, {"base_rows": base, "new_rows": new})
    model.config.get_text_config().vocab_size = base + new
    if hasattr(model, "vocab_size"):
        model.vocab_size = base + new


def grow_embeddings(model: nn.Module, extension: VocabExtension | int) -> nn.Module:
    """Append rows for the new tokens to ``model``'s embedding and LM head, in place; returns ``model``.

    ``extension``: the `VocabExtension` of `scale_cl.tuner.vocab.extend_tokenizer` (its ``first_id`` must be the
    model's row count, `vocab_rows`), or a number of rows (initialised as the mean of the original rows).
    Works on a plain transformers model (before a method is prepared: the natural order) and on an
    upscaled one (its trainability is then reset by `set_method`, so grow before making the optimizer).
    """
    if stage_records(model):
        raise ValueError(
            "extending the vocabulary of a model grown more than once (scale_cl.tuner.stages) is not supported: its "
            "checkpoint could not record the new rows; extend the vocabulary before the first upscale"
        )
    rows = vocab_rows(model)
    if isinstance(extension, VocabExtension):
        if extension.first_id != rows:
            raise ValueError(
                f"the extension's new ids start at {extension.first_id}, but the model has {rows} token rows: "
                "extend the tokenizer with first_id=vocab_rows(model)"
            )
        count, pieces = extension.count, extension.pieces
    else:
        count, pieces = extension, None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"the number of new token rows must be a positive int, got {count!r}")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings() is None) to grow")
    tied = head.weight is embedding.weight
    if isinstance(embedding, ScaleEmbedding):
        _grow_upscaled(model, embedding, head, tied, pieces, count)
    else:
        split_vocab(model)
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        _grow_plain(model, embedding, head, tied, pieces, count)
    _record(model, count)
    return model


def _grow_plain(model: nn.Module, embedding: Any, head: Any, tied: bool, pieces: Any, count: int) -> None:
    new_rows = _rows_from(embedding.weight, pieces, count)
    if isinstance(embedding, VocabEmbedding):
        embedding.weight_new = _append(embedding.weight_new, new_rows)
    else:
        embedding = VocabEmbedding(embedding, _append(None, new_rows))
        embedding.weight_new.requires_grad_(embedding.weight.requires_grad)
        model.set_input_embeddings(embedding)
    if tied:
        head = head if isinstance(head, VocabHead) else VocabHead(head, embedding.weight_new)
        head.weight_new = embedding.weight_new
    elif isinstance(head, VocabHead):
        head.weight_new = _append(head.weight_new, _rows_from(head.weight, pieces, count))
    else:
        head = VocabHead(head, _append(None, _rows_from(head.weight, pieces, count)))
        head.weight_new.requires_grad_(head.weight.requires_grad)
    model.set_output_embeddings(head)


def _grow_upscaled(
    model: nn.Module, embedding: ScaleEmbedding, head: ScaleHead, tied: bool, pieces: Any, count: int
) -> None:
    if head.bias is not None:
        raise ValueError("vocabulary extension does not support an LM head with a bias")
    embedding.weight_new = _append(embedding.weight_new, _rows_from(embedding.weight, pieces, count))
    embedding.weight_up = _append(embedding.weight_up, _rows_from(embedding.weight_up, pieces, count))
    embedding.num_embeddings += count
    head.weight_new = embedding.weight_new if tied else _append(head.weight_new, _rows_from(head.weight, pieces, count))
    head.weight_up = _append(head.weight_up, torch.zeros(count, head.weight_up.shape[1]))
    head.out_features += count
    model.set_method(model.scale_config.method)  # the new rows train; the stream they feed is no longer constant


def resize_token_rows(model: nn.Module, new_num_tokens: int | None, pad_to_multiple_of: int | None = None) -> nn.Module:
    """transformers' ``resize_token_embeddings`` for an upscaled model: grow to ``new_num_tokens`` rows (rounded up to
    ``pad_to_multiple_of``) with `grow_embeddings`; returns the input embedding. Fewer rows than now is an error:
    the original rows are frozen and kept."""
    rows = vocab_rows(model)
    target = rows if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of:
        target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
    if target < rows:
        raise ValueError(
            f"cannot shrink the vocabulary of an upscaled model from {rows} to {target} rows: its original rows are "
            "frozen and kept; new tokens are added with scale_cl.tuner.vocab.extend_vocab / grow_embeddings"
        )
    if target > rows:
        grow_embeddings(model, target - rows)
    return model.get_input_embeddings()


def split_vocab(model: nn.Module) -> nn.Module:
    """Give a reloaded extended model (one plain ``V + N``-row embedding, ``config.vocab_extension`` set) its
    separate original and new parameters again; a no-op for a model never extended or already split."""
    record = extension_record(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if record is None or not isinstance(embedding, nn.Embedding):
        return model
    base, total = record["base_rows"], record["base_rows"] + record["new_rows"]
    if embedding.weight.shape[0] != total:
        raise ValueError(
            f"config.{EXTENSION_KEY} records {base} + {record['new_rows']} token rows, but the embedding has "
            f"{embedding.weight.shape[0]} (was it resized after the extension?)"
        )
    tied = head is not None and head.weight is embedding.weight

    def split(module: Any) -> tuple[nn.Parameter, nn.Parameter]:
        weight = module.weight
        parts = weight.detach().split((base, total - base))
        return tuple(nn.Parameter(t.clone(), requires_grad=weight.requires_grad) for t in parts)

    old, new = split(embedding)
    embedding.weight = old
    model.set_input_embeddings(VocabEmbedding(embedding, new))
    if head is not None and isinstance(head, nn.Linear):
        if tied:
            head.weight = old
            model.set_output_embeddings(VocabHead(head, new))
        else:
            head_old, head_new = split(head)
            head.weight = head_old
            model.set_output_embeddings(VocabHead(head, head_new))
    return model


def merge_vocab(model: nn.Module) -> nn.Module:
    """Turn a plain model's split embedding and head back into one ``nn.Embedding`` / ``nn.Linear`` of ``V + N`` rows
    (for tools that expect those, e.g. PEFT); the values are unchanged and ``config.vocab_extension`` stays."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, VocabEmbedding):
        return model
    tied = isinstance(head, VocabHead) and head.weight is embedding.weight
    weight = nn.Parameter(torch.cat((embedding.weight, embedding.weight_new)).detach())
    stock = nn.Embedding(weight.shape[0], embedding.embedding_dim, embedding.padding_idx, _weight=weight)
    model.set_input_embeddings(stock)
    if isinstance(head, VocabHead):
        linear = nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
        linear.weight = weight if tied else nn.Parameter(torch.cat((head.weight, head.weight_new)).detach())
        model.set_output_embeddings(linear)
    return model


def grow_for_adapter(base: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """``base`` grown (in place) to the vocabulary a PEFT adapter in ``directory`` was trained with, as PEFT needs it
    before ``PeftModel.from_pretrained``: an adapter of an extended vocabulary names its new ids in
    ``trainable_token_indices``. A no-op for any other adapter."""
    path = Path(directory) / "adapter_config.json"
    indices = json.loads(path.read_text()).get("trainable_token_indices") if path.is_file() else None
    if not indices:
        return base
    ids = indices if isinstance(indices, list) else [i for values in indices.values() for i in values]
    rows = vocab_rows(base)
    if max(ids) >= rows:
        grow_embeddings(base, max(ids) + 1 - rows)
    return merge_vocab(base)
