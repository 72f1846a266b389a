"""Interruptions end cleanly: Ctrl-C exits 130 and SIGTERM 143, each with one line saying what is kept
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


def test_a_cache_folder_save_stopped_part_way_leaves_nothing_half_written(tmp_path):
    """bio caches its tokenizer and stage models through ``_save_folder``: Ctrl-C inside the save leaves neither its
    temporary folder nor a damaged cache, and a folder saved before stays as it was."""
    cached = tmp_path / "stage1-abc"

    def written(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_text("complete")

    bio_pipeline._save_folder(cached, written)

    def stopped(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_text("cut")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bio_pipeline._save_folder(cached, stopped)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage1-abc"]
    assert (cached / "model.safetensors").read_text() == "complete"


@pytest.mark.slow
@pytest.mark.parametrize("at_step", [2, 3, 5])
def test_a_run_stopped_by_ctrl_c_resumes_without_duplicate_records(at_step, workspace, tmp_path, monkeypatch):
    """Ctrl-C after an evaluation, a checkpoint or neither: the rerun resumes, and metrics.jsonl holds each
    evaluated step once, as an uninterrupted run's does. The figures are not drawn (matplotlib: about a third of a
    tiny run's time; test_cpt checks them)."""
    import json

    import scale_cl.experiments.cpt.report as report
    from scale_cl.experiments.cpt.pipeline import run_cpt
    from scale_cl.train.callbacks import PeriodicEval
    from tests.conftest import tiny_config

    monkeypatch.setattr(report, "plot", lambda results, out: [])

    cfg = tiny_config(workspace, ["fft"], steps=6, save_every=2)
    real, raised = PeriodicEval.on_step_end, []

    def interrupted(self, args, state, control, **kwargs):
        real(self, args, state, control, **kwargs)
        if state.global_step == at_step and not raised:
            raised.append(at_step)
            raise KeyboardInterrupt

    monkeypatch.setattr(PeriodicEval, "on_step_end", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_cpt(cfg, tmp_path / "run")
    run_cpt(cfg, tmp_path / "run")
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "fft" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 3, 6]


@pytest.mark.slow
@pytest.mark.parametrize(("sent", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_real_cpt_run_stopped_by_a_signal_ends_cleanly_and_resumes(sent, code, workspace, tmp_path, monkeypatch):
    """The whole command in its own process, stopped by Ctrl-C (SIGINT) or SIGTERM right after its first checkpoint:
    one line, no traceback, the exit status, no staging folder left; run again (the same command, in this process:
    a second process would only add its imports), it resumes and finishes with each evaluated step recorded once."""
    import json
    import subprocess
    import time

    import scale_cl.experiments.cpt.report as report
    from tests.conftest import cpt_argv, tiny_config

    monkeypatch.setattr(report, "plot", lambda results, out: [])  # the resume in this process: no figures checked
    out = tmp_path / "run"
    argv = cpt_argv(tiny_config(workspace, ["fft"], steps=18, save_every=2), out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # started as from a terminal: a suite run in the background (``pytest &`` in a script) ignores SIGINT, and a
    # child inherits that, so Ctrl-C's default is restored in the child before it starts
    process = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while not list(out.glob("fft/run/checkpoint-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"the run ended before its first checkpoint: {process.communicate()[1][-2000:]}"
    process.send_signal(sent)
    _, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == code, err[-2000:]
    assert "Traceback" not in err
    assert lines[-1].startswith("scale-cl cpt: interrupted; ") and "run the same command again" in lines[-1], lines
    assert not list(out.rglob(".staging")), "a half-written checkpoint was left behind"

    assert main(argv[3:]) == 0  # argv[3:]: the command after ``python -m scale_cl.cli``
    steps = [json.loads(line)["step"] for line in (out / "fft" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, 19, 3)), steps
