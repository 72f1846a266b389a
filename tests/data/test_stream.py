"""A streamed training split resumes at any block without reading what came before it (`scale_cl.data.stream`): the
blocks after a saved position are those of the uninterrupted pass, shuffled or not, one source or several mixed, with
replay; and the resumed pass tokenises only what follows the position's bookmark."""

import json

import datasets
import numpy as np
import pytest
import torch

import scale_cl.data.stream as stream_module
from scale_cl.data.corpus import CorpusConfig, build_corpus
from scale_cl.data.replay import ReplayStream
from scale_cl.data.stream import BlockStream, MixedStream, stream_blocks
from scale_cl.data.tokenizer import train_bpe_tokenizer

DOCUMENTS = [f"Document {i} is about topic {i % 7}, with word{i} and {'more ' * (i % 5)}words." for i in range(240)]


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DOCUMENTS, vocab_size=300)


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(3):  # three files: three shards, each packed apart
        path = tmp_path / f"part{i}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS[i * 80 : (i + 1) * 80]))
        paths.append(str(path))
    return paths


@pytest.fixture
def small_steps(monkeypatch):
    """Tokenizer batches of 4 documents and a bookmark every 3 blocks, so a file holds many of both."""
    monkeypatch.setattr(stream_module, "TOKENIZE_BATCH", 4)
    monkeypatch.setattr(stream_module, "STRIDE", 3)


def ids(items) -> list[tuple[int, ...]]:
    return [tuple(item["input_ids"].tolist()) for item in items]


def read_to(stream, count: int) -> None:
    """Read ``count`` blocks of a pass and leave it open, as a data loader that stopped there (plus read-ahead)."""
    reader = iter(stream)
    for _ in range(count):
        next(reader)


@pytest.mark.slow
@pytest.mark.parametrize("shuffle_buffer", [0, 5])
def test_a_resumed_pass_yields_the_blocks_after_the_position(files, tok, small_steps, shuffle_buffer):
    def fresh():
        return stream_blocks(files, tok, 8, shuffle_buffer=shuffle_buffer, seed=3)

    straight = ids(fresh())
    assert len(straight) > 60 and len(set(straight)) > 50
    for n in (0, 1, 7, 26, 27, 50, len(straight) - 1):
        stream = fresh()
        read_to(stream, min(n + 4, len(straight)))  # the loader reads a little ahead of the step
        position = json.loads(json.dumps(stream.position(n)))  # as a checkpoint holds it
        resumed = fresh()
        resumed.resume(position)
        assert ids(resumed) == straight[n:], f"resumed at block {n}"
        assert ids(resumed) == straight, "only the next pass starts at the position"


def test_a_resume_tokenises_only_what_follows_the_bookmark(files, tok, small_steps, monkeypatch):
    tokenised = []
    encode = stream_module.encode
    monkeypatch.setattr(stream_module, "encode", lambda texts, *a: tokenised.extend(texts) or encode(texts, *a))
    stream = stream_blocks(files, tok, 8)
    straight = ids(stream)
    everything = len(tokenised)
    n = len(straight) - 10
    position = stream.position(n)
    assert position is not None and position["bookmark"]["shard"] == 2, "the position is in the last file"
    tokenised.clear()
    resumed = stream_blocks(files, tok, 8)
    resumed.resume(position)
    assert ids(resumed) == straight[n:]
    assert len(tokenised) < 80 - position["bookmark"]["documents"] + 4 < everything / 3, "the last file's rest"


def test_a_position_is_not_given_where_it_was_not_kept(files, tok, small_steps, monkeypatch):
    stream = stream_blocks(files, tok, 8)
    assert stream.position(0) is None, "before any pass"
    monkeypatch.setattr(stream_module, "HISTORY", 4)
    straight = ids(stream)
    assert stream.position(1) is None, "its bookmarks were dropped: a resume reads up to the step instead"
    assert stream.position(len(straight)) is None, "past the pass's end: the next pass"
    stream.set_epoch(1)
    ids(stream)
    assert stream.position(len(straight) - 1) is None, "a later pass: resumed by reading, as before"


def test_mixed_sources_draw_as_interleave_datasets_and_resume(files, tok, small_steps):
    def fresh(limit=0):
        parts = [stream_blocks([f], tok, 8) for f in files]
        return MixedStream(parts, [0.5, 0.3, 0.2], seed=4, limit=limit)

    parts = [[item["input_ids"].numpy() for item in stream_blocks([f], tok, 8)] for f in files]
    reference = datasets.interleave_datasets(
        [datasets.Dataset.from_dict({"input_ids": blocks}).to_iterable_dataset() for blocks in parts],
        probabilities=[0.5, 0.3, 0.2],
        seed=4,
    )
    straight = ids(fresh())
    assert straight == [tuple(np.asarray(row["input_ids"]).tolist()) for row in reference], "the same draws"
    for n in (0, 9, 31):
        stream = fresh()
        read_to(stream, n + 2)
        resumed = fresh()
        resumed.resume(stream.position(n))
        assert ids(resumed) == straight[n:]
    assert ids(fresh(limit=12)) == straight[:12]


def test_replay_in_a_stream_resumes_on_its_schedule(files, tok, small_steps):
    replay = torch.arange(5 * 8).reshape(5, 8)

    def fresh():
        return ReplayStream(stream_blocks(files, tok, 8, shuffle_buffer=4, seed=1), replay, ratio=0.25, seed=2)

    straight = ids(fresh())
    for n in (0, 5, 22):
        stream = fresh()
        read_to(stream, n + 3)
        resumed = fresh()
        resumed.resume(stream.position(n))
        assert ids(resumed) == straight[n:]


def test_the_corpus_stream_keeps_its_position_through_the_first_block_check(files, tok):
    config = CorpusConfig(train=files, seq_len=8, heldout_fraction=0.0, streaming=True, max_train_tokens=8 * 40)
    train = build_corpus(config, tok).train
    assert isinstance(train, BlockStream) and train.limit == 40
    straight = ids(train)
    assert len(straight) == 40
    resumed = build_corpus(config, tok).train
    resumed.resume(train.position(17))
    assert ids(resumed) == straight[17:]
