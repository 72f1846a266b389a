"""`scale-cl eval`: lm-evaluation-harness on saved checkpoints, offline, with the local tasks in tests/fixtures.

The base model is a tiny Llama (tied embeddings, GQA 2:1, like Llama-3.2-1B) with a BPE tokenizer
trained on the task texts, briefly trained so that it answers the multiple-choice questions better
than chance. A SCALE-Preserve checkpoint computes the base function exactly (Theorem 3.1), so every
lm-eval number, accuracies and loglikelihood-based perplexities alike, must equal the base's.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

pytest.importorskip("lm_eval")

from scale_cl.cli import main
from scale_cl.data.tokenizer import EOS_TOKEN, train_bpe_tokenizer
from scale_cl.eval.harness import (
    PAPER_METRICS,
    TASK_PRESETS,
    UnknownTaskError,
    check_tasks,
    evaluate,
    expand_tasks,
    format_markdown,
    plain_results,
)
from scale_cl.methods import prepare
from scale_cl.models import BaseModelRef, load_trained, save_trained
from tests.conftest import tiny_llama_config
from tests.exactness import assert_exact_to_rounding

TASKS_DIR = Path(__file__).parents[1] / "fixtures" / "lm_eval_tasks"
TASKS = ["scale_cl_tiny"]  # a group: a multiple-choice task and a perplexity task, with an aggregate acc
FAST = ["--batch-size", "4", "--device", "cpu", "--bootstrap-iters", "1000"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Offline hub/datasets, and any socket connection attempt is recorded and refused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"network access in a test: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield
    assert not attempts, f"the evaluation tried to reach the network: {attempts}"


def _texts() -> list[str]:
    rows = [json.loads(line) for line in (TASKS_DIR / "tiny_mc.jsonl").read_text().splitlines()]
    qa = [f"Question: {r['question']}\nAnswer: {r['choices'][r['label']]}" for r in rows]
    text = [json.loads(line)["text"] for line in (TASKS_DIR / "tiny_text.jsonl").read_text().splitlines()]
    return qa + text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Folders: ``base`` (HF model + tokenizer), ``scale`` (scale_preserve, random new weights), ``lora``."""
    root = tmp_path_factory.mktemp("harness")
    texts = _texts()
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    # A few steps on the answers, so that accuracy is not at chance (an exact-equality check of a
    # trained model's scores says more than of a random one's).
    batch = tokenizer([EOS_TOKEN + t for t in texts], padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-2)
    base.train()
    for _ in range(30):
        loss = base(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    base.eval()
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    ref = BaseModelRef(str(root / "base"))

    # hidden_up = head_dim * GQA group; new W21/W22/E_up/norms random (svd/zero defaults + noise),
    # W12 and the head's new columns zero: the base function exactly (Theorem 3.1).
    scale = prepare(LlamaForCausalLM.from_pretrained(root / "base"), "scale_preserve", hidden_up=32, ffn_up=32)
    with torch.no_grad():
        for name, param in scale.named_parameters():
            if param.requires_grad and "lm_head" not in name and not name.endswith("w12"):
                param.add_(0.2 * torch.randn_like(param))
    save_trained(scale, tokenizer, "scale_preserve", ref, root / "scale")

    lora = prepare(LlamaForCausalLM.from_pretrained(root / "base"), "lora", rank=4)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)  # B = 0 at init would make it the base model
    save_trained(lora, tokenizer, "lora", ref, root / "lora")
    return root


@pytest.fixture(scope="module")
def base_scores(runs) -> dict:
    model, tokenizer = LlamaForCausalLM.from_pretrained(runs / "base"), AutoTokenizer.from_pretrained(runs / "base")
    return _values(evaluate(model, tokenizer, TASKS, include_path=TASKS_DIR, bootstrap_iters=0))


@pytest.fixture(scope="module")
def exact_base_scores(runs) -> dict:
    """The base's scores with the model in float64: what each fp32 evaluation of the base function rounds away from."""
    model, tokenizer = LlamaForCausalLM.from_pretrained(runs / "base"), AutoTokenizer.from_pretrained(runs / "base")
    return _values(evaluate(model, tokenizer, TASKS, include_path=TASKS_DIR, bootstrap_iters=0, dtype=torch.float64))


def _assert_scores_as(scores: dict, exact: dict, stock: dict) -> None:
    """Every score as close to ``exact`` (the float64 model's) as ``stock`` (the stock fp32 model's): accuracies
    equal, loglikelihood-based numbers to rounding. Each is a Python float of fp32 loglikelihoods, compared as fp32
    (its rounding to fp32, half an epsilon, is inside the floor)."""
    assert scores.keys() == exact.keys() == stock.keys()
    for task, metrics in exact.items():
        assert scores[task].keys() == metrics.keys() == stock[task].keys(), task
        for metric, value in metrics.items():
            got, want = torch.tensor(scores[task][metric]), torch.tensor(value, dtype=torch.float64)
            assert_exact_to_rounding(got, want, stock=torch.tensor(stock[task][metric]), what=f"{task} {metric}")


def _cli(argv: list[str]) -> int:
    return main(["eval", *argv])


def _values(results: dict) -> dict:
    return {task: {m: v["value"] for m, v in metrics.items()} for task, metrics in results["results"].items()}


@pytest.mark.slow
@pytest.mark.exactness
def test_an_exported_folder_is_taken_as_the_base(runs, base_scores, exact_base_scores, tmp_path):
    """``eval --base EXPORTED``: scale-cl's own export loads with its modeling code; SCALE-Preserve's export computes
    the base function (up to the rounding of its merged products), so it scores as the base does."""
    assert main(["export", str(runs / "scale"), str(tmp_path / "export")]) == 0
    out = tmp_path / "scores.json"
    assert _cli(["--base", str(tmp_path / "export"), "--out", str(out), "--tasks", *TASKS,
                 "--include-path", str(TASKS_DIR), *FAST]) == 0  # fmt: skip
    _assert_scores_as(_values(json.loads(out.read_text())), exact_base_scores, base_scores)


@pytest.mark.slow
def test_scale_preserve_checkpoint_scores_exactly_as_its_base(runs, capsys):
    common = ["--tasks", *TASKS, "--include-path", str(TASKS_DIR), *FAST]
    assert _cli([str(runs / "scale"), *common]) == 0
    table = capsys.readouterr().out
    assert _cli(["--base", str(runs / "base"), "--out", str(runs / "base.json"), *common]) == 0

    scale = json.loads((runs / "scale" / "eval.json").read_text())
    base = json.loads((runs / "base.json").read_text())
    assert scale["model"]["method"] == "scale_preserve" and base["model"]["method"] == "base"
    assert set(scale["results"]) == {"scale_cl_tiny", "scale_cl_tiny_mc", "scale_cl_tiny_ppl"}
    assert scale["groups"] == {"scale_cl_tiny": ["scale_cl_tiny_mc", "scale_cl_tiny_ppl"]}
    assert scale["top_level"] == ["scale_cl_tiny"]  # what the table shows; the subtasks are in the JSON
    mc, ppl = scale["results"]["scale_cl_tiny_mc"], scale["results"]["scale_cl_tiny_ppl"]
    assert set(mc) == {"acc", "acc_norm"} and set(ppl) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert mc["acc"]["stderr"] > 0 and ppl["byte_perplexity"]["stderr"] is None  # lm-eval's "N/A"
    assert scale["n_samples"]["scale_cl_tiny_mc"]["effective"] == 8

    # Theorem 3.1 through lm-eval: every accuracy and every loglikelihood-based number, bit for bit.
    assert _values(scale) == _values(base)
    assert base["results"]["scale_cl_tiny_mc"]["acc"]["value"] >= 0.5  # the base learnt something: not chance
    assert "| scale_cl_tiny |" in table and "± stderr" in table


@pytest.mark.slow
def test_changed_function_changes_the_scores(runs):
    """The control: with a non-zero W_out_up the upscaled model is no longer the base, and lm-eval sees it."""
    model, tokenizer, method = load_trained(runs / "scale")
    before = evaluate(model, tokenizer, ["scale_cl_tiny_ppl"], include_path=TASKS_DIR, bootstrap_iters=0)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight_up.normal_(0.0, 0.5)
    after = evaluate(model, tokenizer, ["scale_cl_tiny_ppl"], include_path=TASKS_DIR, bootstrap_iters=0)
    assert method == "scale_preserve"
    ppl = "scale_cl_tiny_ppl"
    assert before["results"][ppl]["byte_perplexity"]["value"] != after["results"][ppl]["byte_perplexity"]["value"]
    assert before["settings"]["lm_eval_version"] and after["tasks"] == [ppl]


@pytest.mark.slow
@pytest.mark.exactness
def test_lora_checkpoint_evaluates_merged_or_not(runs, base_scores, tmp_path):
    """Merged into the base's weights, the adapter computes its function to rounding: as close to the unmerged model's
    float64 scores as the unmerged fp32 model's are."""
    common = ["--tasks", *TASKS, "--include-path", str(TASKS_DIR), *FAST]
    assert _cli([str(runs / "lora"), "--out", str(tmp_path / "lora.json"), *common]) == 0
    assert _cli([str(runs / "lora"), "--merge-lora", "--out", str(tmp_path / "merged.json"), *common]) == 0
    lora, merged = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("lora", "merged"))
    assert lora["model"]["method"] == "lora" and merged["settings"]["merge_lora"] is True
    ppl = "scale_cl_tiny_ppl"
    model, tokenizer, _ = load_trained(runs / "lora")
    exact = evaluate(model, tokenizer, [ppl], include_path=TASKS_DIR, bootstrap_iters=0, dtype=torch.float64)
    _assert_scores_as(*({ppl: _values(r)[ppl]} for r in (merged, exact, lora)))
    assert lora["results"][ppl]["bits_per_byte"]["value"] != base_scores[ppl]["bits_per_byte"]  # the adapter applies


@pytest.mark.slow
def test_unknown_task_is_refused_with_close_matches(runs, capsys):
    status = _cli([str(runs / "scale"), "--tasks", "english", "scale_cl_tiny_mcc", "arc_chalenge", *_include()])
    err = capsys.readouterr().err
    assert status == 2
    assert "'scale_cl_tiny_mcc': did you mean scale_cl_tiny_mc" in err
    assert "'arc_chalenge': did you mean arc_challenge" in err
    assert "lm-eval ls tasks" in err and "english" in err
    with pytest.raises(UnknownTaskError, match="kobest_bolq"):
        check_tasks(["kobest_bolq"], include_path=TASKS_DIR)


def _include() -> list[str]:
    return ["--include-path", str(TASKS_DIR)]


@pytest.mark.slow
def test_clear_errors_for_bad_model_arguments(runs, tmp_path, capsys):
    assert _cli([str(tmp_path / "missing"), "--tasks", "scale_cl_tiny_mc", *_include()]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _cli([str(runs / "base"), "--tasks", "scale_cl_tiny_mc", *_include()]) == 2
    assert "scale_cl_run.json is missing" in capsys.readouterr().err
    assert _cli([str(runs / "scale"), "--base", str(runs / "base"), "--tasks", "arc_easy"]) == 2
    assert "either MODEL_DIR" in capsys.readouterr().err
    assert _cli(["--tasks", "scale_cl_tiny_mc", str(runs / "scale")]) == 2
    assert "put MODEL_DIR before --tasks" in capsys.readouterr().err
    assert _cli([str(runs / "scale")]) == 2
    assert "--tasks is required" in capsys.readouterr().err
    assert _cli([str(runs / "scale"), "--tasks", "arc_easy", "--include-path", str(tmp_path / "nope")]) == 2
    assert "not a folder of lm-eval task YAML" in capsys.readouterr().err


@pytest.mark.slow
def test_presets_are_lm_eval_task_names():
    assert expand_tasks(["english", "korean,arc_easy", "hellaswag"]) == [
        *TASK_PRESETS["english"],
        *TASK_PRESETS["korean"],
        "arc_easy",
    ]
    assert TASK_PRESETS["english"] == ("arc_challenge", "hellaswag", "mmlu", "truthfulqa_mc2", "winogrande")
    # every preset name exists in this lm-eval (same include path as the other tests: the index is cached)
    assert check_tasks(expand_tasks(["english", "korean"]), include_path=TASKS_DIR)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "english"], "give either MODEL_DIR"),
        (["{missing}", "--tasks", "english"], "MODEL_DIR {missing} does not exist"),
        (["{missing}", "--base", "smollm2", "--tasks", "english"], "give either MODEL_DIR"),
        (["--base", "smollm2"], "--tasks is required"),
        (["--base", "smollm2", "--tasks", "english", "--batch-size", "0"], "--batch_size must be a positive integer"),
        (["--base", "smollm2", "--tasks", "english", "--limit", "-1"], "limit must be > 0, got -1.0"),
        (["--base", "smollm2", "--config", "{yaml}", "--limit", "5"], "--batch_size must be a positive integer"),
        (["--base", "smollm2", "--tasks", "english", "--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_settings_exit_2_before_any_model_is_loaded(argv, message, tmp_path, capsys):
    yaml = tmp_path / "eval.yaml"
    yaml.write_text("tasks: [english]\nbatch_size: none\n")
    status = _cli([a.format(missing=tmp_path / "missing", yaml=yaml) for a in argv])
    assert status == 2
    assert f"scale-cl eval: error: {message.format(missing=tmp_path / 'missing')}" in capsys.readouterr().err


def test_markdown_table_lists_top_level_names_and_paper_metrics():
    results = {
        "top_level": ["mmlu", "arc_challenge"],
        "results": {
            "mmlu": {"acc": {"value": 0.3676, "stderr": 0.004}},
            "mmlu_anatomy": {"acc": {"value": 0.3, "stderr": 0.04}},
            "arc_challenge": {"acc": {"value": 0.31, "stderr": 0.01}, "acc_norm": {"value": 0.366, "stderr": None}},
        },
        "paper_metrics": {"arc_challenge": {"metric": "acc_norm", "value": 0.366, "stderr": None}},
        "averages": {},
    }
    table = format_markdown(results)
    assert "| mmlu | acc | 0.3676 | 0.0040 |" in table and "mmlu_anatomy" not in table
    assert "|  | acc_norm | 0.3660 |  |" in table
    assert "1 subtasks" in table and "| arc_challenge | acc_norm | 36.60 |" in table


def test_paper_metrics_and_preset_averages_from_lm_eval_output():
    """lm-eval's raw output shape -> the paper's Table 2 columns, and a preset's average only when complete."""
    english = TASK_PRESETS["english"]
    raw = {
        "results": {
            name: {
                "alias": name,
                "acc,none": 0.5,
                "acc_stderr,none": 0.01,
                "acc_norm,none": 0.6,
                "acc_norm_stderr,none": "N/A",
            }
            for name in english
        },
        "group_subtasks": {"mmlu": ["mmlu_anatomy"]},
        "n-samples": {"hellaswag": {"original": 10042, "effective": 10042}},
    }
    raw["results"]["mmlu_anatomy"] = {"alias": " - anatomy", "acc,none": 0.4, "acc_stderr,none": 0.04}
    raw["results"]["winogrande"]["exact_match,strict-match"] = float("nan")
    out = plain_results(raw, list(english))
    assert out["results"]["arc_challenge"]["acc_norm"] == {"value": 0.6, "stderr": None}
    assert out["results"]["winogrande"]["exact_match,strict-match"] == {"value": None, "stderr": None}
    assert "mmlu_anatomy" not in out["top_level"] and "mmlu" in out["top_level"]
    expected = {n: 0.6 if PAPER_METRICS[n] == "acc_norm" else 0.5 for n in english}
    assert {n: e["value"] for n, e in out["paper_metrics"].items()} == expected
    assert out["averages"] == {"english": pytest.approx(sum(expected.values()) / 5)}
    json.dumps(out, allow_nan=False)  # plain JSON
    del raw["results"]["mmlu"]
    assert "english" not in plain_results(raw, list(english))["averages"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("scale_adapt", {"hidden_up": 32, "ffn_up": 32, "preserve_layers": 1}),
        ("scale_route", {"hidden_up": 32, "ffn_up": 32, "preserve_layers": 1}),
        ("fft", {}),
        ("freeze", {"layers": 1}),
        ("llama_pro", {"blocks": 1}),
    ],
)
def test_every_method_saved_before_training_scores_as_its_base(runs, base_scores, tmp_path, method, options):
    """Each method starts from the base function (W12 = 0, identity blocks, ...): save, reload, evaluate."""
    model = prepare(LlamaForCausalLM.from_pretrained(runs / "base"), method, **options)
    save_trained(
        model, AutoTokenizer.from_pretrained(runs / "base"), method, BaseModelRef(str(runs / "base")), tmp_path
    )
    loaded, tokenizer, loaded_method = load_trained(tmp_path)
    got = evaluate(loaded, tokenizer, TASKS, include_path=TASKS_DIR, bootstrap_iters=0)
    assert loaded_method == method
    assert _values(got) == base_scores


@pytest.mark.slow
def test_a_finished_cpt_method_folder_is_evaluated_as_export_takes_it(runs, tmp_path):
    """`scale-cl export` takes <out>/<method> (holding model/); eval takes the same folder."""
    import shutil

    shutil.copytree(runs / "scale", tmp_path / "scale_preserve" / "model")
    assert (
        _cli(
            [str(tmp_path / "scale_preserve"), "--tasks", "scale_cl_tiny_ppl", "--include-path", str(TASKS_DIR), *FAST]
        )
        == 0
    )
    assert json.loads((tmp_path / "scale_preserve" / "model" / "eval.json").read_text())["model"]["method"] == (
        "scale_preserve"
    )
