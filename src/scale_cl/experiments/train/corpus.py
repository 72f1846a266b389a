"""A corpus run's corpus: packed with the base tokenizer or, with ``--data.extend_vocab N``, with the tokenizer
extended by ``N`` tokens learned from the new-domain training split (`scale_cl.tuner.vocab`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from scale_cl.data.corpus import Corpus, build_corpus, split_documents
from scale_cl.experiments.train.prepare import base_model_config, process_state
from scale_cl.experiments.train.sections import VOCAB_TEXT_CHARS, RunSettings
from scale_cl.files import write_json
from scale_cl.tuner.vocab import VocabExtension, extend_tokenizer, grow_embeddings, vocab_rows

TOKENIZER_DIR = "tokenizer"

VOCAB_FILE = "vocab_extension.json"


@dataclass
class RunCorpus(Corpus):
    """A corpus with the tokenizer it was packed with and, with ``--data.extend_vocab``, the tokens it added."""

    tokenizer: PreTrainedTokenizerBase | None = None
    vocab: VocabExtension | None = None


def load_run_corpus(
    cfg: RunSettings, tokenizer: PreTrainedTokenizerBase, rows: int | None = None, log_prefix: str = "cpt"
) -> RunCorpus:
    """The run's corpus, packed with the base tokenizer or, with ``--data.extend_vocab``, the extended one.

    ``rows``: the base model's embedding rows (where new ids start); read from its config when not given.
    Every error of the extension (too many tokens for the text, colliding ids) is raised here.
    """
    tokenizer, vocab = run_tokenizer(cfg, tokenizer, rows)
    corpus = build_corpus(cfg.data, tokenizer, seed=cfg.seed)
    if process_state().is_main_process:
        if vocab is not None:
            example = list(vocab.tokens[:8])
            print(f"[{log_prefix}] data: {vocab.count:,} new tokens, ids {vocab.first_id:,}.., e.g. {example}")
        for line in corpus.summary():
            print(f"[{log_prefix}] data {line}")
    if corpus.heldout is None and not corpus.old_eval:
        raise ValueError("nothing to measure: set data.heldout_fraction > 0 and/or data.old_eval")
    return RunCorpus(**vars(corpus), tokenizer=tokenizer, vocab=vocab)


def run_tokenizer(
    cfg: RunSettings, tokenizer: PreTrainedTokenizerBase, rows: int | None = None
) -> tuple[PreTrainedTokenizerBase, VocabExtension | None]:
    """The base tokenizer, or with ``--data.extend_vocab N`` a copy extended with ``N`` tokens learned from the
    new-domain training split (never the held-out or old-domain text)."""
    count = cfg.data.extend_vocab
    if not count:
        return tokenizer, None
    if rows is None:
        rows = base_model_config(cfg).get_text_config().vocab_size
    texts = _first_characters(split_documents(cfg.data, "train"), VOCAB_TEXT_CHARS)
    try:
        return extend_tokenizer(tokenizer, texts, count, first_id=rows)
    except ValueError as err:
        raise ValueError(f"data.extend_vocab={count}: {err}") from err


def _first_characters(texts: Iterable[str], limit: int) -> Iterator[str]:
    """``texts`` until ``limit`` characters are read (the last one cut)."""
    for text in texts:
        yield text[:limit]
        limit -= len(text)
        if limit <= 0:
            return


def grown_base(
    base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, corpus: Corpus
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """``base`` (grown in place by the corpus's new tokens, once) and the tokenizer the corpus was packed with."""
    vocab = getattr(corpus, "vocab", None)
    if vocab is None:
        return base, tokenizer
    if vocab_rows(base) == vocab.first_id:
        grow_embeddings(base, vocab)
    return base, corpus.tokenizer


def save_run_tokenizer(corpus: Corpus, out: Path) -> None:
    """The extended tokenizer and its new tokens into ``out/tokenizer`` (nothing without an extension)."""
    vocab = getattr(corpus, "vocab", None)
    if vocab is None or not process_state().is_main_process:
        return
    corpus.tokenizer.save_pretrained(out / TOKENIZER_DIR)
    record = {"first_id": vocab.first_id, "tokens": list(vocab.tokens), "pieces": [list(p) for p in vocab.pieces]}
    write_json(out / TOKENIZER_DIR / VOCAB_FILE, record)
