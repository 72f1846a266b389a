"""The biography benchmark end to end on the micro preset: outputs, resuming, bad inputs, the CLI."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import scale_cl.experiments.bio.pipeline as pipeline
import scale_cl.experiments.method_run as method_run
from scale_cl.cli import main, parse_settings
from scale_cl.experiments.bio.config import ALL_METHODS, BioConfig, preset
from scale_cl.experiments.overrides import apply_overrides
from scale_cl.train.reporting import result_settings
from scale_cl.train.trainer import NonFiniteLossError, complete_checkpoints, trainable_state


def micro(**overrides) -> BioConfig:
    return apply_overrides(preset("micro"), overrides)


def expected_steps(cfg: BioConfig) -> list[int]:
    """Step 0, the early schedule, the sparse one and the last step (written out, not via PeriodicEval)."""
    t = cfg.task1
    early = set(range(0, t.early_eval_until + 1, t.early_eval_every)) if t.early_eval_every else set()
    return sorted(early | set(range(0, t.max_steps + 1, t.eval_every)) | {t.max_steps})


def _train_with(monkeypatch, train_model) -> None:
    """Every training run goes through ``train_model``: stages 1-2 (the pipeline's) and Task 1 (`MethodRun`'s)."""
    monkeypatch.setattr(pipeline, "train_model", train_model)
    monkeypatch.setattr(method_run, "train_model", train_model)


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Path:
    """One cache of the tokenizer and stage-1/2 models for the tests whose promise is about Task 1 (stages 1-2
    are keyed by every setting they depend on, so a test of other settings still trains its own): each would
    otherwise train the same stages again. Tests of the stages' own caching keep a cache of their own."""
    return tmp_path_factory.mktemp("bio-cache")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, stages) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bio") / "run"
    return out, pipeline.run_bio(micro(), out, stages)


@pytest.mark.slow
def test_micro_run_writes_figure_tables_and_curves_for_every_method(finished):
    out, results = finished
    assert set(results["methods"]) == set(ALL_METHODS)
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    saved = json.loads((out / "results.json").read_text())
    cfg = preset("micro")
    # the one-pass readings of the SCALE models (training nothing) beside the methods as trained, from their readings
    for method in ("scale_preserve", "scale_route"):
        read = saved["methods"][method]["one_pass"]["calibrated"]
        reading = next(r for r in saved["methods"][method]["runs"][0]["readings"] if r.get("router") == "calibrated")
        assert read["task1"]["mean"] == reading["task1"]["overall"] and read["each"]["task0"] == [
            reading["task0"]["overall"]
        ]
        assert f"| {method}, calibrated router | {100 * reading['task0']['overall']:.1f} |" in table
    assert "one_pass" not in saved["methods"]["fft"]
    for method, result in saved["methods"].items():
        assert f"| {method} |" in table
        curve = result["runs"][0]["curve"]
        steps = [record["step"] for record in curve]
        assert steps == expected_steps(cfg)
        for record in curve:
            for task in ("task0", "task0_trained", "task1"):
                assert 0.0 <= record[task]["overall"] <= 1.0
                assert {"birth_date", "birth_city", "university", "major", "employer", "employer_city"} <= set(
                    record[task]
                )
        assert result["trainable"] > 0
        assert result["runs"][0]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # task1.device auto
        assert result["task0_min"]["mean"] <= result["task0_start"]["mean"]
        assert result["task0_trained_min"]["mean"] <= result["task0_trained_start"]["mean"]
    # Every method starts from the same Task-0 model and preserves its function at step 0, so the
    # step-0 accuracies agree; fft trains everything, the others less.
    starts = {m: r["runs"][0]["curve"][0] for m, r in saved["methods"].items()}
    assert len({json.dumps(s["task0"], sort_keys=True) for s in starts.values()}) == 1
    assert len({json.dumps(s["task0_trained"], sort_keys=True) for s in starts.values()}) == 1
    assert len({json.dumps(s["task1"], sort_keys=True) for s in starts.values()}) == 1
    counts = {m: r["trainable"] for m, r in saved["methods"].items()}
    assert counts["fft"] == max(counts.values())
    assert counts["scale_adapt"] == counts["scale_route"] > counts["scale_preserve"]
    # SCALE-Route (Eq. 5) is also read, training nothing, with route_exact and with each mixing router
    route = json.loads((out / "seed-0" / "scale_route.json").read_text())
    readings = route["readings"]
    assert [(r.get("route_exact", False), r.get("router", "cosine")) for r in readings] == [
        (False, "cosine"),
        (True, "cosine"),
        (False, "likelihood"),
        (False, "confidence"),
        (False, "hybrid"),
        (False, "calibrated"),
    ]
    assert {k: readings[0][k] for k in ("task0", "task1")} == {k: route["curve"][-1][k] for k in ("task0", "task1")}
    assert "likelihood_router" in readings[2] and "likelihood_router" not in readings[0]
    # Eq. 5's own reading records the share of each split's answers it sends to the preserve path
    eq5 = readings[0]["eq5_routing"]
    assert all(0 <= eq5[f"{name}_base_weight"] <= 1 for name in ("task0", "task0_trained", "task1"))
    assert 0 <= eq5["auroc"] <= 1 and "eq5_routing" in route["curve"][-1]
    # SCALE-Preserve is read with the mixing routers too (its Z is the base's logits exactly)
    preserve = json.loads((out / "seed-0" / "scale_preserve.json").read_text())
    routers = ["cosine", "likelihood", "confidence", "hybrid", "calibrated"]
    assert [r.get("router", "cosine") for r in preserve["readings"]] == routers
    assert all(0 <= reading["likelihood_router"]["auroc"] <= 1 for reading in preserve["readings"][1:])
    # the calibrated reading's gate is fitted on Task 1's training questions against the Task-0 model's own text
    for run in (route, preserve):
        fit = run["readings"][-1]["gate_fit"]
        assert fit["objective"] == "classification" and fit["sequences"][0] == fit["sequences"][1] > 0, fit
        assert run["readings"][-1]["router_decay"] in {float(decay) for decay in fit["by_decay"]}


@pytest.mark.slow
def test_rerun_recomputes_nothing(finished, stages, monkeypatch):
    out, results = finished

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage was trained again")

    _train_with(monkeypatch, no_training)
    again = pipeline.run_bio(micro(), out, stages)
    assert again["methods"].keys() == results["methods"].keys()
    for method in results["methods"]:
        assert again["methods"][method]["runs"] == results["methods"][method]["runs"]


@pytest.mark.slow
def test_killed_run_resumes_without_redoing_finished_work(tmp_path, monkeypatch):
    """Killed in LoRA, after stages 1-2 and FFT, before Freeze: the rerun trains LoRA and Freeze only. Its own cache
    (its stages are part of what must not be redone), pre-trained one epoch: what is resumed is the same."""
    out = tmp_path / "run"
    cfg = micro(methods=["fft", "lora", "freeze"], pretrain={"epochs": 1})
    real = pipeline.train_model
    calls: list[str] = []

    def killed_at_lora(model, dataset, *args, **kwargs):
        if type(model).__name__.startswith("Peft"):
            raise KeyboardInterrupt  # the process is killed while training LoRA
        calls.append(type(model).__name__)
        return real(model, dataset, *args, **kwargs)

    _train_with(monkeypatch, killed_at_lora)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_bio(cfg, out)
    assert calls == ["GPTNeoXForCausalLM"] * 3  # stage 1, stage 2, fft
    assert (out / "seed-0" / "fft.json").is_file()
    assert not (out / "seed-0" / "lora.json").exists()
    assert not (out / "results.json").exists()
    fft_before = (out / "seed-0" / "fft.json").read_bytes()

    calls.clear()

    def counted(model, *args, **kwargs):
        calls.append(type(model).__name__)
        return real(model, *args, **kwargs)

    _train_with(monkeypatch, counted)
    results = pipeline.run_bio(cfg, out)
    assert len(calls) == 2 and calls[0].startswith("Peft")  # lora and freeze only
    assert set(results["methods"]) == {"fft", "lora", "freeze"}
    assert (out / "seed-0" / "fft.json").read_bytes() == fft_before
    assert not list(out.rglob("*.tmp"))


@pytest.mark.slow
def test_interrupted_stage_cache_is_not_taken_as_finished(tmp_path, monkeypatch):
    """Its own cache (a stage is what is cut short), pre-trained one epoch: the stage is saved the same way."""
    out = tmp_path / "run"
    cfg = micro(methods=["fft"], pretrain={"epochs": 1})
    real_save = pipeline.GPTNeoXForCausalLM.save_pretrained

    def half_written(self, path, **kwargs):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pipeline.GPTNeoXForCausalLM, "save_pretrained", half_written)
    with pytest.raises(OSError, match="disk full"):
        pipeline.run_bio(cfg, out)
    assert not [p for p in (out / "cache").iterdir() if p.name.startswith("stage") and not p.name.endswith(".tmp")]

    monkeypatch.setattr(pipeline.GPTNeoXForCausalLM, "save_pretrained", real_save)
    results = pipeline.run_bio(cfg, out)  # the re-run redoes the stage and finishes
    assert set(results["methods"]) == {"fft"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"methods": ["fft", "dreambooth"]}, "unknown methods"),
        ({"preset": "huge"}, "unknown preset"),
        ({"data": {"people": 5}}, "data.people must be >= 10, got 5"),
        ({"data": {"pools": "tiny"}}, "unknown biography preset"),
        ({"data": {"attributes": ["major", "shoe_size"]}}, "unknown attributes"),
        ({"task1": {"learning_rate": 1.0}}, "unknown setting 'task1.learning_rate'"),
        ({"options": {"scale": {"hidden_up": 20}}}, "must add whole attention heads"),
        ({"options": {"scale": {"preserve_layers": 3}}}, "does not fit the model's 2 decoder layers"),
        ({"options": {"scale": {"ffn_up": -1}}}, "options.scale.ffn_up must be >= 0, got -1"),
        ({"options": {"scale": {"collab_modules": ["attn", "mlp"]}}}, "collab_modules must be a non-empty subset"),
        ({"task1": {"method_lr": {"dreambooth": 1e-3}}}, "unknown method 'dreambooth'"),
        ({"task1": {"method_lr": {"fft": -1.0}}}, r"task1.method_lr\['fft'\] must be > 0, got -1.0"),
        ({"options": {"lora_rank": "big"}}, "lora_rank"),
        ({"data": {"qa_people": 31}}, r"data.qa_people must be between 0 \(all\) and data.people // 4 = 30"),
        ({"task1": {"early_eval_every": -5}}, "early_eval_every"),
        ({"task1": {"replay_ratio": 0.25, "pseudo_replay_ratio": 0.25}}, "pseudo-replay takes replay's place"),
        ({"task1": {"qa_loss": "question"}}, r"task1.qa_loss must be one of \('answer', 'all'\)"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, overrides, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        pipeline.run_bio(micro(**overrides), out)
    assert not out.exists()


@pytest.mark.slow
def test_output_folder_of_another_config_is_refused_and_left_intact(finished, stages):
    out, _ = finished
    before = {p: p.read_bytes() for p in [*out.rglob("*"), *stages.rglob("*")] if p.is_file()}
    with pytest.raises(ValueError, match=r"another configuration \(differs in: task1.max_steps\)"):
        pipeline.run_bio(micro(task1={"max_steps": 3}), out, stages)
    assert {p: p.read_bytes() for p in [*out.rglob("*"), *stages.rglob("*")] if p.is_file()} == before


def test_cli_options_reach_the_settings():
    argv = ["bio", "--preset", "micro", "--methods", "fft", "scale_route", "--seed", "1", "2", "--out", "o"]
    argv += ["--data.people", "50", "--task1.scale-route-lr", "3e-4", "--eval-people", "7"]
    settings = parse_settings(argv)
    cfg = settings.bio
    assert settings.out == "o" and (cfg.preset, cfg.methods, cfg.seeds) == ("micro", ["fft", "scale_route"], [1, 2])
    assert (cfg.data.people, cfg.eval_people, cfg.task1.lr_of("scale_route")) == (50, 7, 3e-4)
    assert cfg.task1.max_steps == preset("micro").task1.max_steps  # not named: the preset's


@pytest.mark.slow
def test_cli_runs_with_yaml_and_command_line_overrides(tmp_path, capsys):
    config = tmp_path / "bio.yaml"
    config.write_text("preset: micro\nmethods: [fft, scale_route]\ntask1: {max_steps: 3, eval_every: 1}\n")
    out = tmp_path / "run"
    code = main(["bio", "--config", str(config), "--out", str(out), "--task1.max_steps", "2", "--seed", "1"])
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["task1"]["max_steps"] == 2  # the command line wins over the YAML file
    assert saved["config"]["seeds"] == [1] and set(saved["methods"]) == {"fft", "scale_route"}
    assert [r["step"] for r in saved["methods"]["fft"]["runs"][0]["curve"]] == [0, 1, 2]
    assert "| scale_route |" in capsys.readouterr().out


@pytest.mark.slow
def test_attribute_subset_is_trained_and_reported(tmp_path, stages):
    cfg = micro(methods=["fft"], data={"attributes": ["major", "birth_city"]})
    results = pipeline.run_bio(cfg, tmp_path / "r", stages)
    record = results["methods"]["fft"]["runs"][0]["curve"][-1]
    assert set(record["task0"]) == {"overall", "major", "birth_city"}
    assert "| fft | " in (tmp_path / "r" / "results.md").read_text().split("per attribute")[1]


_TRAIN_MODEL = pipeline.train_model


def _without_wall_times(results: dict) -> dict:
    """The results without the times they took (the run's, each gate fit's)."""

    def timeless(value):
        if isinstance(value, dict):
            return {k: timeless(v) for k, v in value.items() if k != "seconds"}
        return [timeless(v) for v in value] if isinstance(value, list) else value

    return {m: [timeless(run) for run in r["runs"]] for m, r in results["methods"].items()}


def test_task1_nan_loss_stops_the_method_before_it_is_saved(tmp_path, stages, capsys):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"loss became (nan|inf|-inf) at step \d+"):
        pipeline.run_bio(micro(methods=["fft"], task1={"lr": 1e30}), out, stages)
    assert "stage 3 (seed 0): fft" in capsys.readouterr().out, "stages 1-2 trained; Task 1 stopped"
    assert not (out / "seed-0" / "fft.json").exists(), "a diverged method must not be saved as finished"
    assert not (out / "results.json").exists()


def test_cli_exits_1_with_the_error_when_training_diverges(tmp_path, stages, capsys):
    from scale_cl.cli import main

    argv = ["bio", "--preset", "micro", "--methods", "fft", "--task1.lr", "1e30", "--out", str(tmp_path / "run")]
    argv += ["--cache", str(stages)]
    assert main(argv) == 1
    assert "scale-cl bio: error: the training loss became" in capsys.readouterr().err


class _Stop(TrainerCallback):
    """Raises ``error`` once, at the end of optimizer step ``step`` (after that step's evaluation and checkpoint)."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.error is not None:
            error, self.error = self.error, None
            raise error


class _Poison(TrainerCallback):
    """Makes every trainable weight NaN before optimizer step ``step + 1`` (after step ``step``'s checkpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                for param in model.parameters():
                    if param.requires_grad:
                        param.fill_(float("nan"))


def _task1_runs(monkeypatch, extra: list | None = None) -> dict[str, dict]:
    """Patches train_model so that Task-1 runs (they have a run_info) get ``extra`` callbacks; returns their weights."""
    real, trained = _TRAIN_MODEL, {}

    def train_model(model, dataset, args, callbacks=(), **kwargs):
        if kwargs.get("run_info"):
            callbacks = [*callbacks, *(extra or [])]
        trainer = real(model, dataset, args, callbacks=callbacks, **kwargs)
        if kwargs.get("run_info"):
            trained[kwargs["run_info"]["method"]] = trainable_state(trainer.model)
        return trainer

    _train_with(monkeypatch, train_model)
    return trained


@pytest.mark.slow
def test_killed_task1_run_resumes_from_its_checkpoint_bitwise(tmp_path, stages, monkeypatch):
    cfg = micro(methods=["lora", "scale_route"])
    straight_weights = _task1_runs(monkeypatch)
    straight = pipeline.run_bio(cfg, tmp_path / "straight", stages)  # short: no checkpoint
    assert not list((tmp_path / "straight").rglob("checkpoint-*"))

    monkeypatch.setattr(pipeline, "CHECKPOINT_MINUTES", 0.0)  # a checkpoint at every evaluation but the last
    out = tmp_path / "killed"
    _task1_runs(monkeypatch, [_Stop(3, KeyboardInterrupt())])
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_bio(cfg, out, stages)
    run_dir = out / "seed-0" / "lora.checkpoints"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-2"]
    assert not (out / "seed-0" / "lora.json").exists()

    resumed_weights = _task1_runs(monkeypatch)
    resumed = pipeline.run_bio(cfg, out, stages)
    assert _without_wall_times(resumed) == _without_wall_times(straight), "the resumed curve differs"
    for method in cfg.methods:
        a, b = straight_weights[method], resumed_weights[method]
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), f"{method}: weights differ"
    assert not run_dir.exists(), "a finished method's checkpoints are deleted"
    steps = [json.loads(line)["step"] for line in (out / "seed-0" / "lora.jsonl").read_text().splitlines()]
    assert steps == expected_steps(cfg), "records after the checkpoint are made once"


@pytest.mark.slow
def test_task1_nan_after_a_checkpoint_names_it_and_a_rerun_resumes(tmp_path, stages, monkeypatch):
    monkeypatch.setattr(pipeline, "CHECKPOINT_MINUTES", 0.0)
    out = tmp_path / "run"
    cfg = micro(methods=["scale_route"])
    _task1_runs(monkeypatch, [_Poison(2)])
    checkpoint = out / "seed-0" / "scale_route.checkpoints" / "checkpoint-2"
    with pytest.raises(NonFiniteLossError, match=rf"loss became nan at step 3.*{checkpoint}"):
        pipeline.run_bio(cfg, out, stages)
    assert not (out / "seed-0" / "scale_route.json").exists()
    assert [p.name for p in complete_checkpoints(checkpoint.parent)] == ["checkpoint-2"]
    _task1_runs(monkeypatch)
    results = pipeline.run_bio(cfg, out, stages)
    assert [r["step"] for r in results["methods"]["scale_route"]["runs"][0]["curve"]] == expected_steps(cfg)


class LookupModel(torch.nn.Module):
    """A hand-built 'model' that answers exactly the prompts it was given (others: token 0)."""

    def __init__(self, answers: dict[tuple[int, ...], int], vocab: int) -> None:
        super().__init__()
        self.answers, self.vocab = answers, vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, logits_to_keep=1):
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
            logits[row, -1, self.answers.get(tuple(ids[mask.bool()].tolist()), 0)] = 1.0
        return type("Output", (), {"logits": logits})()


def test_both_task0_views_read_the_people_they_name():
    """Task 0 held-out and QA-trained are scored on their own people: a model that knows only the
    QA-trained people's answers scores 100% on that view, 0% held-out; one that knows held-out
    birth dates only scores 1/2 there (two attributes asked)."""
    from scale_cl.eval.first_token import QAExample

    def people(first: int, count: int) -> list[QAExample]:
        return [
            QAExample((first + p, 100 + index), answer_token=10 + index, attribute=attribute)
            for p in range(count)
            for index, attribute in enumerate(("birth_date", "major"))
        ]

    trained, held_out, task1 = people(200, 4), people(300, 5), people(400, 3)
    tokenizer = type("Tokenizer", (), {"pad_token_id": 1})()
    data = pipeline.BioData(tokenizer, None, None, None, held_out, trained, task1, task0_completion=[])
    knows_trained = LookupModel({e.prompt_ids: e.answer_token for e in trained}, vocab=32)
    scores = pipeline.evaluate_tasks(knows_trained, data)
    assert scores["task0_trained"] == {"overall": 1.0, "birth_date": 1.0, "major": 1.0}
    assert scores["task0"]["overall"] == 0.0 and scores["task1"]["overall"] == 0.0
    dates = {e.prompt_ids: e.answer_token for e in held_out if e.attribute == "birth_date"}
    scores = pipeline.evaluate_tasks(LookupModel(dates, vocab=32), data)
    assert scores["task0"] == {"overall": 0.5, "birth_date": 1.0, "major": 0.0}
    assert scores["task0_trained"]["overall"] == 0.0


def test_early_evaluation_schedule_is_dense_first_then_sparse():
    from types import SimpleNamespace

    from scale_cl.train.callbacks import PeriodicEval

    tracker = PeriodicEval(lambda model: {"x": 1.0}, every=50, early_every=5, early_until=20)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    tracker.on_train_begin(None, state, None, model="model")
    for step in range(1, 121):
        state.global_step = step
        tracker.on_step_end(None, state, None, model="model")
    tracker.on_train_end(None, state, None, model="model")
    assert [r["step"] for r in tracker.records] == [0, 5, 10, 15, 20, 50, 100, 120]
    without = PeriodicEval(lambda model: {}, every=50)
    assert [s for s in range(121) if without.is_eval_step(s)] == [0, 50, 100]
    with pytest.raises(ValueError, match="early_every"):
        PeriodicEval(lambda model: {}, every=50, early_every=-1)


def test_qa_people_trains_task0_qa_on_fewer_people_and_shares_stage_1(stages, monkeypatch):
    """``data.qa_people`` shrinks only stage 2's people (and the QA-trained view with it): stage 1 is
    reused from a shared cache, the held-out people stay the same."""
    cache = stages
    full = micro(methods=["fft"])
    few = apply_overrides(full, {"data": {"qa_people": 5}})
    data, fewer = pipeline.build_data(full, cache), pipeline.build_data(few, cache)
    assert len(data.task0_train) == 30 * 6 and len(fewer.task0_train) == 5 * 6
    assert fewer.task0_trained == data.task0_trained[: 5 * 6] and fewer.task0_test == data.task0_test
    dir1, dir2 = pipeline.stage_models(full, data, 0, cache)
    trained_sizes = []
    real_train_model = pipeline.train_model

    def counting_train_model(model, dataset, *args, **kwargs):
        trained_sizes.append(len(dataset))
        return real_train_model(model, dataset, *args, **kwargs)

    monkeypatch.setattr(pipeline, "train_model", counting_train_model)
    few_dir1, few_dir2 = pipeline.stage_models(few, fewer, 0, cache)
    assert few_dir1 == dir1 and few_dir2 != dir2 and trained_sizes == [5 * 6]


def test_qa_loss_all_trains_the_new_cohorts_questions_and_leaves_stage_2_and_old_runs_alone(tmp_path):
    """``task1.qa_loss all`` puts the loss on every token of Task 1's (and later cohorts') QA; stage 2 keeps the
    answer-only loss, so its cache is shared; a run at the default keeps the identity it had before the setting."""
    answer_only = micro(methods=["fft"], sequence={"tasks": 2})
    everything = apply_overrides(answer_only, {"task1": {"qa_loss": "all"}})
    data, data_all = pipeline.build_data(answer_only, tmp_path), pipeline.build_data(everything, tmp_path)
    for new_cohort in (1, 2):
        for masked, full in zip(data.task_train(new_cohort), data_all.task_train(new_cohort), strict=True):
            assert masked["input_ids"] == full["input_ids"] and full["labels"] == full["input_ids"]
            prompt = masked["labels"].count(-100)
            assert prompt > 0 and masked["labels"][prompt:] == full["input_ids"][prompt:]
    assert [x["labels"] for x in data_all.task0_train] == [x["labels"] for x in data.task0_train]
    assert any(-100 in x["labels"] for x in data_all.task0_train)
    assert pipeline.stage_keys(answer_only, 0) == pipeline.stage_keys(everything, 0)
    assert "qa_loss" not in result_settings(asdict(answer_only.task1))
    assert result_settings(asdict(everything.task1))["qa_loss"] == "all"


def test_scale_initialisation_is_seeded_by_the_run_seed():
    """``--seeds 0 1 2`` varies SCALE's random and randomised-SVD initialisers, not only the data order."""
    from transformers import GPTNeoXForCausalLM

    from scale_cl.methods import prepare

    cfg = micro()
    assert [cfg.options.prepare_options("scale_route", s)["scale"].seed for s in (0, 2)] == [0, 2]
    base = pipeline.backbone_config(cfg, vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=1)

    def new_weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(copy.deepcopy(base))  # upscale widens the model's config in place
        model = prepare(model, "scale_route", **cfg.options.prepare_options("scale_route", seed))
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    first, again, other = new_weights(0), new_weights(0), new_weights(1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert any(not torch.equal(first[n], other[n]) for n in first)


def test_a_setting_spelt_as_int_or_float_is_one_cached_stage():
    """``--pretrain.epochs 120`` (parsed as 120.0) and the preset's 120 must find the same cached stage 1."""
    from dataclasses import asdict

    from_cli = parse_settings(["bio", "--pretrain.epochs", "120", "--task0.lr", "1"]).bio
    in_code = apply_overrides(preset("small"), {"pretrain": {"epochs": 120}, "task0": {"lr": 1}})
    assert json.dumps(asdict(from_cli.pretrain)) == json.dumps(asdict(in_code.pretrain))
    assert pipeline._key(asdict(from_cli.task0)) == pipeline._key(asdict(in_code.task0))


def test_medium_preset_is_small_twice_as_wide_and_valid():
    """medium differs from small only where the README says (width, epochs, SCALE's added width), and
    its stage 1 is the cache entry of ``--preset small --pretrain.epochs 60 --model.hidden_size 256
    --model.intermediate_size 1024`` (the measured row)."""
    from dataclasses import asdict

    small, medium = preset("small"), preset("medium")
    pipeline.validate(medium)
    assert (medium.model.hidden_size, medium.model.intermediate_size, medium.pretrain.epochs) == (256, 1024, 60.0)
    assert (medium.options.scale.hidden_up, medium.options.scale.ffn_up) == (128, 128)
    assert (medium.data, medium.task0, medium.task1) == (small.data, small.task0, small.task1)
    row = parse_settings(
        ["bio", "--pretrain.epochs", "60", "--model.hidden_size", "256", "--model.intermediate_size", "1024"]
    ).bio
    assert json.dumps([asdict(row.model), asdict(row.pretrain)]) == json.dumps(
        [asdict(medium.model), asdict(medium.pretrain)]
    )
    assert parse_settings(["bio", "--preset", "medium"]).bio == medium


@pytest.mark.slow
def test_pseudo_replay_mixes_in_the_task0_models_own_text_sampled_once(tmp_path, stages, monkeypatch):
    """A quarter of every Task-1 batch is text the Task-0 model sampled (loss on every token), drawn once per seed and
    Task-0 model and cached beside the stage models, so a second run with the same cache samples nothing."""
    cfg = micro(
        methods=["scale_route"],
        task1={"pseudo_replay_ratio": 0.25, "pseudo_replay_sequences": 8, "pseudo_replay_tokens": 12},
        options={"scale": {"router": "likelihood"}},
    )
    draws, datasets = [], []
    generate, training_data = pipeline.generate_blocks, pipeline.task1_training_data
    monkeypatch.setattr(pipeline, "generate_blocks", lambda *a, **k: draws.append(a[2:4]) or generate(*a, **k))
    monkeypatch.setattr(
        pipeline, "task1_training_data", lambda *a, **k: datasets.append(training_data(*a, **k)) or datasets[-1]
    )
    cache = stages
    pipeline.run_bio(cfg, tmp_path / "a", cache)
    assert draws == [(8, 12)]
    mix = datasets[0]
    sampled = [mix[i] for i in range(len(mix)) if mix.source(i)[0] == "replay"]
    assert len(sampled) == len(mix) // 4
    eos = pipeline.build_data(cfg, cache).tokenizer.eos_token_id
    for item in sampled:
        assert len(item["input_ids"]) == 12 and item["input_ids"][0] == eos and item["labels"] == item["input_ids"]
    wise = replace(cfg.task1, wise_ft_alphas=(0.0, 0.5), likelihood_control=True)
    pipeline.run_bio(replace(cfg, methods=["fft"], task1=wise), tmp_path / "b", cache)
    assert draws == [(8, 12)], "the second run reads the cached draw"
    fft = json.loads((tmp_path / "b" / "seed-0" / "fft.json").read_text())
    # WiSE-FT readings: alpha 0 is the Task-0 model itself (the curve's step 0)
    assert [r["alpha"] for r in fft["readings"]] == [0.0, 0.5]
    assert {k: fft["readings"][0][k] for k in ("task0", "task1")} == {k: fft["curve"][0][k] for k in ("task0", "task1")}
    # task1.likelihood_control: FFT's model and the Task-0 model mixed, read with the router's separation
    routers = ["likelihood", "confidence", "hybrid", "calibrated"]
    assert [control["router"] for control in fft["likelihood_control"]] == routers
    for control in fft["likelihood_control"]:
        assert control["control"] == "two models" and 0 <= control["task1"]["overall"] <= 1
        assert 0 <= control["likelihood_router"]["auroc"] <= 1
    assert "likelihood_router" not in fft["curve"][-1]  # FFT alone has no router
    # a likelihood-routed run records, at every evaluation, whether the router tells Task 0 from Task 1
    curve = json.loads((tmp_path / "a" / "seed-0" / "scale_route.json").read_text())["curve"]
    for record in curve[1:]:
        router = record["likelihood_router"]
        assert 0 <= router["auroc"] <= 1 and 0 <= router["auroc_trained"] <= 1
        assert all(0 < router[f"{name}_base_weight"] < 1 for name in ("task0", "task0_trained", "task1"))


def test_one_pass_readings_keep_each_router_and_each_gate_objective_apart():
    """The report's one-pass readings: each router at alpha 1 (not the control, not other alphas), a calibrated
    reading fitted by another objective than the recipe's on its own row, only where every seed has it."""
    from scale_cl.experiments.bio.report import one_pass_readings

    def accuracy(value: float) -> dict:
        return {view: {"overall": value} for view in ("task0", "task0_trained", "task1")}

    def run(shift: float) -> dict:
        return {
            "curve": [accuracy(0.8)],
            "readings": [
                {"alpha": 1.0, **accuracy(0.1)},  # as trained: no router
                {"alpha": 1.0, "router": "likelihood", **accuracy(0.7 + shift)},
                {"alpha": 2.0, "router": "likelihood", **accuracy(0.0)},
                {"alpha": 1.0, "router": "calibrated", "gate_fit": {"objective": "classification"}, **accuracy(0.6)},
                {"alpha": 1.0, "router": "calibrated", "gate_fit": {"objective": "likelihood"}, **accuracy(0.5)},
                {"alpha": 1.0, "router": "confidence", "control": "two models", **accuracy(0.0)},
            ],
        }

    found = one_pass_readings([run(0.0), run(0.1)])
    assert list(found) == ["likelihood", "calibrated", "calibrated (likelihood fit)"]  # the recipe's: plain
    assert found["likelihood"]["each"]["task1"] == pytest.approx([0.7, 0.8])
    assert found["calibrated"]["task0_kept"]["mean"] == pytest.approx(0.75)
    assert found["calibrated (likelihood fit)"]["task1"]["mean"] == pytest.approx(0.5)
    assert one_pass_readings([run(0.0), {"curve": [accuracy(0.8)]}]) == {}  # a seed without readings: none shown
