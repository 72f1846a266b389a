"""Vocabulary extension for a new language or domain: new tokens in the tokenizer, new rows in the model.

::

    from scale_cl.tuner.vocab import extend_vocab
    model, tokenizer, added = extend_vocab(model, tokenizer, new_domain_texts, count=2000)
    model = prepare(model, "scale_route", ...)        # or any method; upscale-then-extend works too

The new rows are separate parameters (``weight_new``); every method but full fine-tuning keeps the original rows
frozen. What is exact, what is not, and what it costs SCALE: docs/design.md §2.
"""

from __future__ import annotations

from typing import Any

from scale_cl.tuner.vocab.embedding import VocabEmbedding, VocabHead
from scale_cl.tuner.vocab.rows import (
    EXTENSION_KEY,
    VocabExtension,
    extension_record,
    grow_embeddings,
    grow_for_adapter,
    merge_vocab,
    new_row_parameters,
    new_token_ids,
    resize_token_rows,
    split_vocab,
    vocab_rows,
)

# Learning new tokens (`scale_cl.tuner.vocab.tokenizer`, which needs the ``tokenizers`` library) is imported when
# first asked for: the rest of this package is the tuner's (a model with new rows saves, loads and upscales).
_FROM_TOKENIZER = ("extend_tokenizer", "extend_vocab")


def __getattr__(name: str) -> Any:
    if name in _FROM_TOKENIZER:
        from scale_cl.tuner.vocab import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EXTENSION_KEY",
    "VocabEmbedding",
    "VocabExtension",
    "VocabHead",
    "extend_tokenizer",
    "extend_vocab",
    "extension_record",
    "grow_embeddings",
    "grow_for_adapter",
    "merge_vocab",
    "new_row_parameters",
    "new_token_ids",
    "resize_token_rows",
    "split_vocab",
    "vocab_rows",
]
