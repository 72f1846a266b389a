"""Continual pre-training as a sequence of domains: the perplexity matrix with the old domain, the metrics
on -ln(perplexity), per-task growth, resuming a killed sequence bitwise, and the refusals."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import scale_cl.experiments.cpt.sequence as sequence
from scale_cl.eval.continual import continual_metrics
from scale_cl.experiments.cpt.config import CptSequenceConfig
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.experiments.cpt.sequence import run_cpt_sequence
from scale_cl.experiments.sweep.experiments import CptExperiment
from tests.conftest import SYLLABLES, _documents, tiny_config
from tests.e2e.test_cpt import base_readings
from tests.exactness import assert_exact_to_rounding

STEPS = 4


def sequence_config(workspace: Path, methods: list[str], growth: str = "once", **fields):
    """tiny_config's domain first, then two more (other syllable mixes), `STEPS` steps each."""
    later = []
    for index, vocabulary in enumerate((SYLLABLES[:5], SYLLABLES[5:]), start=2):
        path = workspace / f"domain{index}.jsonl"
        if not path.is_file():
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(index, 120, vocabulary, "")))
        later.append(f"domain{index}={path}")
    cfg = tiny_config(workspace, methods, steps=STEPS, save_every=2)
    seq = CptSequenceConfig(first="domain1", then=later, growth=growth, **fields)
    return replace(cfg, sequence=seq, eval=replace(cfg.eval, every=2))


def dying_in_task_3(monkeypatch) -> list[int]:
    """Make the sequence's training raise KeyboardInterrupt when task 3 starts the first time; returns the tasks
    trained (in order, as they are called)."""
    real, calls = sequence.train_model, []

    def dies_in_task_3(model, train, args, **kwargs):
        calls.append(kwargs["run_info"]["task"])
        if calls == [1, 2, 3]:
            raise KeyboardInterrupt
        return real(model, train, args, **kwargs)

    monkeypatch.setattr(sequence, "train_model", dies_in_task_3)
    return calls


@pytest.fixture(scope="module")
def finished(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpt-sequence") / "run"
    cfg = sequence_config(workspace, ["fft", "scale_preserve", "lora"], growth="per_task")
    return out, run_cpt_sequence(cfg, out)


@pytest.mark.exactness
def test_the_perplexity_matrix_holds_the_old_domain_and_every_new_one(finished, workspace):
    out, results = finished
    for method, r in results.items():
        assert r["columns"] == ["toy", "domain1", "domain2", "domain3"] and r["tasks"] == r["columns"]
        assert len(r["ppl_matrix"]) == 4 and all(len(row) == 4 for row in r["ppl_matrix"])
        assert r["matrix"] == [[-math.log(v) for v in row] for row in r["ppl_matrix"]]
        assert r["metrics"] == continual_metrics(r["matrix"])
        assert [c["task"] for c in r["parameters"]] == [1, 2, 3]
        assert r["curve"][-1]["step"] == 3 * STEPS
        learned = [r["ppl_matrix"][task][task] for task in (1, 2, 3)]  # each domain right after its task
        assert all(now < start for now, start in zip(learned, r["ppl_matrix"][0][1:], strict=True)), method
    # every method starts as the base: its first row as close to the base's in float64 as the base's fp32 row
    cfg = sequence_config(workspace, ["fft"])
    evals = sequence.sequence_corpora(cfg, AutoTokenizer.from_pretrained(cfg.model))[1]
    assert list(evals) == results["fft"]["columns"]
    stock, exact = base_readings(cfg.model, [data.blocks for data in evals.values()], cfg.eval.batch_size)
    for method, r in results.items():
        assert_exact_to_rounding(torch.tensor(r["ppl_matrix"][0]), exact, stock=stock, what=f"{method} before task 1")
    assert results["scale_preserve"]["growth"] == "per_task" and results["fft"]["growth"] == "once"
    totals = [c["total"] for c in results["scale_preserve"]["parameters"]]
    assert totals[0] < totals[1] < totals[2]
    text = (out / "results.md").read_text()
    assert "scale_preserve (per_task): perplexity after each task" in text and "| fft | once |" in text
    assert not list(out.glob("*/task-*.safetensors"))  # finished: no resume state left


def test_a_killed_sequence_resumes_to_the_same_result(finished, workspace, tmp_path, monkeypatch):
    reference, _ = finished
    cfg = sequence_config(workspace, ["scale_preserve"], growth="per_task")
    calls = dying_in_task_3(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_cpt_sequence(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "scale_preserve" / "progress.json").read_text())["tasks_done"] == 2
    got = run_cpt_sequence(cfg, tmp_path / "run")["scale_preserve"]
    assert calls == [1, 2, 3, 3]
    want = json.loads((reference / "scale_preserve" / "result.json").read_text())
    assert got["ppl_matrix"] == want["ppl_matrix"] and got["parameters"] == want["parameters"]


@pytest.mark.slow
def test_the_control_mixes_the_base_and_every_task_s_model_and_a_grown_preserve_reads_them_in_one_pass(
    workspace, tmp_path
):
    """eval.likelihood_control in a sequence: FFT's control after task k mixes the base and FFT's model after each of
    the k tasks (k + 1 models); SCALE-Preserve grown per task, read with the nested router, is no control's."""
    cfg = sequence_config(workspace, ["fft", "scale_preserve"], growth="per_task")
    cfg = replace(cfg, eval=replace(cfg.eval, likelihood_control=True))
    cfg = replace(cfg, options=replace(cfg.options, scale=replace(cfg.options.scale, router="nested")))
    results = run_cpt_sequence(cfg, tmp_path / "run")
    fft, preserve = results["fft"], results["scale_preserve"]
    control = fft["control"]
    assert control["router"] == "likelihood"  # nested is the one-model form: its control mixes by the posterior
    assert control["ppl_matrix"][0] == fft["ppl_matrix"][0]  # before any task: the base alone
    assert len(control["matrix"]) == 4 and control["metrics"] == continual_metrics(control["matrix"])
    assert control["ppl_matrix"][1:] != fft["ppl_matrix"][1:]
    assert control["ppl_matrix"][3][0] < fft["ppl_matrix"][3][0], "the base's expert keeps the old domain better"
    assert "control" not in preserve and preserve["growth"] == "per_task"
    assert "(control) | kept apart |" in (tmp_path / "run" / "results.md").read_text()
    assert not (tmp_path / "run" / "fft" / "experts").exists()  # finished: the kept models are gone


def test_sequence_refusals_before_anything_is_written(workspace, tmp_path):
    base = sequence_config(workspace, ["scale_route"])
    cases = (
        (replace(base, sequence=replace(base.sequence, growth="per_task")), "cannot grow scale_route"),
        (
            replace(base, data=replace(base.data, replay=[f"{workspace / 'old.jsonl'}"], replay_ratio=0.25)),
            "replay_ratio",
        ),
        (replace(base, eval=replace(base.eval, wise_ft_alphas=(0.5,))), "eval.wise_ft_alphas"),
        (replace(base, data=replace(base.data, old_eval=[])), "give data.old_eval"),
        (replace(base, sequence=replace(base.sequence, first="toy")), r"\['toy'\] are also old-domain set names"),
    )
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            run_cpt_sequence(cfg, tmp_path / "run")
        assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"runs through scale_cl\.experiments\.cpt\.sequence\.run_cpt_sequence"):
        run_cpt(base, tmp_path / "run")
    with pytest.raises(ValueError, match="sweep cpt does not run a sequence of domains yet"):
        CptExperiment(base).validate(base)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="NAME=SOURCE"):
        CptSequenceConfig(then=["domain2"])
    with pytest.raises(ValueError, match="distinct names"):
        CptSequenceConfig(first="a", then=["a=x.jsonl"])


@pytest.mark.slow
@pytest.mark.exactness
def test_a_calibrated_sequence_fits_each_task_s_gate_and_resumes_with_it(workspace, tmp_path, monkeypatch):
    """options.scale.router calibrated in a sequence: after each task SCALE-Preserve grown per task (k + 1 experts
    after task k) is read with a gate fitted on that task's training blocks against the base's samples, and FFT's
    control (k + 1 models) is fitted the same way; the gate is a setting, not a weight, so a resumed sequence
    re-sets it and ends bitwise as the uninterrupted one. The tasks train unrouted (the gate is a reading). Killed in
    FFT's task 3, the control resumes with the models it kept after tasks 1 and 2, not trained again (one run shows
    both: the control's kept models do not depend on its router)."""
    cfg = sequence_config(workspace, ["fft", "scale_preserve"], growth="per_task")
    cfg = replace(cfg, eval=replace(cfg.eval, likelihood_control=True))
    cfg = replace(cfg, options=replace(cfg.options, scale=replace(cfg.options.scale, router="calibrated")))
    whole = run_cpt_sequence(cfg, tmp_path / "whole")
    preserve = whole["scale_preserve"]
    ends = [record for record in preserve["curve"] if "gate_fit" in record and record["task_step"]]  # not a start
    assert [record["task"] for record in ends] == [1, 2, 3]
    assert [record["gate_fit"]["experts"] for record in ends] == [2, 3, 4]
    assert [[record["ppl"][name] for name in preserve["columns"]] for record in ends] == preserve["ppl_matrix"][1:]
    assert whole["fft"]["control"]["ppl_matrix"][1:] != whole["fft"]["ppl_matrix"][1:]
    assert whole["fft"]["control"]["router"] == "calibrated"  # the control is read as the model is
    # the gate is a reading: each task trains unrouted, so the curve as trained is a plain sequence's, bitwise
    plain = replace(cfg, options=replace(cfg.options, scale=replace(cfg.options.scale, router="cosine")))
    plain_curve = run_cpt_sequence(replace(plain, methods=["scale_preserve"]), tmp_path / "plain")["scale_preserve"]
    trained = [record["ppl"] for record in preserve["curve"] if record["task_step"] and "gate" not in record]
    assert trained == [record["ppl"] for record in plain_curve["curve"] if record["task_step"]]
    calls = dying_in_task_3(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_cpt_sequence(cfg, tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run" / "fft" / "experts").iterdir()) == [
        "task-1.safetensors",
        "task-2.safetensors",
    ]
    resumed = run_cpt_sequence(cfg, tmp_path / "run")
    assert calls == [1, 2, 3, 3, 1, 2, 3]  # FFT's finished tasks are not trained again; then SCALE-Preserve's three
    for method in ("fft", "scale_preserve"):
        assert resumed[method]["ppl_matrix"] == whole[method]["ppl_matrix"], method
    # bitwise, as the sequence's own resume: the kept models reload from safetensors exactly, and the mixture reads
    # them by the same code on the same data
    assert resumed["fft"]["control"]["ppl_matrix"] == whole["fft"]["control"]["ppl_matrix"]
