"""Text corpora for continual pre-training: readers, packing, held-out split, caps, errors, streaming."""

from __future__ import annotations

import argparse
import json
import logging
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import default_data_collator

from scale_cl.cli.options import add_dataclass_options
from scale_cl.data import corpus as corpus_module
from scale_cl.data.corpus import (
    CorpusConfig,
    CorpusStats,
    HubSource,
    PackedDataset,
    PackedStream,
    build_corpus,
    check_corpus,
    eval_sets,
    is_heldout,
    pack,
    pack_blocks,
    parse_hub_source,
    read_documents,
    split_documents,
)
from scale_cl.data.tokenizer import train_bpe_tokenizer
from scale_cl.experiments.overrides import nest

DOCS = [
    "The first document talks about rivers and mountains.",
    "Second one:\nit has two lines.",
    "Ünïcode is fine too: 한국어 문서와 café.",
    "A fourth, short.",
]
MANY = [f"Document {i} is about topic {i % 7}, with word{i} and more words to read." for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DOCS + MANY, vocab_size=320)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """``datasets`` writes its arrow cache under tmp_path, not the home folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(docs)), encoding="utf-8")
    return path


def write_parquet(path, docs, field="text"):
    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path)
    return path


def write_txts(folder, docs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


def token_stream(tok, docs):
    """The expected packing stream: each document's tokens then EOS."""
    return [t for doc in docs for t in (*tok(doc, add_special_tokens=False)["input_ids"], tok.eos_token_id)]


def count_tokens(tok, docs):
    return len(token_stream(tok, docs))


# ---------------------------------------------------------------------------------------------
# Readers


def test_every_file_format_reads_the_same_documents(tmp_path):
    sources = {
        "txt": str(write_txts(tmp_path / "txt", DOCS) / "*.txt"),
        "jsonl": str(write_jsonl(tmp_path / "docs.jsonl", DOCS)),
        "parquet": str(write_parquet(tmp_path / "docs.parquet", DOCS)),
        "jsonl-body": str(write_jsonl(tmp_path / "body.jsonl", DOCS, field="body")),
    }
    for name, source in sources.items():
        field = "body" if name == "jsonl-body" else "text"
        assert list(read_documents(source, text_field=field)) == DOCS, name


def test_glob_reads_matching_files_in_sorted_order_across_formats(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", DOCS[1:3])
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    write_parquet(tmp_path / "c.parquet", DOCS[3:])
    (tmp_path / "sub").mkdir()  # folders matched by the glob are not files: ignored
    assert list(read_documents(str(tmp_path / "*"))) == DOCS


def test_hub_sources_read_local_dataset_folders(tmp_path, hf_cache):
    import datasets

    (tmp_path / "folder").mkdir()
    write_parquet(tmp_path / "folder" / "part-0.parquet", DOCS[:2])
    write_parquet(tmp_path / "folder" / "part-1.parquet", DOCS[2:])
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(4))}).save_to_disk(str(tmp_path / "saved"))
    for source in (f"hf:{tmp_path / 'folder'}", f"hf:{tmp_path / 'saved'}::train"):
        for streaming in (False, True):
            assert list(read_documents(source, streaming=streaming)) == DOCS, (source, streaming)
    with pytest.raises(ValueError, match=r"has no field 'body'; its fields are \['id', 'text'\]"):
        list(read_documents(f"hf:{tmp_path / 'folder'}", text_field="body", streaming=True))
    with pytest.raises(ValueError, match=r"cannot load hf:.*split 'validation'"):
        list(read_documents(f"hf:{tmp_path / 'folder'}::validation"))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        list(read_documents(f"hf:{tmp_path / 'missing'}"))


def test_hub_source_spelling():
    assert parse_hub_source("hf:wikimedia/wikipedia:20231101.ko:train") == HubSource(
        "wikimedia/wikipedia", "20231101.ko", "train"
    )
    assert parse_hub_source("hf:user/corpus::train[:10%]") == HubSource("user/corpus", None, "train[:10%]")
    assert parse_hub_source("hf:./folder") == HubSource("./folder", None, "train")
    with pytest.raises(ValueError, match="expected hf:PATH"):
        parse_hub_source("hf:")


def test_old_domain_sets_are_named_by_name_equals_or_by_the_source():
    assert eval_sets(["wiki=hf:user/wiki::test", "data/old.jsonl"]) == {
        "wiki": "hf:user/wiki::test",
        "data/old.jsonl": "data/old.jsonl",
    }
    with pytest.raises(ValueError, match="two old-domain sources are named 'a'"):
        eval_sets(["a=x.txt", "a=y.txt"])


# ---------------------------------------------------------------------------------------------
# Packing


def test_pack_blocks_concatenates_and_drops_the_remainder():
    docs = [[1, 2, 9], [3, 9], [4, 5, 6, 9]]  # 9 = EOS, already appended
    assert list(pack_blocks(docs, 4)) == [[1, 2, 9, 3], [9, 4, 5, 6]]  # [9] left over: dropped
    assert list(pack_blocks(docs, 3)) == [[1, 2, 9], [3, 9, 4], [5, 6, 9]]
    assert list(pack_blocks(docs, 10)) == []
    assert list(pack_blocks([[7] * 7], 3)) == [[7] * 3, [7] * 3]  # one long document spans blocks


def test_pack_puts_eos_after_every_document_and_cuts_exact_blocks(tok):
    stream = token_stream(tok, DOCS)
    seq_len = 16
    assert len(stream) % seq_len, "the test needs a remainder to drop"
    stats = CorpusStats()
    blocks = pack(DOCS, tok, seq_len, stats=stats)
    full = len(stream) // seq_len
    assert blocks.dtype == torch.long and blocks.shape == (full, seq_len)
    assert blocks.flatten().tolist() == stream[: full * seq_len]
    assert (blocks == tok.eos_token_id).sum().item() == stream[: full * seq_len].count(tok.eos_token_id) >= 3
    assert (stats.documents, stats.tokens, stats.sequences) == (len(DOCS), len(stream), full)


def test_packed_dataset_gives_labels_equal_to_inputs_and_collates(tok):
    blocks = pack(MANY[:20], tok, 8)
    dataset = PackedDataset(blocks)
    assert len(dataset) == blocks.shape[0]
    item = dataset[3]
    assert torch.equal(item["input_ids"], blocks[3]) and torch.equal(item["labels"], blocks[3])
    batch = default_data_collator([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 8)
    assert torch.equal(batch["input_ids"], blocks[:2])
    with pytest.raises(ValueError, match="LongTensor"):
        PackedDataset(blocks.int())


# ---------------------------------------------------------------------------------------------
# Held-out split


def test_heldout_split_is_disjoint_deterministic_and_order_free(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", MANY[:100])
    b = write_jsonl(tmp_path / "b.jsonl", MANY[100:])
    config = CorpusConfig(train=[str(a), str(b)], heldout_fraction=0.2)
    held, train = list(split_documents(config, "heldout")), list(split_documents(config, "train"))
    assert not set(held) & set(train)
    assert sorted(held + train) == sorted(MANY)
    assert 20 <= len(held) <= 60  # about 20% of 200
    assert held == list(split_documents(config, "heldout"))  # deterministic
    reordered = CorpusConfig(train=[str(b), str(a)], heldout_fraction=0.2)
    assert set(split_documents(reordered, "heldout")) == set(held)  # by text, not position
    # an exact copy of a held-out document is held out too: duplicates cannot leak into training
    c = write_jsonl(tmp_path / "c.jsonl", [held[0], train[0]])
    with_copies = CorpusConfig(train=[str(a), str(b), str(c)], heldout_fraction=0.2)
    assert list(split_documents(with_copies, "heldout")) == [*held, held[0]]
    assert is_heldout(held[0], 0.2) and not is_heldout(held[0], 0.0)


def test_build_corpus_packs_each_split_from_its_own_documents(tmp_path, tok):
    source = write_jsonl(tmp_path / "new.jsonl", MANY)
    old = write_txts(tmp_path / "old", DOCS)
    config = CorpusConfig(
        train=[str(source)], old_eval=[f"old={old}/*.txt"], seq_len=8, heldout_fraction=0.2, max_eval_sequences=5
    )
    corpus = build_corpus(config, tok)
    held, train = list(split_documents(config, "heldout")), list(split_documents(config, "train"))
    assert torch.equal(corpus.heldout.blocks, pack(held, tok, 8, max_sequences=5))
    assert torch.equal(corpus.train.blocks, pack(train, tok, 8))
    assert torch.equal(corpus.old_eval["old"].blocks, pack(DOCS, tok, 8, max_sequences=5))
    assert len(corpus.heldout) == len(corpus.old_eval["old"]) == 5
    assert corpus.stats["train"].documents == len(train) and corpus.stats["train"].sequences == len(corpus.train)
    assert set(corpus.stats) == {"heldout", "train", "old_eval/old"}
    assert any(line.startswith("train: 1") and "sequences" in line for line in corpus.summary())
    no_heldout = build_corpus(CorpusConfig(train=[str(source)], seq_len=8, heldout_fraction=0.0), tok)
    assert no_heldout.heldout is None and torch.equal(no_heldout.train.blocks, pack(MANY, tok, 8))


# ---------------------------------------------------------------------------------------------
# Caps


def test_a_cap_stops_reading_early(tok):
    pulled = 0

    def documents():
        nonlocal pulled
        for doc in MANY * 50:  # 10,000 documents
            pulled += 1
            yield doc

    blocks = pack(documents(), tok, 16, max_sequences=2)
    assert blocks.shape == (2, 16)
    assert pulled <= 16  # the first tokenizer batch or two, not the corpus
    assert torch.equal(blocks, pack(MANY, tok, 16)[:2])


def test_max_train_tokens_never_reads_past_what_it_needs(tmp_path, tok):
    source = write_jsonl(tmp_path / "new.jsonl", MANY)
    with (tmp_path / "new.jsonl").open("ab") as file:
        file.write(b'{"text": "bad \xff byte"}\n')  # past the cap: never read, so no error
    config = CorpusConfig(train=[str(source)], seq_len=16, max_train_tokens=40, heldout_fraction=0.0)
    assert config.max_train_sequences == 2
    corpus = build_corpus(config, tok)
    assert len(corpus.train) == 2
    assert corpus.stats["train"].documents < 20
    with pytest.raises(ValueError, match=r"new\.jsonl line 201: not valid UTF-8"):
        build_corpus(CorpusConfig(train=[str(source)], seq_len=16, heldout_fraction=0.0), tok)


# ---------------------------------------------------------------------------------------------
# Bad input


def _bad_inputs(tmp_path, tok):
    """name -> (sources, config overrides, expected error, message pattern)."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n  \n", encoding="utf-8")
    write_parquet(tmp_path / "empty.parquet", [])
    write_jsonl(tmp_path / "body.jsonl", DOCS, field="body")
    write_parquet(tmp_path / "body.parquet", DOCS, field="body")
    (tmp_path / "list.jsonl").write_text('["not", "an", "object"]\n', encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("first line\ncaf\xe9 au lait".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": "cut', encoding="utf-8")
    (tmp_path / "tiny.txt").write_text("tiny", encoding="utf-8")
    (tmp_path / "spaces.jsonl").write_text('{"text": "  "}\n{"text": ""}\n{"text": null}\n', encoding="utf-8")
    (tmp_path / "data.csv").write_text("text\nhello\n", encoding="utf-8")
    (tmp_path / "folder").mkdir()
    p = str(tmp_path)
    tiny = count_tokens(tok, ["tiny"])
    return {
        "missing file": ([f"{p}/nope.jsonl"], {}, FileNotFoundError, r"nope\.jsonl: no such file"),
        "glob matches nothing": ([f"{p}/*.nothing"], {}, FileNotFoundError, r"no file matches '.*\*\.nothing'"),
        "unsupported extension": ([f"{p}/data.csv"], {}, ValueError, r"unsupported file type '\.csv'; use one of"),
        "a folder": ([f"{p}/folder"], {}, ValueError, r"is a folder: give a glob such as .*folder/\*\.jsonl"),
        "empty txt": ([f"{p}/empty.txt"], {}, ValueError, r"empty\.txt is empty \(0 bytes\)"),
        "empty jsonl": ([f"{p}/blank.jsonl"], {}, ValueError, r"blank\.jsonl is empty \(no JSON lines\)"),
        "empty parquet": ([f"{p}/empty.parquet"], {}, ValueError, r"empty\.parquet is empty \(0 rows\)"),
        "jsonl field absent": (
            [f"{p}/body.jsonl"],
            {},
            ValueError,
            r"body\.jsonl line 1 has no field 'text'; its fields are \['body', 'id'\]",
        ),
        "parquet column absent": (
            [f"{p}/body.parquet"],
            {},
            ValueError,
            r"body\.parquet has no field 'text'; its fields are \['body', 'id'\]",
        ),
        "jsonl not an object": ([f"{p}/list.jsonl"], {}, ValueError, r"list\.jsonl line 1: expected a JSON object"),
        "txt not utf-8": ([f"{p}/latin1.txt"], {}, ValueError, r"latin1\.txt line 2: not valid UTF-8.*'skip'"),
        "jsonl not utf-8": ([f"{p}/latin1.jsonl"], {}, ValueError, r"latin1\.jsonl line 3: not valid UTF-8"),
        "jsonl not json": ([f"{p}/broken.jsonl"], {}, ValueError, r"broken\.jsonl line 2: not valid JSON"),
        "smaller than one sequence": (
            [f"{p}/tiny.txt"],
            {"seq_len": 64, "heldout_fraction": 0.0},
            ValueError,
            rf"training data has {tiny} tokens \(1 documents, one EOS each\), but one sequence needs seq_len=64",
        ),
        "only empty documents": (
            [f"{p}/spaces.jsonl"],
            {"heldout_fraction": 0.0},
            ValueError,
            r"has no documents with text \(3 empty, 0 undecodable skipped\)",
        ),
        "held-out split empty": (
            [f"{p}/tiny.txt"],
            {"seq_len": 2, "heldout_fraction": 0.001},
            ValueError,
            r"held-out split \(heldout_fraction=0\.001 .*\) has no documents with text",
        ),
        "no training source": ([], {}, ValueError, r"no new-domain training data: set train"),
        "hf folder missing": ([f"hf:{p}/missing"], {}, FileNotFoundError, r"hf:.*missing: no such folder"),
    }


BAD_INPUTS = [
    "missing file",
    "glob matches nothing",
    "unsupported extension",
    "a folder",
    "empty txt",
    "empty jsonl",
    "empty parquet",
    "jsonl field absent",
    "parquet column absent",
    "jsonl not an object",
    "txt not utf-8",
    "jsonl not utf-8",
    "jsonl not json",
    "smaller than one sequence",
    "only empty documents",
    "held-out split empty",
    "no training source",
    "hf folder missing",
]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_every_bad_input_has_a_clear_error_before_training(tmp_path, tok, name):
    sources, overrides, error, pattern = _bad_inputs(tmp_path, tok)[name]
    with pytest.raises(error, match=pattern):
        build_corpus(CorpusConfig(train=sources, **{"seq_len": 8, **overrides}), tok)


@pytest.mark.parametrize("name", ["missing file", "jsonl field absent", "jsonl not utf-8", "smaller than one sequence"])
def test_bad_old_domain_sets_have_the_same_errors(tmp_path, tok, name):
    good = str(write_jsonl(tmp_path / "good.jsonl", MANY))
    sources, overrides, error, pattern = _bad_inputs(tmp_path, tok)[name]
    pattern = pattern.replace("training data", "evaluation set '.*'")
    config = CorpusConfig(train=[good], old_eval=sources, **{"seq_len": 8, **overrides})
    with pytest.raises(error, match=pattern):
        build_corpus(config, tok)


def test_check_corpus_finds_unreadable_sources_without_reading_the_corpus(tmp_path, tok):
    cases = _bad_inputs(tmp_path, tok)
    for name in ("missing file", "glob matches nothing", "unsupported extension", "a folder", "empty parquet"):
        sources, _, error, pattern = cases[name]
        with pytest.raises(error, match=pattern):
            check_corpus(CorpusConfig(train=sources))
    sources, _, error, pattern = cases["jsonl field absent"]
    with pytest.raises(error, match=pattern):
        check_corpus(CorpusConfig(train=[str(write_jsonl(tmp_path / "ok.jsonl", DOCS))], old_eval=sources))
    # a bad line after the first one is left to build_corpus
    check_corpus(CorpusConfig(train=[f"{tmp_path}/latin1.jsonl"]), tok)
    no_eos = train_bpe_tokenizer(DOCS, vocab_size=300)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="tokenizer has no EOS token"):
        check_corpus(CorpusConfig(train=[f"{tmp_path}/ok.jsonl"]), no_eos)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"seq_len": 1}, "data.seq_len must be >= 2, got 1"),
        ({"on_decode_error": "ignore"}, r"on_decode_error must be one of \('error', 'skip'\)"),
        ({"heldout_fraction": 1.0}, r"heldout_fraction must be in \[0, 1\)"),
        ({"max_train_tokens": 100, "seq_len": 128}, r"data.max_train_tokens must be 0 .* or at least data.seq_len=128"),
        ({"max_eval_sequences": 0}, "data.max_eval_sequences must be >= 1, got 0"),
        ({"text_field": ""}, "text_field must name"),
    ],
)
def test_config_rejects_bad_settings(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        CorpusConfig(train=["x.jsonl"], **overrides)


def test_skip_policy_skips_and_counts_undecodable_documents(tmp_path, tok, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"text": doc}).encode() for doc in DOCS]
    path.write_bytes(
        b"\n".join([lines[0], b'{"text": "caf\xe9"}', lines[1], b'{"text": "cut', lines[2], b"", lines[3]])
    )
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "good.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "empty-text.jsonl").write_text('{"text": " "}\n', encoding="utf-8")
    stats = CorpusStats()
    source = str(tmp_path / "*")
    assert list(read_documents(source, on_decode_error="skip", stats=stats)) == [*DOCS[:1], *DOCS]
    assert (stats.skipped_decode, stats.skipped_empty) == (3, 1)
    config = CorpusConfig(train=[source], seq_len=8, heldout_fraction=0.0, on_decode_error="skip")
    with caplog.at_level(logging.WARNING, logger=corpus_module.__name__):
        corpus = build_corpus(config, tok)
    assert corpus.stats["train"].skipped_decode == 3
    assert "train: skipped 3 undecodable documents" in caplog.text
    assert "3 undecodable" in corpus.summary()[0]


# ---------------------------------------------------------------------------------------------
# Streaming


def test_streaming_yields_the_same_blocks_as_in_memory(tmp_path, tok):
    source = str(write_jsonl(tmp_path / "new.jsonl", MANY))
    for cap in (0, 8 * 30):
        settings = {"train": [source], "seq_len": 8, "heldout_fraction": 0.1, "max_train_tokens": cap}
        memory = build_corpus(CorpusConfig(**settings), tok)
        stream = build_corpus(CorpusConfig(**settings, streaming=True), tok)
        assert isinstance(stream.train, PackedStream)
        items = list(stream.train)
        assert all(torch.equal(item["input_ids"], item["labels"]) for item in items)
        assert torch.equal(torch.stack([item["input_ids"] for item in items]), memory.train.blocks)
        assert torch.equal(stream.heldout.blocks, memory.heldout.blocks)
        assert stream.stats["train"].sequences == len(memory.train) == (cap // 8 or len(items))
        again = [item["input_ids"] for item in stream.train]  # every epoch reads from the start
        assert len(again) == len(items) and torch.equal(again[-1], items[-1]["input_ids"])
        assert stream.stats["train"].documents == memory.stats["train"].documents  # counted afresh each epoch
    with pytest.raises(ValueError, match="but one sequence needs seq_len=4096"):
        build_corpus(CorpusConfig(train=[source], seq_len=4096, heldout_fraction=0.0, streaming=True), tok)


def test_streaming_over_a_hub_folder_matches_the_parquet_files(tmp_path, tok, hf_cache):
    (tmp_path / "folder").mkdir()
    write_parquet(tmp_path / "folder" / "part-0.parquet", MANY[:120])
    write_parquet(tmp_path / "folder" / "part-1.parquet", MANY[120:])
    files = build_corpus(CorpusConfig(train=[f"{tmp_path}/folder/*.parquet"], seq_len=8), tok)
    hub = build_corpus(CorpusConfig(train=[f"hf:{tmp_path}/folder"], seq_len=8, streaming=True), tok)
    assert torch.equal(torch.stack([item["input_ids"] for item in hub.train]), files.train.blocks)
    assert torch.equal(hub.heldout.blocks, files.heldout.blocks)


def test_stream_shards_blocks_across_dataloader_workers(tok, monkeypatch):
    stream = PackedStream(lambda stats: iter(MANY[:40]), tok, 8)
    everything = [item["input_ids"] for item in stream]
    shards = []
    for worker in (0, 1):
        monkeypatch.setattr(corpus_module, "get_worker_info", lambda w=worker: SimpleNamespace(num_workers=2, id=w))
        shards.append([item["input_ids"] for item in stream])
    assert len(shards[0]) + len(shards[1]) == len(everything) > 2
    assert torch.equal(torch.stack(shards[0]), torch.stack(everything[0::2]))
    assert torch.equal(torch.stack(shards[1]), torch.stack(everything[1::2]))


# ---------------------------------------------------------------------------------------------
# CLI


def test_config_fields_become_command_line_options():
    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, CorpusConfig(), prefix="corpus.")
    args = parser.parse_args(
        ["--corpus.train", "a.jsonl", "data/*.txt", "--corpus.seq_len", "128", "--corpus.streaming", "true"]
    )
    config = CorpusConfig(**nest(vars(args).items())["corpus"])
    assert config.train == ["a.jsonl", "data/*.txt"] and config.seq_len == 128 and config.streaming is True
