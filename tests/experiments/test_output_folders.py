"""Unusable output folders are refused before any data or model is loaded: an existing file, a folder
that cannot be written, a folder of another kind of run; exit 2 and one line, nothing written."""

from __future__ import annotations

import json

import pytest

import scale_cl.experiments.base.build as base_build
import scale_cl.experiments.bio.pipeline as bio_pipeline
import scale_cl.experiments.cpt.pipeline as cpt_pipeline
import scale_cl.experiments.run_folder as run_folder
import scale_cl.experiments.train.pipeline as train_pipeline
import scale_cl.experiments.train.prepare as train_prepare
from scale_cl.cli import main

# each command and what it would load first: reaching it means the folder was not checked first
COMMANDS = {
    "bio": (["bio", "--preset", "micro"], bio_pipeline, "build_data"),
    "cpt": (["cpt", "--preset", "clean-en"], cpt_pipeline, "base_model_config"),
    "base": (["base", "--preset", "clean-en"], base_build, "read_english"),
    "sweep bio": (["sweep", "bio", "--preset", "micro"], bio_pipeline, "build_data"),
    "sweep cpt": (["sweep", "cpt", "--preset", "clean-en"], train_prepare, "base_model_config"),
    "train": (["train", "--preset", "clean-en"], train_pipeline, "base_model_config"),
}


@pytest.fixture(params=sorted(COMMANDS))
def command(request, monkeypatch):
    argv, module, first_load = COMMANDS[request.param]

    def loaded(*args, **kwargs):
        raise AssertionError(f"{request.param} loaded data or a model before checking --out")

    monkeypatch.setattr(module, first_load, loaded)
    return request.param, argv


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_an_existing_file_is_refused(command, tmp_path, capsys):
    _, argv = command
    target = tmp_path / "results"
    target.write_text("mine\n")
    err = _refused([*argv, "--out", str(target)], capsys)
    assert f"--out {target} is a file" in err
    assert target.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_folder_that_cannot_be_written_is_refused(command, tmp_path, capsys, monkeypatch):
    _, argv = command
    target = tmp_path / "locked" / "run"
    (tmp_path / "locked").mkdir()
    real = run_folder.os.access
    monkeypatch.setattr(
        run_folder.os, "access", lambda path, mode: str(path) != str(tmp_path / "locked") and real(path, mode)
    )
    err = _refused([*argv, "--out", str(target)], capsys)
    assert f"cannot write into {tmp_path / 'locked'} (permission denied)" in err
    assert not target.exists()


def test_a_folder_of_another_kind_of_run_is_refused(command, tmp_path, capsys):
    name, argv = command
    other, kind = ("cpt_config.json", "cpt") if name.startswith("sweep") else ("sweep_config.json", "sweep")
    (tmp_path / other).write_text(json.dumps({"preset": "micro"}))
    err = _refused([*argv, "--out", str(tmp_path)], capsys)
    assert f"holds {other} (a scale-cl {kind} run, or a model)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [other]
