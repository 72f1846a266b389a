"""``report_to``: the Trainer's loss and the run's own metrics go to a logging backend (TensorBoard here), the
backend is checked before anything is written, and it is no part of any setting that identifies a run; nor is a
stage's ``device``, nor its ``precision`` at ``auto`` (runs made before these settings keep their identity).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from scale_cl.experiments.bio.config import preset as bio_preset
from scale_cl.experiments.bio.pipeline import stage_keys
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.experiments.run_folder import claim_output_folder
from scale_cl.train import reporting
from scale_cl.train.arguments import training_arguments
from scale_cl.train.callbacks import _flatten
from scale_cl.train.config import StageConfig
from tests.conftest import tiny_config

EVENTS = "events.out.tfevents.*"


def _tiny_run(workspace: Path, out: Path, report_to: list[str]) -> dict:
    cfg = tiny_config(workspace, ["scale_route"])
    return run_cpt(replace(cfg, train=replace(cfg.train, report_to=report_to)), out)


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard holds in ``folder``: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_gets_the_loss_and_the_runs_own_metrics(workspace, tmp_path):
    pytest.importorskip("tensorboard")
    results = _tiny_run(workspace, tmp_path / "run", ["tensorboard"])
    logs = tmp_path / "run" / "scale_route" / "logs"
    assert list(logs.glob(EVENTS)), "the events are in the method's logs/ folder"
    assert not list((tmp_path / "run").glob(f"scale_route/run/**/{EVENTS}"))
    scalars = _scalars(logs)
    assert set(scalars["train/loss"]) == {3, 6}  # logging_steps = eval.every = 3
    assert {"train/learning_rate", "train/grad_norm"} <= set(scalars)
    curve = results["methods"]["scale_route"]["curve"]
    assert curve == [json.loads(line) for line in (tmp_path / "run" / "scale_route" / "metrics.jsonl").open()]
    for record in curve:
        for name, value in _flatten(record).items():
            if name != "step":  # one number written twice: TensorBoard keeps it as fp32 (6e-8 of it off at most)
                assert scalars[f"eval/{name}"][record["step"]] == pytest.approx(value, rel=1e-6), name
    assert {"eval/learning_ppl", "eval/forgetting_ppl/toy", "eval/route_preserve_share/toy"} <= set(scalars)
    assert set(scalars["eval/learning_ppl"]) == {0, 3, 6}  # step 0 and the last step too
    assert (tmp_path / "run" / "cpt_config.json").is_file()
    assert "report_to" not in json.loads((tmp_path / "run" / "cpt_config.json").read_text())["train"]


def test_default_none_writes_no_events(workspace, tmp_path):
    assert StageConfig().report_to == ["none"]
    _tiny_run(workspace, tmp_path / "run", ["none"])
    assert (tmp_path / "run" / "scale_route" / "result.json").is_file()
    assert not list((tmp_path / "run").rglob(EVENTS)) and not (tmp_path / "run" / "scale_route" / "logs").exists()


def test_unknown_backend_is_refused_with_the_valid_names(workspace, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown backend 'tensorbord'; valid: .*tensorboard.*wandb"):
        StageConfig(report_to=["tensorbord"])
    for mixed in (["none", "tensorboard"], ["all", "wandb"], ["tensorboard", "tensorboard"]):
        with pytest.raises(ValueError, match="alone"):
            StageConfig(report_to=mixed)
    from scale_cl.cli import main

    out = tmp_path / "out"
    argv = ["cpt", "--model", str(workspace / "base"), "--out", str(out), "--data.train", str(workspace / "new.jsonl")]
    assert main([*argv, "--train.report_to", "tensorbord"]) == 2
    assert "unknown backend 'tensorbord'" in capsys.readouterr().err
    assert not out.exists()


def test_backend_not_installed_is_refused_before_anything_is_written(workspace, tmp_path, monkeypatch):
    monkeypatch.setattr(reporting, "backend_installed", lambda module: module != "mlflow")
    with pytest.raises(ValueError, match="'mlflow' needs a package that is not installed: pip install mlflow"):
        _tiny_run(workspace, tmp_path / "out", ["mlflow"])
    assert not (tmp_path / "out").exists()


def test_wandb_follows_its_own_settings(tmp_path, monkeypatch):
    """As with transformers: scale-cl neither forces W&B offline nor online; WANDB_MODE is the user's."""
    monkeypatch.setattr(reporting, "backend_installed", lambda module: True)
    monkeypatch.setenv("WANDB_MODE", "")  # records the environment as it was, so that it is restored afterwards
    monkeypatch.delenv("WANDB_MODE")
    args = training_arguments(StageConfig(report_to=["wandb"]), tmp_path, 0)
    assert args.report_to == ["wandb"]
    assert "WANDB_MODE" not in os.environ
    monkeypatch.setenv("WANDB_MODE", "offline")
    training_arguments(StageConfig(report_to=["wandb"]), tmp_path, 0)
    assert os.environ["WANDB_MODE"] == "offline"


def test_report_to_is_no_part_of_a_runs_identity(tmp_path):
    """Cache keys (bio's stages 1-2) and the settings a run folder is claimed with ignore where metrics are sent."""
    plain = bio_preset("micro")
    logged = replace(
        plain,
        pretrain=replace(plain.pretrain, report_to=["tensorboard"]),
        task0=replace(plain.task0, report_to=["all"]),
        task1=replace(plain.task1, report_to=["tensorboard"]),
    )
    assert stage_keys(logged, 0) == stage_keys(plain, 0)
    assert stage_keys(replace(plain, pretrain=replace(plain.pretrain, lr=1e-2)), 0)[0] != stage_keys(plain, 0)[0]
    claim_output_folder(tmp_path, "config.json", plain.to_dict())
    claim_output_folder(tmp_path, "config.json", logged.to_dict())  # the same run: accepted
    with pytest.raises(ValueError, match=r"differs in: task1\.lr"):
        claim_output_folder(tmp_path, "config.json", replace(logged, task1=replace(logged.task1, lr=1.0)).to_dict())


def test_report_to_parses_on_every_training_command():
    from scale_cl.cli import parse_settings

    assert parse_settings(["cpt", "--train.report_to", "tensorboard"]).cpt.train.report_to == ["tensorboard"]
    assert parse_settings(["cpt"]).cpt.train.report_to == ["none"]
    bio = parse_settings(["bio", "--task1.report_to", "tensorboard", "--pretrain.report-to", "all"]).bio
    assert (bio.task1.report_to, bio.pretrain.report_to, bio.task0.report_to) == (["tensorboard"], ["all"], ["none"])
    assert parse_settings(["base", "--train.report_to", "tensorboard"]).base.train.report_to == ["tensorboard"]
    assert parse_settings(["sweep", "cpt", "--train.report_to", "tensorboard"]).cpt.train.report_to == ["tensorboard"]


# Stage-1/2 cache keys of bio's presets (seeds 0 and 3), as they were before the stages had a device and a precision:
# a cache made then is still found.
STAGE_KEYS = {
    "micro": (("acf303eeb42b", "a39bd34a6961"), ("ab2a5685d84a", "97d7b3dcdab6")),
    "small": (("2e2f08a45645", "b067ca25e6c9"), ("b0a43bc90204", "1609e2233415")),
    "medium": (("c37df2ab4494", "af3d9e10eb98"), ("8a1bb7a184ea", "cf1def1c661f")),
    "paper": (("ae78e5651e84", "8767b95e5103"), ("32dd04ca40b0", "c9070427a5a5")),
}


@pytest.mark.parametrize("name", sorted(STAGE_KEYS))
def test_default_runs_keep_their_cache_keys(name):
    cfg = bio_preset(name)
    assert (stage_keys(cfg, 0), stage_keys(cfg, 3)) == STAGE_KEYS[name]


def _stages(cfg, **settings):
    return replace(cfg, **{s: replace(getattr(cfg, s), **settings) for s in ("pretrain", "task0", "task1")})


def test_device_is_no_part_of_a_runs_identity_and_precision_only_when_given(tmp_path):
    """Where a stage runs identifies nothing (as the machine does not); bf16 and fp32 are other runs than each other and
    than auto (which resolves by the machine, as before the setting existed)."""
    plain = bio_preset("micro")
    assert stage_keys(_stages(plain, device="cpu"), 0) == stage_keys(_stages(plain, device="cuda"), 0)
    assert stage_keys(_stages(plain, device="cpu"), 0) == stage_keys(plain, 0)
    keys = {stage_keys(_stages(plain, precision=p), 0) for p in ("auto", "bf16", "fp32")}
    assert len(keys) == 3 and stage_keys(plain, 0) in keys
    claim_output_folder(tmp_path, "config.json", plain.to_dict())
    claim_output_folder(tmp_path, "config.json", _stages(plain, device="cpu").to_dict())  # the same run: accepted
    with pytest.raises(ValueError, match=r"differs in: .*task1\.precision"):
        claim_output_folder(tmp_path, "config.json", _stages(plain, precision="fp32").to_dict())
    assert "device" not in json.loads((tmp_path / "config.json").read_text())["task1"]


def test_a_cpt_folder_made_before_the_device_setting_is_the_same_run(workspace, tmp_path):
    """A cpt_config.json written before these settings (``train.precision: auto``, no ``train.device``) is claimed by
    the same settings today, on any device; another precision is another run."""
    cfg = tiny_config(workspace, ["fft"])
    before = cfg.to_dict()
    del before["train"]["device"]
    assert before["train"]["precision"] == "auto"
    (tmp_path / "cpt_config.json").write_text(json.dumps(before))
    for device in ("auto", "cpu", "cuda"):
        claim_output_folder(
            tmp_path, "cpt_config.json", replace(cfg, train=replace(cfg.train, device=device)).to_dict()
        )
    with pytest.raises(ValueError, match=r"differs in: train\.precision"):
        claim_output_folder(
            tmp_path, "cpt_config.json", replace(cfg, train=replace(cfg.train, precision="bf16")).to_dict()
        )
