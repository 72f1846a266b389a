"""Data: the biography benchmark's synthetic people, questions and tokenizer, and the corpus path every training
command reads (sources, tokens, packing, streaming, replay)."""

from scale_cl.data.biography import (
    ATTRIBUTES,
    MAJORS,
    PRESETS,
    QUESTIONS,
    TEMPLATES,
    BioSpec,
    Person,
    Pools,
    QAItem,
    bio_spec,
    biographies,
    biography_corpus,
    build_pools,
    completion_probes,
    generate_people,
    qa_items,
    splits,
)
from scale_cl.data.tokenizer import (
    EOS_TOKEN,
    answer_first_token,
    prompt_answer_boundary_ok,
    shared_first_tokens,
    train_bpe_tokenizer,
)

__all__ = [
    "ATTRIBUTES",
    "EOS_TOKEN",
    "MAJORS",
    "PRESETS",
    "QUESTIONS",
    "TEMPLATES",
    "BioSpec",
    "Person",
    "Pools",
    "QAItem",
    "answer_first_token",
    "bio_spec",
    "biographies",
    "biography_corpus",
    "build_pools",
    "completion_probes",
    "generate_people",
    "prompt_answer_boundary_ok",
    "qa_items",
    "shared_first_tokens",
    "splits",
    "train_bpe_tokenizer",
]
