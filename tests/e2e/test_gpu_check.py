"""scripts/gpu_check.sh, the one prepared GPU check: its dry run on the CPU runs every step's command at
toy sizes, so a wrong option or a broken summary is found here, before the check is taken on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _kill_tree

ROOT = Path(__file__).parents[2]


def run_check(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` that, past ``timeout``, kills the check's whole process tree: killing bash alone would leave
    a step's ``timeout`` and the training runs under it going on, beside the next tests."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_summarises(tmp_path):
    out = tmp_path / "check"
    command = [
        "bash",
        str(ROOT / "scripts" / "gpu_check.sh"),
        "--dry-run",
        "--out",
        str(out),
        "--python",
        sys.executable,
    ]
    done = run_check(command, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((out / "summary.json").read_text())
    assert found["dry_run"] and found["budget_s"] == 600
    steps = {s["step"]: s["rc"] for s in found["steps"]}
    assert steps == {"versions": 0, "tests": 0, "bio-micro": 0, "bench": 0, "train": 0, "bench-readings": 0}
    train = found["train"]  # killed after its first checkpoint, resumed, finished
    assert "killed (SIGKILL) after checkpoint-30" in (out / "train.log").read_text(), "the kill landed mid-run"
    assert train["resumed"] and train["steps"] == 90 and "checkpoint-30" in train["checkpoints"]
    assert train["stream_position"], "every checkpoint saved the stream's position"
    position = json.loads((out / "train" / "run" / "checkpoint-30" / "stream.json").read_text())
    assert position["emitted"] == 240 and position["bookmark"]["blocks"] > 0, "resumed at a bookmark past the start"
    assert train["tokens_per_s"] > 0 and train["first_loss"] > train["last_loss"]
    assert found["tests"]["collected"] > 100  # the GPU-gated tests exist and are selected
    assert found["bio_micro"] is not None
    names = {t["target"] for t in found["targets"]}
    for method in ("scale_preserve", "scale_adapt", "scale_route"):
        assert f"{method} training FLOPs counted / its floor" in names and f"{method} step time / fft (GPU)" in names
    assert "preserve-likelihood forward time / fft (1 / its speed ratio)" in names  # from bench-readings
    assert set(found["readings"]["tiny"]) == {"preserve-likelihood", "control", "preserve-nested"}
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU check (dry run") and "The issues' targets" in summary
    assert (
        "train (scale_preserve, streamed, killed after a checkpoint and resumed: yes, at the stream's saved position: "
        "yes): 90 steps" in summary
    )
    assert "Inference read with the likelihood router at tiny" in summary


def test_an_output_folder_in_use_is_refused(tmp_path):
    (tmp_path / "earlier.txt").write_text("a check's results")
    command = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is not empty" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.txt"]


def test_the_summary_reads_a_gpu_run(tmp_path):
    """What a real run leaves (JUnit file, three bench runs) summarised: failures named, targets, MFU, compile ratio,
    peak memory."""
    from scale_cl.bench.gpu_check import main

    (tmp_path / "steps.tsv").write_text("step\trc\tseconds\tlimit\nversions\t0\t3\t60\ntests\t1\t150\t180\n")
    (tmp_path / "tests.log").write_text("1 failed, 1 passed")
    (tmp_path / "versions.json").write_text(json.dumps({"gpus": [{"name": "NVIDIA H100", "memory_gib": 79.6}]}))
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a[cuda]"/>'
        '<testcase classname="tests.test_gpu" name="test_b[cuda]"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c[cuda]"><skipped message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    target = {"issue": 38, "target": "scale_preserve step time / fft (GPU)", "value": 0.5, "limit": 0.6}
    methods = {"fft": {"step_s": 2.0, "mfu": 0.4}, "scale_preserve": {"step_s": 1.0, "mfu": 0.3}}
    for folder, steps in (("bench", (2.0, 1.0)), ("bench-compiled", (1.5, 0.8))):
        (tmp_path / folder).mkdir()
        run = {m: {**r, "step_s": s} for (m, r), s in zip(methods.items(), steps, strict=True)}
        shapes = {"llama-1b": {"methods": run, "targets": [{**target, "at_most": True, "met": True}]}}
        (tmp_path / folder / "results.json").write_text(json.dumps({"meta": {}, "config": {}, "shapes": shapes}))
    for folder, scale in (("bench-memory", 1.0), ("bench-memory-whole", 2.0)):
        (tmp_path / folder).mkdir()
        peaks = {"fft": {"peak_train_mib": 60000.0 * scale}, "scale_preserve": {"peak_train_mib": 31000.4 * scale}}
        memory = {"meta": {}, "config": {}, "shapes": {"llama-1b": {"methods": peaks}}}
        (tmp_path / folder / "results.json").write_text(json.dumps(memory))
    (tmp_path / "bench-readings").mkdir()
    versus = {"fwd_flops_per_token": 1.3, "forward_tokens_per_s": 0.8, "generate_tokens_per_s": 0.75}
    cost = {"issue": 40, "target": "preserve-likelihood forward time / fft (1 / its speed ratio)", "value": 1.25}
    entry = {
        "readings": {"preserve-likelihood": {"vs_fft": versus}},
        "targets": [{**cost, "limit": 1.5, "at_most": True, "met": True}, {**target, "at_most": True, "met": True}],
    }
    readings = {"meta": {}, "config": {}, "shapes": {"llama-1b": entry}}
    (tmp_path / "bench-readings" / "results.json").write_text(json.dumps(readings))
    assert main(["summary", str(tmp_path), "--budget", "480", "--seconds", "300"]) == 0
    found = json.loads((tmp_path / "summary.json").read_text())
    assert found["tests"] == {"passed": 1, "failed": ["tests.test_gpu::test_b[cuda]"], "skipped": 1}
    assert [r["compiled_s"] / r["eager_s"] for r in found["compiled"]] == [0.75, 0.8]
    summary = (tmp_path / "summary.md").read_text()
    assert "| tests | **failed** (exit 1) | 150 (180) |" in summary
    assert "| 38 | llama-1b | scale_preserve step time / fft (GPU) | 0.500 | <= 0.6 | yes |" in summary
    assert summary.count("scale_preserve step time / fft (GPU)") == 1  # read from the eager bench alone
    assert (
        "| 40 | llama-1b | preserve-likelihood forward time / fft (1 / its speed ratio) | 1.250 | <= 1.5 | yes |"
        in summary
    )
    assert "| preserve-likelihood | 1.30x | 0.80x | 0.75x |" in summary
    assert "MFU at llama-1b: fft 40.0%, scale_preserve 30.0%." in summary
    peak_line = "Peak training memory at llama-1b (a fresh process each): fft 60,000 MiB, scale_preserve 31,000 MiB."
    assert peak_line in summary
    assert "Peak training memory at llama-1b, the whole loss (a fresh process each): fft 120,000 MiB" in summary
    assert (
        "| 53 | llama-1b | scale_preserve peak training memory, sliced / whole loss | 0.500 | <= 0.6 | yes |" in summary
    )
    assert "NVIDIA H100 (79.6 GiB)" in summary and "* scale_preserve (llama-1b): 0.80x" in summary
