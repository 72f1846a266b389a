"""The biography benchmark as a sequence of tasks: the cohorts, the metrics' definitions, a micro run of
each strategy end to end (matrix, growth, figures), resuming a killed sequence bitwise, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

import scale_cl.experiments.bio.sequence as sequence
from scale_cl.data import splits
from scale_cl.eval.continual import accuracy_matrix, continual_metrics
from scale_cl.experiments.bio import pipeline
from scale_cl.experiments.bio.config import BioConfig, preset
from scale_cl.experiments.overrides import apply_overrides
from scale_cl.experiments.sweep.experiments import BioExperiment

TASKS = 3


def micro_sequence(**overrides) -> BioConfig:
    """The micro preset as a sequence of `TASKS` tasks of 6 steps; ``overrides`` by dotted name."""
    nested: dict = {}
    for name, value in {"sequence.tasks": TASKS, "task1.max_steps": 6, **overrides}.items():
        *sections, key = name.split(".")
        place = nested
        for section in sections:
            place = place.setdefault(section, {})
        place[key] = value
    return apply_overrides(preset("micro"), nested)


def test_cohorts_follow_task1_and_shrink_past_five():
    one, five = splits(200), splits(200, 5)
    assert one["task1"] == five["task1"] == range(100, 120)
    assert [five[f"task{j}"] for j in range(1, 6)] == [range(100 + 20 * j, 120 + 20 * j) for j in range(5)]
    seven = splits(200, 7)
    assert [len(seven[f"task{j}"]) for j in range(1, 8)] == [14] * 7 and seven["task7"].stop <= 200
    assert {k: one[k] for k in ("pretrain", "task0_train", "task0_test")} == {
        k: seven[k] for k in ("pretrain", "task0_train", "task0_test")
    }
    with pytest.raises(ValueError, match="101 tasks of new people do not fit 200 people"):
        splits(200, 101)


def test_metrics_are_the_standard_definitions():
    """A 3-task example worked by hand (rows: after task i; columns: task j)."""
    matrix = [
        [0.8, 0.1, 0.0],
        [0.6, 0.9, 0.2],
        [0.5, 0.7, 0.95],
    ]
    metrics = continual_metrics(matrix)
    assert metrics["acc"] == pytest.approx((0.5 + 0.7 + 0.95) / 3)
    assert metrics["bwt"] == pytest.approx(((0.5 - 0.8) + (0.7 - 0.9)) / 2)
    assert metrics["fwt"] == pytest.approx(((0.1 - 0.1) + (0.2 - 0.0)) / 2)
    assert metrics["la"] == pytest.approx((0.9 + 0.95) / 2)
    assert metrics["forgetting_per_task"] == pytest.approx([0.8 - 0.5, 0.9 - 0.7])
    assert metrics["forgetting"] == pytest.approx(0.25) and metrics["max_forgetting"] == pytest.approx(0.3)
    names = ("task0", "task1", "task2")
    rows = [{name: {"overall": value} for name, value in zip(names, row, strict=True)} for row in matrix]
    assert accuracy_matrix(rows, ["task0", "task1", "task2"]) == matrix
    with pytest.raises(ValueError, match="one row per task"):
        accuracy_matrix(rows[:2], ["task0", "task1", "task2"])
    with pytest.raises(ValueError, match="square accuracy matrix"):
        continual_metrics([[1.0, 0.5]])


# per-task growth, SCALE-Preserve read (and trained) with the nested router, FFT with its control
PER_TASK = {"sequence.growth": "per_task", "options.scale.router": "nested", "task1.likelihood_control": True}


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Path:
    """One cache of the tokenizer and stage-1/2 models for the module: its tests are about the tasks after stage 2,
    and each would otherwise train the same stages again (their keys hold every setting they depend on)."""
    return tmp_path_factory.mktemp("bio-sequence-cache")


@pytest.fixture(scope="module")
def per_task(tmp_path_factory, stages) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bio-sequence") / "per-task"
    cfg = micro_sequence(**PER_TASK, methods=["fft", "scale_preserve", "lora"])
    return out, sequence.run_bio_sequence(cfg, out, stages)


@pytest.mark.slow
def test_fft_s_control_mixes_the_task0_model_and_each_task_s_model_and_preserve_reads_its_stages(per_task):
    """task1.likelihood_control in a sequence: after task k, the Task-0 model and FFT's model after each task so far
    (k + 1 models) mixed, read with the router's AUROC; its matrix, metrics and a row of results.md. SCALE-Preserve
    grown per task with the nested router records its router's separation at every evaluation."""
    out, results = per_task
    fft = results["methods"]["fft"]["runs"][0]
    control = fft["control"]
    assert len(control["matrix"]) == TASKS + 1 and control["metrics"] == continual_metrics(control["matrix"])
    assert control["rows"][0] == fft["rows"][0]  # before Task 1: the Task-0 model alone
    assert control["router"] == "likelihood"  # nested is the one-model form: its control mixes by the posterior
    assert all(0 <= row["likelihood_router"]["auroc"] <= 1 for row in control["rows"][1:])
    assert 0 < control["rows"][-1]["likelihood_router"]["task0_base_weight"] < 1  # a mixture, neither model alone
    assert (
        "fft + the Task-0 model and each task's model, mixed (control) | kept apart |"
        in (out / "results.md").read_text()
    )
    preserve = results["methods"]["scale_preserve"]["runs"][0]
    assert "control" not in preserve and all("likelihood_router" in row for row in preserve["rows"])


@pytest.mark.slow
def test_a_sequence_reports_the_matrix_metrics_and_figures(per_task):
    out, results = per_task
    for method, summary in results["methods"].items():
        run = summary["runs"][0]
        assert len(run["matrix"]) == TASKS + 1 and all(len(row) == TASKS + 1 for row in run["matrix"])
        assert run["metrics"] == continual_metrics(run["matrix"])
        assert [record["task"] for record in run["curve"]].count(TASKS) > 1
        steps = [record["step"] for record in run["curve"]]
        assert steps == sorted(steps) and steps[-1] == TASKS * 6  # one step count over the whole sequence
        # row i is the evaluation that ended task i
        ends = [r for r in run["curve"] if r["task_step"] == 6]
        assert [row["task1"] for row in run["rows"][1:]] == [r["task1"] for r in ends]
        assert f"{method} (growth: {run['growth']})" in (out / "results.md").read_text()
    for figure in ("matrix.png", "sequence.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "accuracy.png").exists()
    assert not list(out.glob("seed-0/*.tasks"))  # finished: no resume state left


@pytest.mark.slow
def test_per_task_growth_grows_scale_and_lora_and_their_cost(per_task):
    _, results = per_task
    growth = {m: [p["total"] for p in r["runs"][0]["parameters"]] for m, r in results["methods"].items()}
    assert growth["fft"][0] == growth["fft"][-1]
    assert growth["scale_preserve"][0] < growth["scale_preserve"][1] < growth["scale_preserve"][2]
    assert growth["lora"][0] < growth["lora"][-1]  # a stacked adapter per task
    flops = {
        m: [p["inference_flops_per_token"] for p in r["runs"][0]["parameters"]] for m, r in results["methods"].items()
    }
    assert flops["fft"][0] == flops["fft"][-1] and flops["scale_preserve"][0] < flops["scale_preserve"][-1]
    for method, summary in results["methods"].items():
        for cost in summary["runs"][0]["parameters"]:
            assert cost["train_flops_per_token"] > cost["inference_flops_per_token"] > 0, method
    assert results["methods"]["scale_preserve"]["runs"][0]["growth"] == "per_task"
    assert results["methods"]["fft"]["runs"][0]["growth"] == "once"


@pytest.mark.slow
def test_a_killed_sequence_resumes_to_the_same_result(per_task, stages, tmp_path, monkeypatch):
    """Killed during task 3 (after task 2 was saved): the re-run rebuilds the model (grown twice), loads its state
    and ends with bitwise the uninterrupted run's rows."""
    reference, _ = per_task
    cfg = micro_sequence(**PER_TASK, methods=["scale_preserve", "lora", "fft"])
    real, calls = sequence.train_model, []

    def dies_in_task_3(model, dataset, args, **kwargs):  # once for SCALE (grown twice), once for LoRA (3 adapters)
        calls.append((kwargs["run_info"]["method"], kwargs["run_info"]["task"]))
        if calls[-1][1] == 3 and calls.count(calls[-1]) == 1 and calls[-1][0] != "fft":
            raise KeyboardInterrupt
        return real(model, dataset, args, **kwargs)

    monkeypatch.setattr(sequence, "train_model", dies_in_task_3)
    out = tmp_path / "run"
    for method in ("scale_preserve", "lora"):  # killed in one, the next run finishes it and is killed in the other
        with pytest.raises(KeyboardInterrupt):
            sequence.run_bio_sequence(cfg, out, stages)
        state = out / "seed-0" / f"{method}.tasks"
        assert json.loads((state / "progress.json").read_text())["tasks_done"] == 2
        assert set(load_file(state / "task-2.safetensors")) and not (state / "task-1.safetensors").exists()
    sequence.run_bio_sequence(cfg, out, stages)
    trained = [("scale_preserve", t) for t in (1, 2, 3, 3)] + [("lora", t) for t in (1, 2, 3, 3)]
    assert calls == trained + [("fft", t) for t in (1, 2, 3)]  # each re-run trains task 3 only
    for method in cfg.methods:
        got = json.loads((out / "seed-0" / f"{method}.json").read_text())
        want = json.loads((reference / "seed-0" / f"{method}.json").read_text())
        assert got["rows"] == want["rows"] and got["parameters"] == want["parameters"]


@pytest.mark.slow
def test_a_sequence_trains_every_task_and_keeps_earlier_stages_frozen(tmp_path, stages, monkeypatch):
    """Each task moves what the method trains; under per-task growth an earlier stage's weights never move again."""
    cfg = micro_sequence(**{"sequence.growth": "per_task", "methods": ["scale_adapt"]})
    real, seen = sequence.train_model, []

    def watched(model, dataset, args, **kwargs):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = real(model, dataset, args, **kwargs)
        moved = {n for n, p in model.named_parameters() if not p.detach().equal(before[n])}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        seen.append((moved, trainable, set(before)))
        return trainer

    monkeypatch.setattr(sequence, "train_model", watched)
    sequence.run_bio_sequence(cfg, tmp_path / "run", stages)
    assert len(seen) == TASKS
    for task, (moved, trainable, names) in enumerate(seen, start=1):
        assert moved and moved <= trainable
        earlier_norms = {n for n in names if ".inner." in n}  # each earlier stage's norm gains, kept inside
        assert bool(earlier_norms) == (task > 1) and not earlier_norms & moved
        merged = {n for n in names if n.endswith("query_key_value.weight")}  # the original W, then merged stages
        assert merged and not merged & moved


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("stacked", "merged"))
def test_lora_adds_an_adapter_per_task(kind, tmp_path, stages, monkeypatch):
    """Stacked: each task trains only its own adapter, the earlier ones act and stay frozen (inference FLOPs grow);
    merged: the finished adapter is merged into the weights and a fresh one trains (parameters stay the same)."""
    cfg = micro_sequence(**{"sequence.growth": "per_task", "sequence.lora_per_task": kind, "methods": ["lora"]})
    real, seen = sequence.train_model, []

    def watched(model, dataset, args, **kwargs):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = real(model, dataset, args, **kwargs)
        seen.append({n for n, p in model.named_parameters() if not p.detach().equal(before[n])})
        return trainer

    monkeypatch.setattr(sequence, "train_model", watched)
    results = sequence.run_bio_sequence(cfg, tmp_path / "run", stages)
    run = results["methods"]["lora"]["runs"][0]
    costs = run["parameters"]
    assert run["growth"] == f"per_task ({kind})"
    if kind == "stacked":
        for task, moved in enumerate(seen, start=1):
            adapter = "default" if task == 1 else f"task{task}"
            assert moved and all(f".{adapter}." in name for name in moved), (task, sorted(moved)[:3])
        assert costs[0]["total"] < costs[1]["total"] < costs[2]["total"]
        assert costs[0]["inference_flops_per_token"] < costs[2]["inference_flops_per_token"]
    else:
        assert all(moved and all(".default." in name for name in moved) for moved in seen)
        assert costs[0]["total"] == costs[2]["total"] and costs[0]["trainable"] == costs[2]["trainable"]


def test_sequence_refusals_before_anything_is_written(tmp_path):
    for overrides, message in (
        ({"sequence.growth": "per_task", "methods": ["scale_route"]}, "cannot grow scale_route"),
        ({"task1.replay_ratio": 0.25}, "does not take task1.replay_ratio"),
        ({"options.distill_weight": 1.0, "methods": ["scale_preserve"]}, "does not take options.distill_weight"),
        ({"sequence.tasks": 61}, "61 tasks of new people do not fit 120 people"),
    ):
        with pytest.raises(ValueError, match=message):
            sequence.run_bio_sequence(micro_sequence(**overrides), tmp_path / "run")
        assert not (tmp_path / "run").exists()
    cfg = micro_sequence()
    with pytest.raises(ValueError, match="sweep bio does not run a sequence of tasks yet"):
        BioExperiment(cfg).validate(cfg)
    with pytest.raises(ValueError, match=r"runs through scale_cl\.experiments\.bio\.sequence\.run_bio_sequence"):
        pipeline.run_bio(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_calibrated_sequence_reads_each_task_with_a_gate_fitted_on_its_questions(tmp_path, stages):
    """options.scale.router calibrated: after task k, SCALE-Preserve grown per task (k + 1 experts) is read with a gate
    fitted on task k's training questions against the Task-0 model's samples; its row records the gate and the fit.
    FFT's control (the Task-0 model and each task's model) is fitted the same way."""
    cfg = micro_sequence(**{**PER_TASK, "options.scale.router": "calibrated"}, methods=["fft", "scale_preserve"])
    results = sequence.run_bio_sequence(cfg, tmp_path / "run", stages)["methods"]
    preserve = results["scale_preserve"]["runs"][0]
    fits = [row["gate_fit"] for row in preserve["rows"][1:]]
    assert [fit["experts"] for fit in fits] == [2, 3, 4]
    assert all(
        set(row["gate"])
        == {"router_prior", "router_decay", "router_prefix_weight", "router_entropy_weight", "router_top_weight"}
        for row in preserve["rows"][1:]
    )
    control = results["fft"]["runs"][0]["control"]
    assert control["router"] == "calibrated"
    assert [row["gate_fit"]["experts"] for row in control["rows"][1:]] == [2, 3, 4]
