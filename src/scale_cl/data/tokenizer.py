"""A byte-level BPE tokenizer trained offline on the benchmark's own text, and the QA token checks.

Byte-level BPE (GPT-2 style) with ``add_prefix_space=False``: the pre-tokenizer splits text before
BPE runs, so a word with its leading space (" Tormouth") is tokenised the same wherever it occurs,
and no merge crosses the space in front of an answer. That is what makes the paper's metric (hard
first-token accuracy) well defined: the tokens of ``prompt + answer`` are the prompt's tokens
followed by the answer's, and the first answer token is a fixed id per answer.
``prompt_answer_boundary_ok`` checks it; ``shared_first_tokens`` shows values whose first token is
the same (e.g. dates share their month), where first-token accuracy cannot tell them apart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"  # bos, eos, pad and unk alike, as in GPT-2 / Pythia
_ALPHABET = pre_tokenizers.ByteLevel.alphabet()


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens trained on ``texts``; deterministic for the same texts.

    Every byte is in the vocabulary, so no text is ever unknown. No special token is added when
    encoding: callers append ``EOS_TOKEN`` where they want a document boundary.
    """
    minimum = len(_ALPHABET) + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no tokens
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=_ALPHABET,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
    )


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_first_token(tokenizer: PreTrainedTokenizerFast, answer: str) -> int:
    """The first token id of ``answer`` (which must keep its leading space, as in ``QAItem.answer``)."""
    if not answer.startswith(" ") or not answer.strip():
        raise ValueError(f"answer must be a value with its leading space, like ' Tormouth'; got {answer!r}")
    return _ids(tokenizer, answer)[0]


def prompt_answer_boundary_ok(tokenizer: PreTrainedTokenizerFast, prompt: str, answer: str) -> bool:
    """Whether tokenize(prompt) + tokenize(answer) == tokenize(prompt + answer).

    When it holds, the model's prediction after the prompt's last token is scored against the
    answer's first token exactly as it appears in the training text.
    """
    return _ids(tokenizer, prompt) + _ids(tokenizer, answer) == _ids(tokenizer, prompt + answer)


def shared_first_tokens(tokenizer: PreTrainedTokenizerFast, values: Iterable[str]) -> dict[str, list[str]]:
    """First-token groups of ``values`` (each read with a leading space) that hold more than one value.

    Keyed by the shared token's text. First-token accuracy cannot distinguish the values of a group.
    """
    groups: dict[int, list[str]] = defaultdict(list)
    for value in values:
        groups[answer_first_token(tokenizer, " " + value)].append(value)
    return {tokenizer.convert_ids_to_tokens(token): sorted(group) for token, group in groups.items() if len(group) > 1}
