"""Text corpora for continual pre-training: sources read by datasets, packing, held-out split, caps, errors, the token
cache, weighted mixing, streaming, document masking."""

from __future__ import annotations

import argparse
import copy
import gzip
import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import default_data_collator

from scale_cl.cli.options import add_dataclass_options
from scale_cl.data import tokens as tokens_module
from scale_cl.data.corpus import (
    Blocks,
    CorpusConfig,
    HubSource,
    PackedDataset,
    build_corpus,
    check_corpus,
    eval_sets,
    is_heldout,
    is_stream,
    pack,
    parse_hub_source,
    read_documents,
    split_documents,
)
from scale_cl.data.packing import BlockCutter, document_positions
from scale_cl.data.tokenizer import train_bpe_tokenizer
from scale_cl.experiments.overrides import nest
from tests.exactness import assert_exact_to_rounding

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


def write_jsonl_gz(path, docs):
    with gzip.open(path, "wt", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    return path


def test_every_file_format_reads_the_same_documents(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    sources = {
        "txt": str(write_txts(tmp_path / "txt", DOCS) / "*.txt"),
        "jsonl": str(write_jsonl(tmp_path / "docs.jsonl", DOCS)),
        "jsonl.gz": str(write_jsonl_gz(tmp_path / "docs.jsonl.gz", DOCS)),
        "parquet": str(write_parquet(tmp_path / "docs.parquet", DOCS)),
        "arrow": str(arrow),
        "save_to_disk folder": str(tmp_path / "saved"),
        "jsonl-body": str(write_jsonl(tmp_path / "body.jsonl", DOCS, field="body")),
    }
    for name, source in sources.items():
        field = "body" if name == "jsonl-body" else "text"
        assert list(read_documents(source, text_field=field)) == DOCS, name
        assert list(read_documents(source, text_field=field, streaming=True)) == DOCS, name


def test_a_txt_file_is_split_as_the_option_says_and_a_single_file_is_never_one_document(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("First paragraph,\nstill the first.\n\nSecond paragraph.\n\nThird.\n", encoding="utf-8")
    lines = tmp_path / "lines.txt"
    lines.write_text("one document\nanother document\na third\n", encoding="utf-8")
    assert list(read_documents(str(book), txt_documents="file")) == [book.read_text()]
    assert list(read_documents(str(book), txt_documents="paragraph")) == [
        "First paragraph,\nstill the first.",
        "Second paragraph.",
        "Third.\n",
    ]
    assert list(read_documents(str(book), txt_documents="line")) == [
        "First paragraph,",
        "still the first.",
        "Second paragraph.",
        "Third.",
    ]
    # auto: a single file by paragraph when it has a blank line, else by line; several files: one document each
    assert list(read_documents(str(book))) == list(read_documents(str(book), txt_documents="paragraph"))
    assert list(read_documents(str(lines))) == ["one document", "another document", "a third"]
    assert list(read_documents(f"{tmp_path}/*.txt")) == [book.read_text(), lines.read_text()]


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


def cut(docs, seq_len):
    cutter = BlockCutter(seq_len)
    return [block.tolist() for doc in docs for block in cutter.add(np.array(doc, dtype=np.int64))]


def test_the_cutter_concatenates_and_drops_the_remainder():
    docs = [[1, 2, 9], [3, 9], [4, 5, 6, 9]]  # 9 = EOS, already appended
    assert cut(docs, 4) == [[1, 2, 9, 3], [9, 4, 5, 6]]  # [9] left over: dropped
    assert cut(docs, 3) == [[1, 2, 9], [3, 9, 4], [5, 6, 9]]
    assert cut(docs, 10) == []
    assert cut([[7] * 7], 3) == [[7] * 3, [7] * 3]  # one long document spans blocks


def test_pack_puts_eos_after_every_document_and_cuts_exact_blocks(tok):
    stream = token_stream(tok, DOCS)
    seq_len = 16
    assert len(stream) % seq_len, "the test needs a remainder to drop"
    blocks = pack(DOCS, tok, seq_len)
    full = len(stream) // seq_len
    assert blocks.dtype == torch.long and blocks.shape == (full, seq_len)
    assert blocks.flatten().tolist() == stream[: full * seq_len]
    assert (blocks == tok.eos_token_id).sum().item() == stream[: full * seq_len].count(tok.eos_token_id) >= 3
    assert torch.equal(pack(DOCS, tok, seq_len, max_sequences=2), blocks[:2])


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


def test_a_cap_keeps_the_first_blocks(tmp_path, tok):
    source = write_jsonl(tmp_path / "new.jsonl", MANY)
    whole = build_corpus(CorpusConfig(train=[str(source)], seq_len=16, heldout_fraction=0.0), tok)
    config = CorpusConfig(train=[str(source)], seq_len=16, max_train_tokens=40, heldout_fraction=0.0)
    assert config.max_train_sequences == 2
    capped = build_corpus(config, tok)
    assert torch.equal(capped.train.blocks, whole.train.blocks[:2])
    assert capped.stats["train"].sequences == 2 and capped.stats["train"].documents == len(MANY)


def test_a_bad_line_anywhere_is_named_before_training(tmp_path, tok):
    source = write_jsonl(tmp_path / "new.jsonl", MANY)
    with (tmp_path / "new.jsonl").open("ab") as file:
        file.write(b'{"text": "bad \xff byte"}\n')  # the whole file is tokenised once: found
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
        "a folder": (
            [f"{p}/folder"],
            {},
            ValueError,
            r"is a folder but not one written by save_to_disk: give a glob such as .*folder/\*\.jsonl",
        ),
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
        "txt not utf-8": ([f"{p}/latin1.txt"], {}, ValueError, r"latin1\.txt line 2: not valid UTF-8.*iconv"),
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
            r"has no documents with text \(3 empty skipped\)",
        ),
        "held-out split empty": (
            [f"{p}/tiny.txt"],
            {"seq_len": 2, "heldout_fraction": 0.001},
            ValueError,
            r"held-out split \(heldout_fraction=0\.001 .*\) has no documents with text.*none of the new-domain",
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
        ({"txt_documents": "page"}, r"txt_documents must be one of \('auto', 'file', 'paragraph', 'line'\)"),
        ({"weights": [0.5]}, r"data.weights gives 1 weight\(s\) for 2 data.train source\(s\)"),
        ({"weights": [0.5, 0.6]}, r"data.weights must be positive and sum to 1, got \[0.5, 0.6\]"),
        ({"replay": ["a.jsonl"], "replay_weights": [0.2, 0.8]}, r"data.replay_weights gives 2 weight\(s\) for 1"),
        ({"shuffle_buffer": 100}, "data.shuffle_buffer shuffles a stream"),
        ({"heldout_fraction": 1.0}, r"heldout_fraction must be in \[0, 1\)"),
        ({"max_train_tokens": 100, "seq_len": 128}, r"data.max_train_tokens must be 0 .* or at least data.seq_len=128"),
        ({"max_eval_sequences": 0}, "data.max_eval_sequences must be >= 1, got 0"),
        ({"text_field": ""}, "text_field must name"),
    ],
)
def test_config_rejects_bad_settings(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        CorpusConfig(train=["x.jsonl", "y.parquet"], **overrides)


# ---------------------------------------------------------------------------------------------
# The token cache, weighted mixing


def test_blocks_are_read_from_the_cache_and_a_second_launch_reads_no_text(tmp_path, tok, hf_cache, monkeypatch):
    from datasets.packaged_modules.json import json as json_builder

    source = write_jsonl(tmp_path / "new.jsonl", MANY)
    config = CorpusConfig(train=[str(source)], seq_len=8, heldout_fraction=0.1)
    first = build_corpus(config, tok)
    assert isinstance(first.train, Blocks) and first.train.rows.cache_files, "blocks live in Arrow files on disk"
    calls = Counter()
    encode, tables = tokens_module._encode_batch, json_builder.Json._generate_tables

    def counting_encode(*args, **kwargs):
        calls["tokenised"] += 1
        return encode(*args, **kwargs)

    def counting_tables(*args, **kwargs):
        calls["json read"] += 1
        yield from tables(*args, **kwargs)

    monkeypatch.setattr(tokens_module, "_encode_batch", counting_encode)
    monkeypatch.setattr(json_builder.Json, "_generate_tables", counting_tables)
    again = build_corpus(config, tok)
    assert not calls, f"the second launch read or tokenised text: {dict(calls)}"
    assert torch.equal(again.train.blocks, first.train.blocks) and torch.equal(
        again.heldout.blocks, first.heldout.blocks
    )
    other = build_corpus(CorpusConfig(train=[str(source)], seq_len=16, heldout_fraction=0.1), tok)
    assert not calls, "another seq_len packs again from the cached tokens"
    assert len(other.train) < len(first.train)
    write_jsonl(tmp_path / "new.jsonl", MANY[:150])  # a changed file is read again
    changed = build_corpus(config, tok)
    assert calls["tokenised"] and len(changed.train) < len(first.train)


def test_sources_mixed_by_weight_draw_blocks_in_those_proportions(tmp_path, tok, hf_cache):
    import datasets

    english = [f"English text number {i} about the weather and the sea." for i in range(400)]
    numbers = [" ".join(str((i * 7 + j) % 100) for j in range(12)) for i in range(400)]
    datasets.Dataset.from_dict({"text": numbers}).save_to_disk(str(tmp_path / "numbers"))
    sources = [str(write_jsonl_gz(tmp_path / "en.jsonl.gz", english)), str(tmp_path / "numbers")]
    alone = [build_corpus(CorpusConfig(train=[s], seq_len=8, heldout_fraction=0.0), tok).train.blocks for s in sources]
    config = CorpusConfig(train=sources, weights=[0.8, 0.2], seq_len=8, heldout_fraction=0.0)
    mixed = build_corpus(config, tok, seed=3).train.blocks
    origin = Counter(next(i for i, blocks in enumerate(alone) if (blocks == row).all(-1).any()) for row in mixed)
    share = origin[0] / len(mixed)
    assert 0.72 < share < 0.88, f"source 0 gave {share:.0%} of the blocks, weight 80%"
    assert len(mixed) <= len(alone[0]) / 0.72  # it stops when a source runs out (first_exhausted)
    assert torch.equal(build_corpus(config, tok, seed=3).train.blocks, mixed), "the same seed draws the same mixture"
    assert not torch.equal(build_corpus(config, tok, seed=4).train.blocks, mixed)


# ---------------------------------------------------------------------------------------------
# Streaming


def stacked(dataset):
    return torch.stack([item["input_ids"] for item in dataset])


def test_streaming_yields_the_same_blocks_as_the_cache(tmp_path, tok):
    source = str(write_jsonl(tmp_path / "new.jsonl", MANY))
    for cap in (0, 8 * 30):
        settings = {"train": [source], "seq_len": 8, "heldout_fraction": 0.1, "max_train_tokens": cap}
        memory = build_corpus(CorpusConfig(**settings), tok)
        stream = build_corpus(CorpusConfig(**settings, streaming=True), tok)
        assert is_stream(stream.train)
        items = list(stream.train)
        assert all(torch.equal(item["input_ids"], item["labels"]) for item in items)
        assert torch.equal(stacked(items), memory.train.blocks)
        assert torch.equal(stream.heldout.blocks, memory.heldout.blocks)
        assert torch.equal(stacked(stream.train), stacked(items)), "every epoch reads from the start"
    with pytest.raises(ValueError, match="but one sequence needs seq_len=4096"):
        build_corpus(CorpusConfig(train=[source], seq_len=4096, heldout_fraction=0.0, streaming=True), tok)


def test_streaming_over_a_hub_folder_matches_the_parquet_files(tmp_path, tok, hf_cache):
    (tmp_path / "folder").mkdir()
    write_parquet(tmp_path / "folder" / "part-0.parquet", MANY[:120])
    write_parquet(tmp_path / "folder" / "part-1.parquet", MANY[120:])
    files = build_corpus(CorpusConfig(train=[f"{tmp_path}/folder/*.parquet"], seq_len=8), tok)
    hub = build_corpus(CorpusConfig(train=[f"hf:{tmp_path}/folder"], seq_len=8, streaming=True), tok)
    config = CorpusConfig(train=[f"{tmp_path}/folder/part-{i}.parquet" for i in (0, 1)], seq_len=8)
    held = split_documents(config, "heldout")
    train = [[d for d in split_documents(replace(config, train=[file]), "train")] for file in config.train]
    assert torch.equal(stacked(hub.train), torch.cat([pack(docs, tok, 8) for docs in train])), "each file apart"
    assert torch.equal(hub.heldout.blocks, files.heldout.blocks) and torch.equal(
        hub.heldout.blocks, pack(list(held), tok, 8, 64)
    )


def test_a_shuffle_buffer_reorders_the_blocks_by_seed_and_epoch(tmp_path, tok):
    sources = [str(write_jsonl(tmp_path / f"part{i}.jsonl", MANY[i * 50 : (i + 1) * 50])) for i in range(4)]
    plain = build_corpus(CorpusConfig(train=sources, seq_len=8, heldout_fraction=0.0, streaming=True), tok).train
    config = CorpusConfig(train=sources, seq_len=8, heldout_fraction=0.0, streaming=True, shuffle_buffer=16)
    shuffled = build_corpus(config, tok, seed=1).train
    first = stacked(shuffled)
    assert not torch.equal(first, stacked(plain))
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, stacked(plain).tolist())), "the same blocks"
    assert torch.equal(stacked(build_corpus(config, tok, seed=1).train), first), "the seed fixes the order"
    shuffled.set_epoch(1)
    assert not torch.equal(stacked(shuffled), first), "each epoch draws its own order"


@pytest.mark.slow
def test_dataloader_workers_each_read_their_own_files(tmp_path, tok):
    from torch.utils.data import DataLoader

    sources = [str(write_jsonl(tmp_path / f"part{i}.jsonl", MANY[i * 50 : (i + 1) * 50])) for i in range(4)]
    stream = build_corpus(CorpusConfig(train=sources, seq_len=8, heldout_fraction=0.0, streaming=True), tok).train
    seen = [item["input_ids"] for item in DataLoader(stream, batch_size=None, num_workers=2)]
    apart = torch.cat([pack(MANY[i * 50 : (i + 1) * 50], tok, 8) for i in range(4)])  # each worker packs its own files
    assert sorted(map(tuple, torch.stack(seen).tolist())) == sorted(map(tuple, apart.tolist()))


# ---------------------------------------------------------------------------------------------
# Document masking


def test_document_positions_restart_after_every_eos():
    ids = torch.tensor([[5, 6, 9, 7, 9, 8, 8, 8], [9, 1, 2, 3, 4, 9, 9, 5]])
    assert document_positions(ids, 9).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 0]]


def _masked_block(tmp_path, tok):
    """(a tiny Llama, two blocks of the corpus with ``document_mask`` as its collator gives them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()
    source = write_jsonl(tmp_path / "new.jsonl", MANY[:20])
    corpus = build_corpus(CorpusConfig(train=[str(source)], seq_len=24, heldout_fraction=0.0, document_mask=True), tok)
    return model, corpus.collator([corpus.train[1], corpus.train[2]])


def _documents(row: torch.Tensor, eos: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a block: each ends with its EOS (the block's last may be cut)."""
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == eos and i + 1 < len(row)]
    assert ends, "the test needs a block that holds a document boundary"
    return list(zip([0, *ends], [*ends, len(row)], strict=True))


def _assert_each_document_alone(model, ids: torch.Tensor, logits: torch.Tensor, eos: int) -> None:
    """``logits`` (of the masked block ``ids``) as close to each document's float64 logits alone as its fp32 logits
    alone (the stock computation: no mask, no other document) are."""
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        for b, row in enumerate(ids):
            for start, end in _documents(row, eos):
                alone = row[start:end].unsqueeze(0)
                stock, exact = model(input_ids=alone).logits[0], exact_model(input_ids=alone).logits[0]
                assert_exact_to_rounding(logits[b, start:end], exact, stock=stock, what=f"row {b} [{start}:{end}]")


@pytest.mark.exactness
def test_a_document_masked_block_computes_each_document_as_if_alone(tmp_path, tok):
    model, batch = _masked_block(tmp_path, tok)
    assert set(batch) == {"input_ids", "labels", "position_ids", "use_cache"} and batch["use_cache"] is False
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        unmasked = model(input_ids=batch["input_ids"]).logits
    _assert_each_document_alone(model, batch["input_ids"], logits, tok.eos_token_id)
    ends = _documents(batch["input_ids"][-1], tok.eos_token_id)[0][1]
    assert not torch.allclose(unmasked[:, ends:], logits[:, ends:], atol=1e-3), "without it, blocks attend across"


@pytest.mark.exactness
def test_a_document_boundary_one_token_off_is_outside_the_bound(tmp_path, tok):
    """The mutation: positions that restart at each EOS instead of after it (`document_positions` off by one: the EOS
    opens the next document), so each document after the first attends to the previous one's EOS and the EOS's own
    logits see none of its document. The bound that holds the right positions must refuse it."""
    model, batch = _masked_block(tmp_path, tok)
    ids, eos = batch["input_ids"], tok.eos_token_id
    index = torch.arange(ids.shape[1]).expand_as(ids)
    starts = ids == eos
    starts[:, 0] = True
    off_by_one = index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    assert not torch.equal(off_by_one, batch["position_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=off_by_one, use_cache=False).logits
    with pytest.raises(AssertionError, match="from the float64 reference"):
        _assert_each_document_alone(model, ids, logits, eos)


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
