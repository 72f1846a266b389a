"""The biography benchmark end to end on the micro preset: outputs, resuming, bad inputs, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scale_cl.experiments.bio.pipeline as pipeline
from scale_cl.cli import build_parser, main
from scale_cl.cli.options import apply_overrides
from scale_cl.experiments.bio.config import ALL_METHODS, BioConfig, preset


def micro(**overrides) -> BioConfig:
    return apply_overrides(preset("micro"), overrides)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bio") / "run"
    return out, pipeline.run_bio(micro(), out)


def test_micro_run_writes_figure_tables_and_curves_for_every_method(finished):
    out, results = finished
    assert set(results["methods"]) == set(ALL_METHODS)
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    saved = json.loads((out / "results.json").read_text())
    cfg = preset("micro")
    for method, result in saved["methods"].items():
        assert f"| {method} |" in table
        curve = result["runs"][0]["curve"]
        steps = [record["step"] for record in curve]
        assert steps[0] == 0 and steps[-1] == cfg.task1.max_steps
        assert steps == sorted(set(steps))
        for record in curve:
            for task in ("task0", "task1"):
                assert 0.0 <= record[task]["overall"] <= 1.0
                assert {"birth_date", "birth_city", "university", "major", "employer", "employer_city"} <= set(
                    record[task]
                )
        assert result["trainable"] > 0
        assert result["task0_min"]["mean"] <= result["task0_start"]["mean"]
    # Every method starts from the same Task-0 model and preserves its function at step 0, so the
    # step-0 accuracies agree; fft trains everything, the others less.
    starts = {m: r["runs"][0]["curve"][0] for m, r in saved["methods"].items()}
    assert len({json.dumps(s["task0"], sort_keys=True) for s in starts.values()}) == 1
    assert len({json.dumps(s["task1"], sort_keys=True) for s in starts.values()}) == 1
    counts = {m: r["trainable"] for m, r in saved["methods"].items()}
    assert counts["fft"] == max(counts.values())
    assert counts["scale_adapt"] == counts["scale_route"] > counts["scale_preserve"]


def test_rerun_recomputes_nothing(finished, monkeypatch):
    out, results = finished

    def no_training(*args, **kwargs):
        raise AssertionError("a finished stage was trained again")

    monkeypatch.setattr(pipeline, "run_stage", no_training)
    again = pipeline.run_bio(micro(), out)
    assert again["methods"].keys() == results["methods"].keys()
    for method in results["methods"]:
        assert again["methods"][method]["runs"] == results["methods"][method]["runs"]


def test_killed_run_resumes_without_redoing_finished_work(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = micro(methods=["fft", "lora", "scale_route"])
    real = pipeline.run_stage
    calls: list[str] = []

    def killed_at_lora(model, dataset, *args, **kwargs):
        if type(model).__name__.startswith("Peft"):
            raise KeyboardInterrupt  # the process is killed while training LoRA
        calls.append(type(model).__name__)
        return real(model, dataset, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_stage", killed_at_lora)
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

    monkeypatch.setattr(pipeline, "run_stage", counted)
    results = pipeline.run_bio(cfg, out)
    assert len(calls) == 2 and calls[0].startswith("Peft")  # lora and scale_route only
    assert set(results["methods"]) == {"fft", "lora", "scale_route"}
    assert (out / "seed-0" / "fft.json").read_bytes() == fft_before
    assert not list(out.rglob("*.tmp"))


def test_interrupted_stage_cache_is_not_taken_as_finished(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = pipeline.GPTNeoXForCausalLM.save_pretrained

    def half_written(self, path, **kwargs):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pipeline.GPTNeoXForCausalLM, "save_pretrained", half_written)
    with pytest.raises(OSError, match="disk full"):
        pipeline.run_bio(micro(methods=["fft"]), out)
    assert not [p for p in (out / "cache").iterdir() if p.name.startswith("stage") and not p.name.endswith(".tmp")]

    monkeypatch.setattr(pipeline.GPTNeoXForCausalLM, "save_pretrained", real_save)
    results = pipeline.run_bio(micro(methods=["fft"]), out)  # the re-run redoes the stage and finishes
    assert set(results["methods"]) == {"fft"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"methods": ["fft", "dreambooth"]}, "unknown methods"),
        ({"preset": "huge"}, "unknown preset"),
        ({"data": {"people": 5}}, "at least 10 people"),
        ({"data": {"pools": "tiny"}}, "unknown biography preset"),
        ({"data": {"attributes": ["major", "shoe_size"]}}, "unknown attributes"),
        ({"task1": {"learning_rate": 1.0}}, "unknown setting 'task1.learning_rate'"),
        ({"options": {"hidden_up": 20}}, "multiple of the head size"),
        ({"options": {"lora_rank": "big"}}, "lora_rank"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, overrides, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        pipeline.run_bio(micro(**overrides), out)
    assert not out.exists()


def test_output_folder_of_another_config_is_refused_and_left_intact(finished):
    out, _ = finished
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"another configuration \(differs in: task1.max_steps\)"):
        pipeline.run_bio(micro(task1={"max_steps": 3}), out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_cli_help_documents_every_setting(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bio", "--help"])
    text = capsys.readouterr().out
    for option in ("--preset", "--methods", "--seed", "--out", "--config", "--task1.scale_route_lr", "--data.people"):
        assert option in text
    assert "peak learning rate" in text


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


def test_attribute_subset_is_trained_and_reported(tmp_path):
    results = pipeline.run_bio(micro(methods=["fft"], data={"attributes": ["major", "birth_city"]}), tmp_path / "r")
    record = results["methods"]["fft"]["runs"][0]["curve"][-1]
    assert set(record["task0"]) == {"overall", "major", "birth_city"}
    assert "| fft | " in (tmp_path / "r" / "results.md").read_text().split("per attribute")[1]
