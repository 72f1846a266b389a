"""Interruptions end cleanly (issue 41): Ctrl-C exits 130 and SIGTERM 143, each with one line saying what is kept
and the command that resumes; no traceback."""

from __future__ import annotations

import os
import signal

import pytest

import scale_cl.experiments.bio.pipeline as bio_pipeline
from scale_cl.cli import main


@pytest.mark.parametrize(("how", "code"), [("ctrl-c", 130), ("sigterm", 143)])
def test_an_interrupted_run_exits_with_one_line_and_the_command_that_resumes(how, code, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (the main) thread before kill() returns
        raise KeyboardInterrupt

    monkeypatch.setattr(bio_pipeline, "run_bio", interrupted)  # the command imports it when it runs
    handler = signal.getsignal(signal.SIGTERM)
    argv = ["bio", "--preset", "micro", "--out", str(tmp_path / "run")]
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0]
    assert lines[0].startswith("scale-cl bio: interrupted; what finished (and the last checkpoint) is kept in ")
    assert lines[0].endswith(
        f"run the same command again to resume: scale-cl bio --preset micro --out {tmp_path / 'run'}"
    )
    assert signal.getsignal(signal.SIGTERM) is handler  # main() gives the previous handler back


def test_a_damaged_cached_stage_model_is_named_with_what_to_delete(tmp_path):
    """A cached stage whose weights were cut short (a killed copy, a full disk) is refused naming the file and the
    folder to delete, not with safetensors' traceback."""
    import torch
    from safetensors.torch import save_file

    stage = tmp_path / "stage2-abc"
    stage.mkdir()
    save_file({"w": torch.ones(64, 64)}, stage / "model.safetensors")
    assert bio_pipeline._readable_stage(stage) == stage
    data = (stage / "model.safetensors").read_bytes()
    (stage / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"cached stage model {stage / 'model.safetensors'} is damaged") as info:
        bio_pipeline._readable_stage(stage)
    assert f"delete {stage} and run again" in str(info.value)
