"""The data path's blocks are bitwise the blocks of the reader it replaced: no results page moves.

The expected hashes were computed by the hand-written reader (``data/corpus.py`` at 7c2efb2) on the same fixtures:
every split (training, held-out, each old-domain set, replay) of several settings, in memory and streamed. The
clean-base corpora (`measurements/cpt_corpus.py`, the clean base's tokenizer) are checked the same way when they are
on this machine (``outputs/``): `measurements/corpus_block_hashes.py` prints their hashes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scale_cl.data.corpus import CorpusConfig, build_corpus
from scale_cl.data.tokenizer import train_bpe_tokenizer

WORDS = "river mountain lake stone forest field cloud rain wind road house bridge garden city sea".split()  # noqa: SIM905
DOCS = [
    " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + (i * 11) % 37)) + f" number {i}."
    for i in range(300)
]
OLD = [
    f"An old-domain document {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(9 + i % 13))
    for i in range(60)
]


def block_hash(blocks: torch.Tensor) -> str:
    """SHA-256 of a block tensor's shape and int64 values."""
    blocks = blocks.to(torch.int64).contiguous()
    return hashlib.sha256(json.dumps(list(blocks.shape)).encode() + blocks.numpy().tobytes()).hexdigest()[:16]


def rows(dataset) -> torch.Tensor:
    """Every block of a dataset of ``{"input_ids", "labels"}`` items, stacked (map-style or a stream)."""
    items = [item["input_ids"] for item in dataset]
    return torch.stack(items) if items else torch.empty((0, 0), dtype=torch.long)


def corpus_hashes(config: CorpusConfig, tokenizer) -> dict[str, str]:
    """The hash of every split `build_corpus` packs."""
    corpus = build_corpus(config, tokenizer)
    found = {"train": block_hash(rows(corpus.train))}
    if corpus.heldout is not None:
        found["heldout"] = block_hash(rows(corpus.heldout))
    for name, data in corpus.old_eval.items():
        found[f"old_eval/{name}"] = block_hash(rows(data))
    if corpus.replay is not None:
        found["replay"] = block_hash(rows(corpus.replay))
    return found


def write_fixtures(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "a.jsonl").open("w", encoding="utf-8") as file:
        for i, doc in enumerate(DOCS[:150]):
            file.write(json.dumps({"text": doc, "id": i}) + "\n")
        file.write(json.dumps({"text": "   ", "id": -1}) + "\n")  # whitespace only: skipped
    pq.write_table(pa.table({"text": DOCS[150:], "id": list(range(150))}), folder / "b.parquet")
    (folder / "txt").mkdir(exist_ok=True)
    for i, doc in enumerate(DOCS[:40]):
        (folder / "txt" / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    with (folder / "old.jsonl").open("w", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": doc}) + "\n" for doc in OLD[:30])
    with (folder / "replay.jsonl").open("w", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": doc}) + "\n" for doc in OLD[30:])


def cases(folder: Path) -> dict[str, CorpusConfig]:
    f = str(folder)
    both = [f"{f}/a.jsonl", f"{f}/b.parquet"]
    return {
        "two sources, held-out 0.2": CorpusConfig(
            train=both, old_eval=[f"old={f}/old.jsonl"], seq_len=8, heldout_fraction=0.2, max_eval_sequences=5
        ),
        "a cap": CorpusConfig(train=both, seq_len=16, heldout_fraction=0.05, max_train_tokens=16 * 30),
        "txt files, two old sets": CorpusConfig(
            train=[f"{f}/txt/*.txt"],
            old_eval=[f"old={f}/old.jsonl", f"second={f}/replay.jsonl"],
            seq_len=12,
            heldout_fraction=0.1,
            max_eval_sequences=3,
        ),
        "replay": CorpusConfig(
            train=both,
            old_eval=[f"old={f}/old.jsonl"],
            replay=[f"r={f}/replay.jsonl"],
            replay_ratio=0.25,
            seq_len=8,
            heldout_fraction=0.1,
            max_eval_sequences=4,
        ),
        "streamed with replay": CorpusConfig(
            train=both,
            old_eval=[f"old={f}/old.jsonl"],
            replay=[f"r={f}/replay.jsonl"],
            replay_ratio=0.25,
            seq_len=8,
            heldout_fraction=0.1,
            max_eval_sequences=4,
            max_train_tokens=8 * 50,
            streaming=True,
        ),
    }


EXPECTED: dict[str, dict[str, str]] = {
    "two sources, held-out 0.2": {
        "train": "16fbb4a248d6e8e4",
        "heldout": "76f236b0ec1e1d98",
        "old_eval/old": "0a65fc82d43d6da7",
    },
    "a cap": {"train": "412925c302b00063", "heldout": "44e017532a109ac4"},
    "txt files, two old sets": {
        "train": "6a4d2775056fa540",
        "heldout": "72a669719b642399",
        "old_eval/old": "c784edd826e891fb",
        "old_eval/second": "f4299fc806457b58",
    },
    "replay": {
        "train": "49d38c1f9be9797e",
        "heldout": "388d0b5a4a1fad62",
        "old_eval/old": "5d96e8577250ca0a",
        "replay": "b76cb78f09c859f6",
    },
    "streamed with replay": {
        "train": "e547d1853f10617d",
        "heldout": "388d0b5a4a1fad62",
        "old_eval/old": "5d96e8577250ca0a",
        "replay": "3a334f14f4e4d3d0",
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(DOCS + OLD, vocab_size=300)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_split_is_bitwise_the_old_readers(tmp_path, tokenizer, hf_cache, name):
    write_fixtures(tmp_path / "data")
    assert corpus_hashes(cases(tmp_path / "data")[name], tokenizer) == EXPECTED[name]


def test_the_fixtures_tokenizer_is_the_one_the_hashes_were_taken_with(tokenizer):
    ids = tokenizer(DOCS[0] + " " + OLD[0], add_special_tokens=False)["input_ids"]
    assert hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16] == TOKENIZER_CHECK


TOKENIZER_CHECK = "04d0237878d0cb1d"

ROOT = Path(__file__).parents[2]
CLEAN_MODEL = ROOT / "outputs" / "clean-en" / "model"


def clean_cases() -> dict[str, CorpusConfig]:
    """The corpora the clean-base results were measured on: cpt's clean-en preset (with and without English replay,
    measurements/cpt_clean_replay.sh) and the base's own (paths relative to the repository, as the presets name
    them)."""
    from dataclasses import replace

    from scale_cl.experiments.base.config import preset as base_preset
    from scale_cl.experiments.cpt.config import preset as cpt_preset

    cpt = cpt_preset("clean-en").data
    replay = replace(cpt, replay=["english=outputs/corpora/english-base/train.jsonl"], replay_ratio=0.25)
    return {"cpt clean-en": cpt, "cpt clean-en, 25% replay": replay, "base clean-en": base_preset("clean-en").data}


EXPECTED_CLEAN: dict[str, dict[str, str]] = {  # the old reader's, 2026-11-28, on the corpora and base built then
    "cpt clean-en": {
        "train": "1d659c2e7a3a678c",
        "heldout": "42ea4676caed239c",
        "old_eval/en": "e127b679296a2a86",
        "old_eval/handbook": "efa1eb139c23f2bb",
    },
    "cpt clean-en, 25% replay": {
        "train": "1d659c2e7a3a678c",
        "heldout": "42ea4676caed239c",
        "old_eval/en": "e127b679296a2a86",
        "old_eval/handbook": "efa1eb139c23f2bb",
        "replay": "b4a2e3e7379464d5",
    },
    "base clean-en": {"train": "45057ba43ef28164", "old_eval/en": "2100cb444b2741f2"},
}


@pytest.mark.slow
@pytest.mark.skipif(not CLEAN_MODEL.is_dir(), reason="the clean base and its corpora are not built on this machine")
@pytest.mark.parametrize("name", sorted(EXPECTED_CLEAN))
def test_the_clean_base_corpora_pack_to_the_blocks_their_results_were_measured_on(name, monkeypatch, hf_cache):
    from transformers import AutoTokenizer

    monkeypatch.chdir(ROOT)
    tokenizer = AutoTokenizer.from_pretrained(CLEAN_MODEL)
    assert corpus_hashes(clean_cases()[name], tokenizer) == EXPECTED_CLEAN[name]


if __name__ == "__main__":  # print the hashes (run against the old reader to fill EXPECTED and EXPECTED_CLEAN)
    import os
    import sys
    import tempfile

    tok = train_bpe_tokenizer(DOCS + OLD, vocab_size=300)
    ids = tok(DOCS[0] + " " + OLD[0], add_special_tokens=False)["input_ids"]
    print("TOKENIZER_CHECK =", repr(hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]))
    with tempfile.TemporaryDirectory() as tmp:
        write_fixtures(Path(tmp) / "data")
        found = {name: corpus_hashes(config, tok) for name, config in cases(Path(tmp) / "data").items()}
    json.dump(found, sys.stdout, indent=4)
    if CLEAN_MODEL.is_dir():
        from transformers import AutoTokenizer

        os.chdir(ROOT)
        clean = AutoTokenizer.from_pretrained(CLEAN_MODEL)
        print("\nEXPECTED_CLEAN =")
        json.dump({name: corpus_hashes(c, clean) for name, c in clean_cases().items()}, sys.stdout, indent=4)
