"""Vocabulary extension for a new language or domain: new tokens in the tokenizer, new rows in the model.

::

    from scale_cl.tuner.vocab import extend_vocab
    model, tokenizer, added = extend_vocab(model, tokenizer, new_domain_texts, count=2000)
    model = prepare(model, "scale_route", ...)        # or any method; upscale-then-extend works too

`extend_tokenizer` learns ``count`` BPE merges on top of the base tokenizer's own segmentation of
the new-domain text and appends them (lowest priority) with the ids ``V .. V+N-1`` (``V``: the
model's embedding rows); `grow_embeddings` appends ``N`` rows to the embedding and LM head as
separate parameters (``weight_new``), initialised as the mean of the rows of each new token's base
pieces. Every method keeps what it freezes frozen: SCALE, Freeze and LLaMA Pro keep the original
rows frozen and train ``weight_new``; LoRA trains the new rows through PEFT's trainable tokens;
full fine-tuning trains everything.

What is exact, before training (tested on every architecture):

* ids below ``V`` read the original embedding rows bitwise, so on text the extended tokenizer
  splits as before (old-domain text where no new merge fires) a SCALE model's original stream is
  the base model's, and its logits over the original vocabulary (``logits[..., :V]``) are the base
  model's (Theorem 3.1 with the extension);
* the original rows stay bitwise unchanged under training for SCALE, Freeze, LLaMA Pro and LoRA.

Cost for SCALE: the new rows feed the original stream, so it is no longer constant and backward runs
through the frozen products (`set_method`); a SCALE-Preserve step then costs about what an Adapt
step does (measured 1.5x Preserve without an extension on a 6-layer d=256 Llama, CPU, 2026-11-24).

What is not exact: the softmax spans ``V + N`` tokens, so every original token's log-probability drops by
the same per-position amount ``log(1 + sum_new exp(z_new) / sum_old exp(z_old))``, and text where a
new merge fires is split into different (fewer) tokens, so its perplexity is over another sequence.
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
