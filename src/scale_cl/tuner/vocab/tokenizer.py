"""Extend a byte-level (or any) BPE tokenizer with merges learned from new-domain text.

The new tokens get the ids ``first_id .. first_id + N - 1`` (``first_id`` defaults to the base
model's embedding row count, so a padded embedding's unused rows stay unused), their merges are
appended after the base merges (the lowest priority), and everything else of the tokenizer (its
pre-tokenizer, normalizer, special tokens and their ids, templates) is kept. Old-domain text
therefore tokenizes exactly as before unless it contains a new token's string where the base
tokenizer leaves that token's two parts side by side.

Only BPE tokenizers backed by the ``tokenizers`` library are supported: a WordPiece or Unigram
tokenizer has no merges to append, and ``tokenizer.add_tokens`` (matched as whole strings before
pre-tokenization) would change how old-domain text splits wherever the string occurs, so those
are refused with a clear error rather than extended differently.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from tokenizers import Tokenizer
from torch import nn

from scale_cl.tuner.vocab.merges import learn_merges
from scale_cl.tuner.vocab.rows import VocabExtension, grow_embeddings, vocab_rows

BATCH = 256  # documents per encode_batch call
_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def bpe_state(tokenizer: Any) -> dict[str, Any]:
    """The backend tokenizer's JSON of a fast BPE tokenizer, or a ValueError saying why it cannot be extended."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(
            f"cannot extend a {type(tokenizer).__name__}: vocabulary extension needs a fast tokenizer backed by the "
            "`tokenizers` library (load it with AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    state = json.loads(backend.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise ValueError(
            f"cannot extend a {model.get('type')} tokenizer: only BPE tokenizers have merges to append; adding whole "
            "strings (tokenizer.add_tokens) would change how old-domain text splits, so it is not done here"
        )
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("dropout"):
        raise ValueError(
            "cannot extend a BPE tokenizer with a continuing_subword_prefix, end_of_word_suffix or dropout "
            "(their merges do not concatenate plain token strings)"
        )
    return state


def used_ids(state: dict[str, Any]) -> set[int]:
    return set(state["model"]["vocab"].values()) | {token["id"] for token in state["added_tokens"]}


def count_words(backend: Tokenizer, texts: Iterable[str], skip: set[int]) -> Counter[tuple[str, ...]]:
    """How often each pre-tokenized word occurs in ``texts``, as the base tokenizer segments it."""
    words: Counter[tuple[str, ...]] = Counter()
    texts = iter(texts)
    while batch := list(islice(texts, BATCH)):
        for encoding in backend.encode_batch(batch, add_special_tokens=False):
            current, last = [], None
            for token, token_id, word in zip(encoding.tokens, encoding.ids, encoding.word_ids, strict=True):
                if word != last and current:
                    words[tuple(current)] += 1
                    current = []
                last = word
                if token_id not in skip and word is not None:
                    current.append(token)
            if current:
                words[tuple(current)] += 1
    return words


def _frozen_tokens(state: dict[str, Any]) -> tuple[set[str], set[int]]:
    """Token strings never merged (added tokens, byte fallback, unk) and the ids of the added tokens."""
    model = state["model"]
    frozen = {token["content"] for token in state["added_tokens"]}
    frozen |= {t for t in model["vocab"] if _BYTE_FALLBACK.match(t)} if model.get("byte_fallback") else set()
    if model.get("unk_token"):
        frozen.add(model["unk_token"])
    return frozen, {token["id"] for token in state["added_tokens"]}


def _pieces(token: str, parts: dict[str, tuple[str, str]], vocab: dict[str, int]) -> Iterator[int]:
    if token in vocab:
        yield vocab[token]
        return
    for part in parts[token]:
        yield from _pieces(part, parts, vocab)


def extend_tokenizer(
    tokenizer: Any, texts: Iterable[str], count: int, first_id: int | None = None, min_frequency: int = 2
) -> tuple[Any, VocabExtension]:
    """A copy of ``tokenizer`` with ``count`` tokens learned from ``texts`` (see the module doc); ``tokenizer`` is
    not changed.

    Args:
        tokenizer: a transformers fast BPE tokenizer.
        texts: the new-domain training text (never the evaluation text).
        count: how many tokens to add; more than the text supports is a ValueError saying how many it does.
        first_id: the first new id; default one past the tokenizer's largest id. Pass the model's embedding
            row count (`scale_cl.tuner.vocab.vocab_rows`) so the new rows follow the model's.
        min_frequency: a new token's merge must occur this often in ``texts``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive number of tokens to add, got {count!r}")
    state = bpe_state(tokenizer)
    used = used_ids(state)
    first_id = max(used) + 1 if first_id is None else first_id
    clash = sorted(i for i in used if i >= first_id)
    if clash:
        raise ValueError(
            f"the new tokens would take ids {first_id}..{first_id + count - 1}, but the tokenizer already uses "
            f"{len(clash)} ids from {first_id} on ({clash[:5]}{' ...' if len(clash) > 5 else ''}): tokens the model "
            "has no rows for? Extend a tokenizer whose ids all lie below the model's embedding rows"
        )
    model = state["model"]
    vocab: dict[str, int] = model["vocab"]
    frozen, skip = _frozen_tokens(state)
    words = count_words(tokenizer.backend_tokenizer, texts, skip)
    known = set(vocab) | frozen
    merges = learn_merges(words, count, known, frozen, min_frequency)
    if len(merges) < count:
        raise ValueError(
            f"the new-domain text supports only {len(merges)} new tokens (merges of two adjacent tokens that occur "
            f"at least {min_frequency} times and make a token the vocabulary lacks), not {count}; "
            f"ask for at most {len(merges)} or give more text"
        )
    tokens = [a + b for a, b in merges]
    parts = dict(zip(tokens, merges, strict=True))
    pieces = tuple(tuple(_pieces(token, parts, vocab)) for token in tokens)
    as_strings = bool(model["merges"]) and isinstance(model["merges"][0], str)
    for offset, (a, b) in enumerate(merges):
        vocab[a + b] = first_id + offset
        model["merges"].append(f"{a} {b}" if as_strings else [a, b])
    extended = copy.deepcopy(tokenizer)
    extended._tokenizer = Tokenizer.from_str(json.dumps(state))
    return extended, VocabExtension(first_id, tuple(tokens), pieces)


def extend_vocab(
    model: nn.Module, tokenizer: Any, texts: Iterable[str], count: int, min_frequency: int = 2
) -> tuple[nn.Module, Any, VocabExtension]:
    """Extend ``tokenizer`` with ``count`` tokens learned from ``texts`` and grow ``model`` for them.

    Returns (model grown in place, a new tokenizer, what was added). Every check (a tokenizer that
    cannot be extended, ids that would collide, more tokens than the text supports) runs before the
    model is touched; ``tokenizer`` itself is never changed.
    """
    extended, added = extend_tokenizer(tokenizer, texts, count, vocab_rows(model), min_frequency)
    return grow_embeddings(model, added), extended, added
