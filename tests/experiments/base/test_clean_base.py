"""The clean English base (`scale-cl base`): built deterministically and once, refuses bad input before writing,
named by ``--model clean-en``, and the CPT sweep over seeds on it (its micro variant, same code path)."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from scale_cl.experiments.base.build import INFO_FILE, build_base
from scale_cl.experiments.base.config import preset
from scale_cl.experiments.base.name import CLEAN_EN, resolve_model_name
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

ENGLISH = [topics[key] for key in sorted(topics)[:30]]  # the Python docs' own English, shipped with every CPython


def hangul_documents(seed: int, count: int) -> list[str]:
    """Korean-script text (random syllables): a new script for an English-only tokenizer."""
    rng = random.Random(seed)
    word = lambda: "".join(chr(0xAC00 + rng.randrange(0, 400)) for _ in range(rng.randint(1, 3)))  # noqa: E731
    return [" ".join(word() for _ in range(rng.randint(30, 60))) + "." for _ in range(count)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return path


def micro(train: list[str], **changes) -> object:
    cfg = preset("micro")
    return replace(cfg, data=replace(cfg.data, train=train), **changes)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clean")
    write_jsonl(root / "en.jsonl", ENGLISH)
    write_jsonl(root / "ko.jsonl", hangul_documents(0, 120))
    return root


@pytest.fixture(scope="module")
def micro_base(corpora) -> Path:
    return build_base(micro([str(corpora / "en.jsonl")]), corpora / "base")


def test_micro_base_is_a_llama_with_gqa_and_tied_embeddings_saved_as_an_hf_folder(micro_base):
    model = AutoModelForCausalLM.from_pretrained(micro_base)
    config = model.config
    assert isinstance(config, LlamaConfig)
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.hidden_act == "silu"  # SwiGLU
    tokenizer = AutoTokenizer.from_pretrained(micro_base)
    assert len(tokenizer) == config.vocab_size == preset("micro").model.vocab_size
    info = json.loads((micro_base / INFO_FILE).read_text())
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["final"]["step"] == preset("micro").train.max_steps
    assert 1 < info["final"]["heldout_ppl"] < len(tokenizer)  # trained: better than uniform over the vocabulary


def test_english_only_tokenizer_makes_hangul_cost_more_tokens_per_character(micro_base):
    tokenizer = AutoTokenizer.from_pretrained(micro_base)
    english, korean = ENGLISH[0][:2000], hangul_documents(1, 1)[0]

    def per_char(text: str) -> float:
        return len(tokenizer(text)["input_ids"]) / len(text)

    assert per_char(korean) > 2 * per_char(english)


def test_build_is_deterministic(corpora, micro_base, tmp_path):
    again = build_base(micro([str(corpora / "en.jsonl")]), tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (micro_base / name).read_bytes(), name


def test_built_base_is_reused_not_rebuilt(corpora, micro_base, monkeypatch):
    from scale_cl.train.trainer import CheckpointingTrainer

    before = (micro_base / "model.safetensors").stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("a built base was trained again")

    monkeypatch.setattr(CheckpointingTrainer, "train", refuse)
    assert build_base(micro([str(corpora / "en.jsonl")]), micro_base.parent) == micro_base
    assert (micro_base / "model.safetensors").stat().st_mtime_ns == before


def test_built_base_folder_refuses_other_settings(corpora, micro_base):
    cfg = micro([str(corpora / "en.jsonl")])
    with pytest.raises(ValueError, match="another configuration"):
        build_base(replace(cfg, train=replace(cfg.train, max_steps=13)), micro_base.parent)


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (None, "no English text given"),
        (["   ", ""], "no English text found"),
        (hangul_documents(2, 20), "not English"),
        (["The cat sat on the mat."], "too little text"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, texts, message):
    train = [] if texts is None else [str(write_jsonl(tmp_path / "in.jsonl", texts))]
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        build_base(micro(train), out)
    assert not out.exists()


@pytest.mark.slow
def test_cli_bad_input_exits_2_with_the_reason(tmp_path):
    korean = write_jsonl(tmp_path / "ko.jsonl", hangul_documents(3, 20))
    result = subprocess.run(
        [sys.executable, "-m", "scale_cl.cli", "base", "--preset", "micro", "--data.train", str(korean),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert "not English" in result.stderr
    assert not (tmp_path / "out").exists()


def test_model_name_clean_en_names_the_built_base_or_says_how_to_build_it(micro_base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="scale-cl base"):
        resolve_model_name(CLEAN_EN)
    target = tmp_path / "outputs" / "clean-en" / "model"
    target.parent.mkdir(parents=True)
    target.symlink_to(micro_base, target_is_directory=True)
    assert Path(resolve_model_name(CLEAN_EN)) == target.resolve()


def test_scale_preserves_the_clean_base_exactly(micro_base):
    """Theorem 3.1 on the base the clean benchmark uses (GQA, tied embeddings): every SCALE method."""
    from scale_cl import prepare
    from scale_cl.tuner.config import ScaleConfig

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(micro_base).eval()
    with torch.no_grad():
        expected = base(ids).logits
        exact = copy.deepcopy(base).double()(ids).logits
    for method in ("preserve", "adapt", "route"):
        model = prepare(
            AutoModelForCausalLM.from_pretrained(micro_base),
            f"scale_{method}",
            scale=ScaleConfig(hidden_up=16, ffn_up=16, method=method, preserve_layers=1),
        ).eval()
        with torch.no_grad():
            logits = model(ids).logits
        assert_exact_to_rounding(logits[..., : expected.shape[-1]], exact, stock=expected, what=f"scale_{method}")


@pytest.mark.slow
def test_cpt_sweep_over_seeds_on_the_micro_base(corpora, micro_base, tmp_path):
    """2 methods x 2 rates x 2 seeds: every seed's metrics kept, spreads in the tables, error bars in the figure;
    a seed added later runs only its own runs."""
    from scale_cl.cli import main

    out = tmp_path / "sweep"
    argv = [
        "sweep", "cpt", "--model", str(micro_base), "--methods", "fft", "scale_route", "--lr_scales", "1", "4",
        "--seeds", "0", "1", "--out", str(out),
        "--data.train", str(corpora / "ko.jsonl"), "--data.old_eval", f"en={corpora / 'en.jsonl'}",
        "--data.seq_len", "32", "--data.heldout_fraction", "0.1", "--data.max_eval_sequences", "4",
        "--train.lr", "1e-3", "--train.scale_route_lr", "3e-3", "--train.max_steps", "6", "--train.batch_size", "4",
        "--train.micro_batch_size", "4", "--train.save_every", "0", "--train.warmup_ratio", "0",
        "--eval.every", "3", "--eval.batch_size", "4", "--eval.representation_sequences", "2",
        "--options.scale.hidden_up", "16", "--options.scale.ffn_up", "16", "--options.scale.preserve_layers", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    points = sorted((out / "points").glob("*/point.json"))
    assert len(points) == 4
    for path in points:
        record = json.loads(path.read_text())
        assert sorted(record["seeds"]) == ["0", "1"]
        for seed, metrics in record["seeds"].items():
            result = json.loads((path.parent / f"seed-{seed}" / record["method"] / "result.json").read_text())
            assert metrics["learning"] == result["curve"][-1]["learning_ppl"]
        means = {k: sum(m[k] for m in record["seeds"].values()) / 2 for k in record["metrics"]}
        assert means == pytest.approx(record["metrics"])
        assert record["seeds"]["0"] != record["seeds"]["1"]  # the seed changes initialisation and data order
    results = json.loads((out / "results.json").read_text())
    assert results["seeds"] == [0, 1]
    text = (out / "results.md").read_text()
    assert "±" in text and "Representation drift" in text
    assert (out / "landscape.png").stat().st_size > 0 and (out / "drift.png").stat().st_size > 0
    drift = {(r["method"], r["step"]): r for r in results["drift"]}
    fft_preset = out / "points" / "fft__lr=0.001"  # x1 of --train.lr: the drift figure's run
    ends = [json.loads((fft_preset / f"seed-{s}" / "fft" / "result.json").read_text())["curve"][-1] for s in (0, 1)]
    assert drift[("fft", 6)]["mean"] == pytest.approx(sum(e["representation_similarity"] for e in ends) / 2)
    # one more seed: only its runs are trained; the earlier seeds' are read
    fft = next(p.parent for p in points if json.loads(p.read_text())["method"] == "fft")
    before = (fft / "seed-0" / "fft" / "result.json").stat().st_mtime_ns
    assert main([*argv, "--seeds", "0", "1", "2"]) == 0
    assert (fft / "seed-0" / "fft" / "result.json").stat().st_mtime_ns == before
    for path in points:
        assert sorted(json.loads(path.read_text())["seeds"]) == ["0", "1", "2"]
        assert (path.parent / "seed-2").is_dir()
