"""`scale-cl train`: one method on a real corpus. Help and the dry run, a run that mixes three kinds of source and
leaves a model that eval and export take, a killed run resumed bitwise (on the cache and streamed), the Trainer
settings, and bad input refused before anything is written."""

from __future__ import annotations

import contextlib
import copy
import gzip
import inspect
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoConfig

from scale_cl.cli import build_parser, main, parse_settings
from scale_cl.experiments.base.config import preset as base_preset
from scale_cl.experiments.settings import MethodSettings
from scale_cl.experiments.train.config import TrainConfig, fifth_of, preset
from scale_cl.experiments.train.pipeline import run_train
from scale_cl.experiments.train.sections import DataSection, EvalSection, TrainSection
from scale_cl.train.arguments import check_extra_arguments, training_arguments
from scale_cl.train.callbacks import LossLog, SaveEveryMinutes
from scale_cl.train.config import StageConfig
from scale_cl.train.trainer import TRAINABLE_WEIGHTS, CheckpointingTrainer
from scale_cl.tuner.config import ScaleConfig
from tests.exactness import assert_exact_to_rounding

RECIPE = Path(__file__).parents[2] / "configs" / "train-llama-3.2-1b-8gpu.yaml"
TRAINING_STEP = CheckpointingTrainer.training_step


def documents(workspace: Path) -> list[str]:
    return [json.loads(line)["text"] for line in (workspace / "new.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sources(workspace, tmp_path_factory) -> list[str]:
    """The workspace's new-domain text as a .jsonl.gz file, a parquet file and a save_to_disk folder."""
    import datasets

    folder = tmp_path_factory.mktemp("sources")
    docs = documents(workspace)
    with gzip.open(folder / "a.jsonl.gz", "wt", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": doc}) + "\n" for doc in docs[:100])
    pq.write_table(pa.table({"text": docs[100:150]}), folder / "b.parquet")
    datasets.Dataset.from_dict({"text": docs[150:]}).save_to_disk(str(folder / "c"))
    return [str(folder / "a.jsonl.gz"), str(folder / "b.parquet"), str(folder / "c")]


def config(
    workspace: Path, train: list[str], method: str = "scale_preserve", tokens: str = "768", **data
) -> TrainConfig:
    """A tiny run: 768 tokens = 6 steps of 4 x 32, a checkpoint and a loss every 2 steps, evaluated every 3."""
    return TrainConfig(
        preset="smollm2",
        model=str(workspace / "base"),
        method=method,
        data=DataSection(
            train=train,
            old_eval=[f"toy={workspace / 'old.jsonl'}"],
            seq_len=32,
            heldout_fraction=0.1,
            max_eval_sequences=6,
            **data,
        ),
        train=TrainSection(
            lr=1e-3,
            tokens=tokens,
            batch_size=4,
            micro_batch_size=2,
            save_every=2,
            save_total_limit=5,
            schedule="linear",
            logging_steps=2,  # a multiple of save_every: each logged loss is that of the same steps after a resume
        ),
        eval=EvalSection(every=3, batch_size=3, representation_sequences=2),
        options=MethodSettings(
            scale=ScaleConfig(hidden_up=32, ffn_up=32, method="preserve", preserve_layers=1),
            freeze_layers=1,
            llama_pro_blocks="1",
        ),
    )


def record_batches(monkeypatch, crash_at: int | None = None) -> list[torch.Tensor]:
    """The input ids of every micro-batch trained on, in order; with ``crash_at``, a KeyboardInterrupt when step
    ``crash_at + 1`` begins (its checkpoint written, nothing of the next step applied)."""
    seen: list[torch.Tensor] = []
    step = TRAINING_STEP  # the Trainer's own, not an earlier recording's

    def recording(self, model, inputs, *args, **kwargs):
        if crash_at is not None and self.state.global_step == crash_at:
            raise KeyboardInterrupt(f"interrupted after checkpoint-{crash_at}")
        seen.append(inputs["input_ids"].detach().cpu().clone())
        return step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(CheckpointingTrainer, "training_step", recording)
    return seen


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# Help, presets, the dry run


def test_help_explains_every_option_and_why_the_default_method():
    parser = build_parser(["train"])
    text = next(a for a in parser._subparsers._actions if a.dest == "command").choices["train"].format_help()
    for option in (
        "--train.tokens",
        "--data.weights",
        "--data.streaming",
        "--data.shuffle_buffer",
        "--reading",
        "--train.optim",
        "--train.max_grad_norm",
        "--train.args",
        "--train.save_minutes",
        "--dry_run",
        "--data.document_mask",
        "--data.txt_documents",
        "--train.run_name",
        "--train.logging_steps",
    ):
        assert option in text, option
    flat = " ".join(text.split()).replace("- ", "-")  # argparse wraps lines, also after a hyphen
    assert "SCALE-Preserve read with the calibrated router" in flat and "forgetting-without-old-data.md" in flat


@pytest.mark.parametrize("name", ["smollm2", "clean-en", "paper"])
def test_presets_are_valid_settings(name):
    cfg = preset(name)
    assert cfg.method == "scale_preserve" and cfg.read_with == "calibrated"
    assert replace(cfg, method="scale_route").read_with == "likelihood"
    assert replace(cfg, method="fft").read_with == "trained"


@pytest.mark.parametrize(
    ("name", "layers"), [("smollm2", 30), ("paper", 16), ("clean-en", base_preset("clean-en").model.layers)]
)
def test_the_placement_fitted_to_depth_is_each_presets_own_on_its_own_model(name, layers):
    """Where the user gives none, L_fp and Freeze's layers are a fifth of the model's: on each preset's own model
    (SmolLM2-135M's 30 layers, Llama-3.2-1B's 16, the clean base's) exactly the preset's values, so its runs stay."""
    cfg = preset(name)
    assert cfg.options.scale.preserve_layers == cfg.options.freeze_layers == fifth_of(layers)
    assert cfg.eval.every == 0, "measured twenty times a run, whatever its length"


def test_a_fifth_of_the_layers_fits_a_model_of_any_depth():
    assert [fifth_of(n) for n in (1, 2, 3, 7, 8, 12, 13, 24, 30, 80)] == [0, 1, 1, 1, 2, 2, 3, 5, 6, 16]


def test_the_placement_a_user_chose_is_kept_and_the_rest_fits_the_model(workspace, tmp_path):
    """Given on the command line or in --config, a setting is kept (and checked against the model); the other
    takes the model's depth; a library caller's settings (``given`` None) are taken as they are."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(workspace / "base")  # 3 layers
    settings = parse_settings(["train", "--data.train", str(workspace / "new.jsonl")])
    fitted = settings.fitted(model_config)
    assert (fitted.options.scale.preserve_layers, fitted.options.freeze_layers) == (1, 1), "the preset's 6 would fail"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(yaml.safe_dump({"options": {"freeze_layers": 2}}))
    argv = ["train", "--data.train", str(workspace / "new.jsonl"), "--config", str(yaml_file)]
    settings = parse_settings([*argv, "--options.scale.preserve_layers", "5"])
    assert {"options.freeze_layers", "options.scale.preserve_layers"} <= set(settings.given)
    fitted = settings.fitted(model_config)
    assert (fitted.options.scale.preserve_layers, fitted.options.freeze_layers) == (5, 2)
    with pytest.raises(ValueError, match="preserve_layers"):
        fitted.options.validate(model_config, fitted.methods)  # a chosen value that cannot fit is refused
    assert replace(settings, given=None).fitted(model_config) is settings.train


@pytest.mark.slow
def test_a_short_run_on_a_two_layer_model_with_no_setting_of_its_own_draws_its_curves(workspace, tmp_path):
    """The default preset on a model of two layers, no SCALE setting given: it runs (L_fp 1 of 2), and a run of six
    steps is measured at every step and logs every loss, so curves.png has a curve in both panels."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(workspace / "base")
    config.num_hidden_layers = 2
    base = tmp_path / "base-2"
    LlamaForCausalLM(config).save_pretrained(base)
    AutoTokenizer.from_pretrained(workspace / "base").save_pretrained(base)
    out = tmp_path / "run"
    argv = ["train", "--model", str(base), "--data.train", str(workspace / "new.jsonl"), "--data.seq_len", "32",
            "--data.old_eval", f"toy={workspace / 'old.jsonl'}", "--data.max_eval_sequences", "4",
            "--train.tokens", "768", "--train.batch_size", "4", "--train.micro_batch_size", "2",
            "--eval.batch_size", "4", "--eval.representation_sequences", "2", "--out", str(out)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["options"]["scale"]["preserve_layers"] == saved["options"]["freeze_layers"] == 1
    assert [r["step"] for r in lines(out / "metrics.jsonl")][:7] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in lines(out / "train_log.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (out / "curves.png").is_file()


@pytest.mark.parametrize("length", [["--train.max_steps", "5"], ["--train.tokens", "1M"]])
def test_epochs_with_another_length_of_the_run_is_refused(workspace, length):
    argv = ["train", "--data.train", str(workspace / "new.jsonl"), "--train.epochs", "2", *length]
    with pytest.raises(ValueError, match=r"train.epochs and train.(max_steps|tokens) both set the length of the run"):
        parse_settings(argv)
    assert parse_settings([*argv[:3], *length]).train.train.epochs == 1, "the default alone is no choice"


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sliced", "whole"])
def test_the_loss_switch_reaches_the_trainer(workspace, tmp_path, monkeypatch, loss):
    """--train.loss whole trains on transformers' own loss (no slicing); sliced (the default) a slice at a time."""
    from scale_cl.train import recipe

    built = []

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        built.append(kwargs["slice_positions"])
        raise Stop

    monkeypatch.setattr(recipe, "CheckpointingTrainer", capture)
    settings = parse_settings(
        ["train", "--model", str(workspace / "base"), "--data.train", str(workspace / "new.jsonl"), "--data.seq_len",
         "32", "--train.tokens", "768", "--train.batch_size", "4", "--train.micro_batch_size", "2",
         "--options.scale.hidden_up", "32", "--options.scale.ffn_up", "32", "--train.loss", loss]
    )  # fmt: skip
    with pytest.raises(Stop), contextlib.redirect_stdout(io.StringIO()):
        run_train(settings.fitted(AutoConfig.from_pretrained(workspace / "base")), tmp_path / "run")
    assert built == [0 if loss == "sliced" else None]


def test_a_loss_curve_of_one_point_is_drawn_with_a_marker(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from scale_cl.experiments.train.report import curves_figure

    (tmp_path / "train_log.jsonl").write_text(json.dumps({"step": 1, "tokens": 128, "loss": 2.5}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "learning_ppl": 9.0, "forgetting_ppl": {"en": 5.0}}) + "\n" for s in (0, 1))
    )
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    assert curves_figure(tmp_path, tmp_path / "curves.png") is not None
    loss = drawn[0].axes[1].lines[0]
    assert loss.get_marker() == "o" and list(loss.get_ydata()) == [2.5]


def test_dry_run_prints_the_plan_and_writes_nothing(workspace, tmp_path):
    out = tmp_path / "out"
    argv = ["train", "--model", str(workspace / "base"), "--data.train", str(workspace / "new.jsonl"),
            "--data.old_eval", f"toy={workspace / 'old.jsonl'}", "--train.tokens", "2M", "--data.seq_len", "64",
            "--options.scale.hidden_up", "32", "--options.scale.ffn_up", "32", "--options.scale.preserve_layers", "1",
            "--out", str(out), "--dry_run"]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    plan = printed.getvalue()
    for key in ("parameters", "tokens", "per process", "data", "old domain", "schedule", "memory / process", "time"):
        assert f"  {key}" in plan, key
    assert "data / process    ~0.0 GiB: the order of the corpus's blocks, 8 bytes each, for the ~31,256 the run" in plan
    assert "2,000,384 = 3,907 steps x 8 sequences x 64 tokens" in plan
    assert "micro-batch 4 x 2 accumulation steps" in plan
    assert not out.exists()


@pytest.mark.parametrize("method", ["fft", "lora", "scale_preserve", "scale_adapt", "scale_route"])
def test_the_plan_counts_the_parameters_the_prepared_model_holds(workspace, method):
    """The plan's parameters (counted on the meta device) are the model's: SCALE-Preserve holds no W12 and
    SCALE-Adapt's only in its collaborative layers, so neither is counted."""
    from transformers import AutoModelForCausalLM

    from scale_cl.bench.plan import parameter_counts
    from scale_cl.methods import prepare

    scale = ["--options.scale.hidden_up", "32", "--options.scale.ffn_up", "32", "--options.scale.preserve_layers", "1"]
    argv = ["train", "--model", str(workspace / "base"), "--data.train", str(workspace / "new.jsonl"),
            "--method", method, *(scale if method != "fft" else [])]  # fmt: skip
    cfg = parse_settings(argv).train
    base = AutoModelForCausalLM.from_pretrained(workspace / "base")
    counted = parameter_counts(base.config, cfg)
    model = prepare(base, method, **cfg.options.prepare_options(method, cfg.seed))
    params = {id(p): p for p in model.parameters()}.values()
    assert counted == (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))


def test_the_recipe_for_eight_gpus_parses_and_dry_runs(workspace, tmp_path, monkeypatch):
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["preset"] == "paper" and recipe["train"]["tokens"] == "60B"
    monkeypatch.chdir(tmp_path)  # the recipe's data paths, relative, filled with the workspace's text
    for source in recipe["data"]["train"] + [s.partition("=")[2] for s in recipe["data"]["old_eval"]]:
        folder = tmp_path / Path(source).parent
        folder.mkdir(parents=True, exist_ok=True)
        name = Path(source).name.replace("*", "part")
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"text": documents(workspace)}), folder / name)
        elif name.endswith(".gz"):
            with gzip.open(folder / name, "wt") as file:
                file.writelines(json.dumps({"text": d}) + "\n" for d in documents(workspace))
        else:
            shutil.copy(workspace / "old.jsonl", folder / name)
    argv = ["train", "--config", str(RECIPE), "--dry_run", "--processes", "8"]
    settings = parse_settings(argv)
    assert settings.train.data.weights == [0.7, 0.3] and settings.train.train.token_budget == 60 * 10**9
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    plan = printed.getvalue()
    assert "14,306 steps x 512 sequences x 8192 tokens" in plan and "8 process(es): 64 sequences" in plan
    assert "Llama-3.2-1B" in plan and "checkpointed" in plan and "H200" in plan


# ---------------------------------------------------------------------------------------------
# A run


@pytest.fixture(scope="module")
def finished(workspace, sources, tmp_path_factory):
    cfg = config(workspace, sources, weights=[0.5, 0.25, 0.25])
    out = tmp_path_factory.mktemp("train") / "run"
    return cfg, out, run_train(cfg, out, command="scale-cl train ...")


@pytest.mark.slow
def test_a_run_keeps_its_checkpoints_losses_metrics_and_figure(finished):
    _, out, summary = finished
    assert summary["steps"] == 6 and summary["reading"] == "calibrated"  # the default: fitted at the end
    assert sorted(p.name for p in (out / "run").glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"
    ], "checkpoints are kept when the run ends"  # fmt: skip
    losses = [r for r in lines(out / "train_log.jsonl") if "loss" in r]
    assert [r["step"] for r in losses] == [2, 4, 6] and all(r["tokens"] == r["step"] * 128 for r in losses)
    assert all(r["loss"] > 0 and "learning_rate" in r and "grad_norm" in r for r in losses)
    metrics = lines(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 3, 6, 6] and all("toy" in r["forgetting_ppl"] for r in metrics)
    assert (out / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_saved_model_is_read_as_asked_and_eval_and_export_take_it(finished, tmp_path):
    from scale_cl.export.config import ExportSettings
    from scale_cl.export.export import export
    from scale_cl.models import load_trained

    _, out, _ = finished
    model, _, method = load_trained(out / "model")
    assert method == "scale_preserve" and model.scale_config.router == "calibrated"
    card = (out / "model" / "README.md").read_text()
    for words in (
        "768 (6 steps of 4 sequences of 32 tokens)",
        "a.jsonl.gz` (weight 0.5)",
        "linear after 0 warm-up steps",
        "SCALE-Preserve (`scale_preserve`), read with the calibrated router",
        "old-domain evaluation set",
    ):
        assert words in card, words
    folder = export(ExportSettings(source=str(out), out=str(tmp_path / "exported")))
    assert (folder / "config.json").is_file() and (folder / "README.md").is_file()


@pytest.mark.slow
def test_a_run_with_an_extended_vocabulary_saves_exports_and_reads_its_new_tokens(workspace, tmp_path):
    """--data.extend_vocab in train, end to end: the tokenizer and the model grown by the same rows, the calibrated
    gate fitted over the grown vocabulary, and the export reading new-token text as the saved model does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale_cl.export.config import ExportSettings
    from scale_cl.export.export import export
    from scale_cl.models import load_trained
    from scale_cl.tuner.vocab import vocab_rows

    cfg = config(workspace, [str(workspace / "new.jsonl")])
    cfg = replace(cfg, data=replace(cfg.data, extend_vocab=16))
    out = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        summary = run_train(cfg, out)
    assert summary["reading"] == "calibrated"
    rows = len(AutoTokenizer.from_pretrained(workspace / "base")) + 16
    model, tokenizer, _ = load_trained(out / "model")
    assert len(tokenizer) == vocab_rows(model) == rows
    ids = torch.tensor([tokenizer(documents(workspace)[0])["input_ids"][:32]])
    assert ids.max() >= rows - 16, "the new-domain text uses new tokens"
    folder = export(ExportSettings(source=str(out), out=str(tmp_path / "exported")))
    exported = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        saved, loaded = model.eval()(input_ids=ids).logits, exported(input_ids=ids).logits
    assert saved.shape[-1] == rows and torch.isfinite(saved).all()
    torch.testing.assert_close(loaded, saved, atol=1e-5, rtol=0)  # the export's promise: the library's to 1e-5


@pytest.mark.slow
def test_the_calibrated_reading_is_fitted_at_the_end_and_calibrate_refits_the_same(
    workspace, sources, tmp_path, capsys
):
    """--reading calibrated: the gate is fitted once training ends (the training text against the base's samples),
    the model evaluated with it (the last record) and saved with it; `scale-cl calibrate` on the finished run fits
    the same gate from the saved model (one recipe, the same seed) and swaps the model folder; a run of a method
    the router cannot read is refused with nothing written."""
    from scale_cl.models import load_trained

    cfg = replace(config(workspace, sources), reading="calibrated")
    out = tmp_path / "run"
    summary = run_train(cfg, out)
    fit = summary["gate_fit"]
    assert fit["objective"] == "classification" and fit["sequences"] == [fit["sequences"][0]] * 2
    assert fit["old_base_weight"] > fit["new_base_weight"] and fit["share_of_training"] > 0
    metrics = lines(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 3, 6, 6] and metrics[-1]["gate"] == "fitted"
    assert metrics[-1]["learning_ppl"] != metrics[-2]["learning_ppl"]  # read with the fitted gate, not the default
    model, _, _ = load_trained(out / "model")
    saved = model.scale_config
    assert saved.router == "calibrated"
    gate = (saved.router_prior, saved.router_decay, saved.router_prefix_weight, saved.router_entropy_weight)
    assert main(["calibrate", str(out)]) == 0
    again = load_trained(out / "model")[0].scale_config
    assert again.router == "calibrated" and not (out / "model.calibrating").exists()
    refit = (again.router_prior, again.router_decay, again.router_prefix_weight, again.router_entropy_weight)
    assert refit == pytest.approx(gate, rel=1e-5, abs=1e-6)
    assert json.loads((out / "result.json").read_text())["gate_fit"]["sequences"] == fit["sequences"]
    fft = tmp_path / "fft"
    run_train(replace(config(workspace, sources), method="fft"), fft)
    before = sorted(p.name for p in (fft / "model").iterdir())
    assert main(["calibrate", str(fft)]) == 2
    assert "reads SCALE-Route and SCALE-Preserve" in capsys.readouterr().err
    assert sorted(p.name for p in (fft / "model").iterdir()) == before


@pytest.mark.slow
def test_a_killed_run_resumes_where_it_stopped_bitwise(workspace, sources, tmp_path, monkeypatch):
    cfg = config(workspace, sources, weights=[0.5, 0.25, 0.25], method="scale_route")
    straight = record_batches(monkeypatch)
    run_train(cfg, tmp_path / "straight")
    interrupted = record_batches(monkeypatch, crash_at=4)
    with pytest.raises(KeyboardInterrupt):
        run_train(cfg, tmp_path / "resumed")
    resumed = record_batches(monkeypatch)
    run_train(cfg, tmp_path / "resumed")
    seen = interrupted + resumed
    assert len(seen) == len(straight) == 12, "no batch repeated, none skipped"
    assert all(torch.equal(a, b) for a, b in zip(seen, straight, strict=True)), "the same token ids, in order"
    runs = [tmp_path / "straight", tmp_path / "resumed"]
    weights = [load_file(r / "run" / "checkpoint-6" / TRAINABLE_WEIGHTS) for r in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "bitwise the same weights"
    curves = [[r["loss"] for r in lines(run / "train_log.jsonl") if "loss" in r] for run in runs]
    assert curves[0] == curves[1], "the loss curve of the uninterrupted run"
    timeless = [[{k: v for k, v in r.items() if k != "train_tokens_per_s"} for r in lines(run / "metrics.jsonl")]
                for run in runs]  # fmt: skip
    assert timeless[0] == timeless[1], "the same evaluations"


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_by_running_the_same_command(workspace, sources, tmp_path):
    """A real process killed (SIGKILL, as a crash or a preempted node) after its first checkpoint: the same command
    again ends with bitwise the weights and the loss curve of a run never interrupted."""
    import os
    import subprocess
    import sys

    from tests.conftest import kill_when

    def argv(out: Path) -> list[str]:
        return [
            sys.executable, "-m", "scale_cl.cli", "train", "--model", str(workspace / "base"), "--data.train",
            *sources, "--data.weights", "0.5", "0.25", "0.25", "--data.old_eval", f"toy={workspace / 'old.jsonl'}",
            "--data.seq_len", "32", "--data.heldout_fraction", "0.1", "--data.max_eval_sequences", "6",
            "--train.tokens", "768", "--train.batch_size", "4", "--train.micro_batch_size", "2", "--train.save_every",
            "2", "--train.save_total_limit", "5", "--train.logging_steps", "2", "--train.schedule", "linear",
            "--eval.every", "3", "--eval.batch_size", "3", "--eval.representation_sequences", "2",
            "--options.scale.hidden_up", "32", "--options.scale.ffn_up", "32", "--options.scale.preserve_layers",
            "1", "--out", str(out),
        ]  # fmt: skip

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(argv(straight), env=env, check=True, capture_output=True)
    kill_when(argv(killed), env, killed / "run" / "checkpoint-2" / "checkpoint.json")
    assert not (killed / "result.json").exists(), "killed before the end"
    subprocess.run(argv(killed), env=env, check=True, capture_output=True)
    weights = [load_file(run / "model" / "model.safetensors") for run in (straight, killed)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "bitwise the uninterrupted weights"
    curves = [
        [(r["step"], r["loss"]) for r in lines(run / "train_log.jsonl") if "loss" in r] for run in (straight, killed)
    ]
    assert curves[0] == curves[1] and len(curves[0]) == 3
    assert not list(killed.glob("**/.staging")), "nothing half-written left behind"


@pytest.mark.slow
def test_a_streamed_run_with_a_shuffle_buffer_resumes_where_it_stopped(workspace, sources, tmp_path, monkeypatch):
    """Bitwise the uninterrupted run's batches, the stream started at the checkpoint's position (not read up to it)."""
    import scale_cl.data.stream as stream_module

    monkeypatch.setattr(stream_module, "TOKENIZE_BATCH", 4)  # many bookmarks in a small file
    monkeypatch.setattr(stream_module, "STRIDE", 2)
    training = []
    encode = stream_module.encode

    def counted(texts, *args):
        if any(f.function == "_read" for f in inspect.stack()[1:3]):  # the training stream, not the evaluation sets
            training.extend(texts)
        return encode(texts, *args)

    monkeypatch.setattr(stream_module, "encode", counted)
    cfg = config(workspace, [sources[0]], streaming=True, shuffle_buffer=8, document_mask=True)
    straight = record_batches(monkeypatch)
    run_train(cfg, tmp_path / "straight")
    read_straight = len(training)
    interrupted = record_batches(monkeypatch, crash_at=2)
    with pytest.raises(KeyboardInterrupt):
        run_train(cfg, tmp_path / "resumed")
    position = json.loads((tmp_path / "resumed" / "run" / "checkpoint-2" / "stream.json").read_text())
    assert position["emitted"] == 8, "2 steps of 4 blocks"
    resumed = record_batches(monkeypatch)
    training.clear()
    run_train(cfg, tmp_path / "resumed")
    assert len(interrupted + resumed) == len(straight) == 12
    assert all(torch.equal(a, b) for a, b in zip(interrupted + resumed, straight, strict=True))
    assert position["bookmark"]["documents"] > 0
    assert len(training) == read_straight - position["bookmark"]["documents"], "read from the bookmark on, not before"
    plain = record_batches(monkeypatch)
    run_train(replace(cfg, data=replace(cfg.data, shuffle_buffer=0)), tmp_path / "plain")
    assert not all(torch.equal(a, b) for a, b in zip(plain, straight, strict=True)), "the buffer shuffles"


# ---------------------------------------------------------------------------------------------
# Trainer settings


def test_the_escape_hatch_takes_trainer_settings_by_their_type_and_refuses_scale_cls_own():
    assert check_extra_arguments({"dataloader_pin_memory": "false", "torch_empty_cache_steps": "5"}) == {
        "dataloader_pin_memory": False,
        "torch_empty_cache_steps": 5,
    }
    with pytest.raises(ValueError, match=r"train\.args learning_rate: scale-cl sets it; use train\.lr"):
        check_extra_arguments({"learning_rate": "1e-3"}, "train.")
    with pytest.raises(ValueError, match="args no_such_setting: not a transformers TrainingArguments setting"):
        check_extra_arguments({"no_such_setting": "1"})
    with pytest.raises(ValueError, match="args torch_empty_cache_steps must be a whole number"):
        check_extra_arguments({"torch_empty_cache_steps": "often"})
    args = training_arguments(StageConfig(args={"dataloader_pin_memory": "false"}), Path("/tmp/x"), 0)
    assert args.dataloader_pin_memory is False


def test_optimizer_clipping_name_and_wsd_reach_the_trainer(tmp_path):
    from transformers import get_scheduler

    stage = StageConfig(optim="adamw_torch", max_grad_norm=0.5, run_name="ko-1", schedule="wsd", decay_ratio=0.25,
                        min_lr_ratio=0.1, warmup_steps=2)  # fmt: skip
    args = training_arguments(stage, tmp_path, 0, max_steps=20)
    assert (args.optim, args.max_grad_norm, args.run_name) == ("adamw_torch", 0.5, "ko-1")
    assert args.lr_scheduler_type == "warmup_stable_decay"
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(
        "warmup_stable_decay", optimizer, 2, 20, scheduler_specific_kwargs=args.lr_scheduler_kwargs
    )
    rates = []
    for _ in range(20):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:2] == pytest.approx([0.1, 0.55]), "warm-up (from min_lr_ratio, as transformers' WSD starts)"
    assert set(rates[2:16]) == {1.0}, "stable until the last quarter of the steps"
    assert 1.0 > rates[16] > rates[17] > rates[18] > rates[19] > 0.1, "then a cosine decay towards min_lr_ratio"
    assert StageConfig().optim == "auto" and training_arguments(StageConfig(), tmp_path, 0).optim == "adamw_torch_fused"
    assert training_arguments(StageConfig(optim="adamw_8bit"), tmp_path, 0).optim == "adamw_bnb_8bit"


def test_the_loss_log_keeps_the_records_up_to_a_resumed_step(tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "train_log.jsonl"
    log = LossLog(path, tokens_per_step=10)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    log.on_train_begin(None, state, None)
    for step in (1, 2, 3):
        state.global_step = step
        log.on_log(None, state, None, logs={"loss": float(step), "learning_rate": 0.1})
    state.global_step = 2
    log.on_train_begin(None, state, None)  # resumed from checkpoint-2
    assert [(r["step"], r["tokens"], r["loss"]) for r in lines(path)] == [(1, 10, 1.0), (2, 20, 2.0)]


def test_save_every_minutes_asks_for_a_checkpoint_when_the_time_has_come(monkeypatch):
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr("scale_cl.train.callbacks.time.monotonic", lambda: clock[0])
    saver = SaveEveryMinutes(1.0)
    args = SimpleNamespace(world_size=1, logging_steps=3)
    state = SimpleNamespace(global_step=3, max_steps=10)
    saver.on_train_begin(args, state, None)
    control = SimpleNamespace(should_save=False)
    clock[0] = 59.0
    saver.on_step_end(args, state, control)
    assert not control.should_save
    clock[0] = 61.0
    saver.on_step_end(args, state, control)
    assert control.should_save
    saver.on_save(args, state, control)
    control.should_save, clock[0] = False, 200.0
    state.global_step = 4
    saver.on_step_end(args, state, control)
    assert not control.should_save, "only at a logging step (the logged losses stay those of a straight run)"
    state.global_step = 6
    saver.on_step_end(args, state, control)
    assert control.should_save


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"train": {"tokens": "100"}}, r"train.tokens=100 is less than one optimizer step \(.*128 tokens\)"),
        ({"train": {"tokens": "lots"}}, r"train.tokens must be a token count such as 2B"),
        ({"train": {"tokens": "1M", "max_steps": 5}}, "both set the length of the run: give one of them"),
        ({"data": {"replay": ["a=x.jsonl", "b=y.jsonl"], "replay_weights": [0.5, 0.6], "replay_ratio": 0.25}},
         r"data.replay_weights must be positive and sum to 1"),
        ({"data": {"text_field": "body"}}, r"new.jsonl line 1 has no field 'body'"),
        ({"data": {"train": ["nope/*.jsonl"]}}, "no file matches"),
        ({"method": "fft", "reading": "likelihood"}, r"reading 'likelihood' does not read a fft model; valid: trained"),
        ({"train": {"args": {"learning_rate": "1"}}}, "train.args learning_rate: scale-cl sets it; use train.lr"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_is_written(workspace, tmp_path, change, pattern):
    from scale_cl.experiments.overrides import apply_overrides

    out = tmp_path / "out"
    with pytest.raises(ValueError if "no file" not in pattern else FileNotFoundError, match=pattern):
        cfg = apply_overrides(config(workspace, [str(workspace / "new.jsonl")]), change)
        run_train(cfg, out)
    assert not out.exists()


def test_a_resume_with_other_settings_is_refused(workspace, tmp_path):
    from scale_cl.experiments.run_folder import claim_output_folder
    from scale_cl.experiments.train.pipeline import CONFIG_FILE

    cfg = config(workspace, [str(workspace / "new.jsonl")])
    claim_output_folder(tmp_path, CONFIG_FILE, cfg.to_dict())
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"holds results of another configuration \(differs in: train.lr\)"):
        run_train(replace(cfg, train=replace(cfg.train, lr=3e-3)), tmp_path)
    assert sorted(tmp_path.iterdir()) == before


# ---------------------------------------------------------------------------------------------
# Document masking


@pytest.mark.exactness
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_document_masking_keeps_each_document_alone_in_every_scale_method(method):
    """A block of several documents, masked by position_ids (`DocumentMaskCollator`), gives each document the logits it
    has alone, SCALE's paths included (Route stacks both paths from its first collaborative layer): as close to the
    document's float64 logits alone as its fp32 logits alone are (the off-by-one boundary this bound refuses:
    tests/data/test_corpus.py, `test_a_document_boundary_one_token_off_is_outside_the_bound`)."""
    from transformers import LlamaForCausalLM

    from scale_cl.data.packing import DocumentMaskCollator
    from tests.conftest import tiny_llama_config, upscaled_copy

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())
    model = upscaled_copy(base, method, preserve_layers=1, w21_init="random", w22_init="random").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("w12", "weight_up")):
                param.normal_(0, 0.05)  # W12 and the new head columns away from zero: every path counts
    eos = 5
    row = torch.tensor([7, 8, 9, eos, 10, 11, 12, 13, eos, 14, 15, 16])
    batch = DocumentMaskCollator(eos)([{"input_ids": row, "labels": row}, {"input_ids": row.roll(4), "labels": row}])
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for b, ids in enumerate(batch["input_ids"]):
            ends = [i + 1 for i, t in enumerate(ids.tolist()) if t == eos and i + 1 < len(ids)]
            for start, end in zip([0, *ends], [*ends, len(ids)], strict=True):
                alone = ids[start:end].unsqueeze(0)
                stock = model(input_ids=alone, use_cache=False).logits[0]
                exact = exact_model(input_ids=alone, use_cache=False).logits[0]
                assert_exact_to_rounding(logits[b, start:end], exact, stock=stock, what=f"row {b} [{start}:{end}]")
