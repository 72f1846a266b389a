"""``scale-cl cpt`` with sharded weights, launched with the repository's accelerate configs (configs/accelerate/).

On CPU (always): ``accelerate launch --config_file configs/accelerate/fsdp2.yaml``, 2 processes on gloo (no GPU
visible), through `fsdp_cpu_launch.py`, which lets accelerate turn FSDP on for CPU processes (it refuses to by
itself; the launcher's doc says why and what it changes). Everything else is accelerate's and the Trainer's FSDP2
code: the upscaled model wrapped per decoder layer, sharded checkpoints, resuming, the state dict gathered at the
end. SCALE-Preserve and SCALE-Route train the same weights as one process accumulating the same micro-batches,
evaluate alike along the way, write their files once, checkpoint each process's shards, and a killed run resumes.

On GPUs (when there are any): the same configs unpatched, FSDP2 and (with DeepSpeed installed) ZeRO-3. Not run on
this project's machines (no GPU); DeepSpeed has no CPU build here, so ZeRO-3 runs nowhere else.

"The same weights" (and evaluations) are measured against the one-process run's own rounding: the command trains in
fp32 or bf16 only (no float64 run to measure from), so the bound is how far the one-process run moves when the same
global batch is summed in another valid order, one micro-batch of 4 instead of 2 x 2 accumulated, in the same
precision (`exactness.assert_within_noise`).

Each command started costs seconds of imports, so the module starts few: the one-process references run in this
process (on the CPU, as the sharded runs), and the sharded run of both methods is the killed-and-resumed one (killed
in SCALE-Route, its first method; SCALE-Preserve then runs uninterrupted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from scale_cl.cli import main
from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.train.trainer import CHECKPOINT_META
from tests.conftest import cpt_argv, kill_when, run_launch, tiny_config
from tests.exactness import assert_within_noise, max_error

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "configs" / "accelerate"
LAUNCH_ON_CPU = Path(__file__).parent / "fsdp_cpu_launch.py"
METHODS = ["scale_route", "scale_preserve"]  # the sharded run is killed in its first
# As tests/e2e/test_distributed.py: two ranks add the same two micro-batch gradients accumulation adds; the bound admits
# the rounding of another reduction order, while a different data order moves weights by ~1e-3.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is missing"
)


def _env(cpu: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("ACCELERATE_")}
    # the tests' helpers and the checkout's package, whether or not it is pip-installed
    paths = [str(ROOT / "tests"), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(paths))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _launch(config: str, argv: list[str], processes: int = 2, cpu: bool = True) -> list[str]:
    """``accelerate launch --config_file configs/accelerate/CONFIG`` of the cli command ``argv`` (from cpt_argv)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
    command += ["--num_processes", str(processes), "--main_process_port", "0"]
    if cpu:  # no GPU visible (_env); accelerate's --cpu would start one process and drop the FSDP settings
        command += [str(LAUNCH_ON_CPU)]
    else:
        command += ["-m", "scale_cl.cli"]
    return [*command, *argv[argv.index("scale_cl.cli") + 1 :]]


def _run(command: list[str], cpu: bool = True) -> str:
    done = run_launch(command, env=_env(cpu), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{command[:8]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def _weights(out: Path, method: str) -> dict[str, torch.Tensor]:
    return load_file(out / method / "model" / "model.safetensors")


def _metrics(out: Path, method: str) -> list[dict]:
    return [json.loads(line) for line in (out / method / "metrics.jsonl").read_text().splitlines()]


def _perplexities(out: Path, method: str) -> dict[str, torch.Tensor]:
    """Each evaluated perplexity of the run along its steps (fp32 computations, as fp32)."""
    records = _metrics(out, method)
    return {
        "learning_ppl": torch.tensor([r["learning_ppl"] for r in records]),
        "forgetting_ppl": torch.tensor([r["forgetting_ppl"]["toy"] for r in records]),
    }


def _assert_same_weights(actual: Path, expected: Path, one_process: tuple[Path, Path], methods: list[str]) -> None:
    """``actual``'s weights no farther from ``expected``'s than the one-process fp32 run moves with the same batches
    summed in another order (``one_process``: that run, and the same with one micro-batch of 4)."""
    for method in methods:
        got, want = _weights(actual, method), _weights(expected, method)
        one, other = (_weights(out, method) for out in one_process)
        assert got.keys() == want.keys() == one.keys() == other.keys()
        for name in want:
            noise = max_error(other[name], one[name])  # the fp32 one-process run's own rounding noise
            assert_within_noise(got[name], want[name], noise=noise, what=f"{method} {name}")


def _assert_same_evaluations(actual: Path, expected: Path, stock: Path, methods: list[str]) -> None:
    """``actual``'s evaluations along the run as close to ``expected``'s as ``stock``'s are."""
    for method in methods:
        assert [r["step"] for r in _metrics(actual, method)] == [r["step"] for r in _metrics(expected, method)]
        got, want, noise = (_perplexities(out, method) for out in (actual, expected, stock))
        for name in want:
            assert_within_noise(
                got[name], want[name], noise=max_error(noise[name], want[name]), what=f"{method} {name}"
            )


def _assert_same_training(actual: Path, one_process: tuple[Path, Path], methods: list[str]) -> None:
    """``actual`` trains and evaluates as the one-process fp32 run, to that run's own rounding (its distance from
    the same run with one micro-batch of 4)."""
    _assert_same_weights(actual, one_process[0], one_process, methods)
    _assert_same_evaluations(actual, *one_process, methods)


def _one_micro_batch(argv: list[str]) -> list[str]:
    """The command line ``argv`` with each batch as one micro-batch (the other order of the same sums)."""
    at = argv.index("--train.micro_batch_size")
    return [*argv[: at + 1], argv[argv.index("--train.batch_size") + 1], *argv[at + 2 :]]


def _in_process(cfg: CptConfig, out: Path, **train) -> None:
    """``cfg``'s run as one process, in this one (``train``: settings changed): the command's own pipeline, on the
    CPU (as the sharded runs, whatever GPU there is), without the seconds of imports a command started costs."""
    run_cpt(replace(cfg, train=replace(cfg.train, device="cpu", **train)), out)


@pytest.fixture(scope="module")
def one_process(workspace, tmp_path_factory) -> tuple[Path, Path]:
    """(the single-process run, the same with each batch as one micro-batch)."""
    one, other = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("other_order")
    cfg = tiny_config(workspace, METHODS, steps=6, save_every=3)
    _in_process(cfg, one)
    _in_process(cfg, other, micro_batch_size=cfg.train.batch_size)
    return one, other


@dataclass
class Sharded:
    out: Path  # the sharded run of METHODS, killed after SCALE-Route's first checkpoint and resumed
    stdout: str  # the resumed run's
    checkpoint: Path  # the checkpoint it was killed after (its meta file)
    meta: dict | None  # that meta file when it was killed (None: there was none)
    shards: list[str]  # that checkpoint's *.distcp files then
    finished: bool  # SCALE-Route had finished when it was killed


@pytest.fixture(scope="module")
def fsdp_on_cpu(workspace, tmp_path_factory) -> Sharded:
    out = tmp_path_factory.mktemp("fsdp")
    command = _launch("fsdp2.yaml", cpt_argv(tiny_config(workspace, METHODS, steps=6, save_every=3), out))
    target = out / "scale_route" / "run" / "checkpoint-3" / CHECKPOINT_META
    kill_when(command, _env(), target)  # the launcher and both workers
    meta = json.loads(target.read_text()) if target.is_file() else None
    shards = sorted(p.name for p in target.parent.rglob("*.distcp"))
    finished = (out / "scale_route" / "result.json").exists()
    return Sharded(out, _run(command), target, meta, shards, finished)


@pytest.mark.slow
@pytest.mark.exactness
@needs_gloo
def test_fsdp2_trains_the_same_weights_as_one_process(one_process, fsdp_on_cpu):
    out, stdout = fsdp_on_cpu.out, fsdp_on_cpu.stdout
    assert stdout.count("sharded (fsdp) across 2 processes") == len(METHODS), "the run was sharded, said once"
    _assert_same_training(out, one_process, METHODS)
    # SCALE-Preserve never uses W12: under sharding too it holds and saves none.
    assert not [n for n in _weights(out, "scale_preserve") if n.endswith(".w12")]
    assert [n for n in _weights(out, "scale_route") if n.endswith(".w12")]


@pytest.mark.slow
@pytest.mark.exactness
@needs_gloo
def test_fsdp2_in_bf16_trains_as_one_process_in_bf16(one_process, workspace, tmp_path):
    """Mixed precision under FSDP2 is the one-process run's (`scale_cl.train.sharding.autocast_as_one_process`):
    fp32 weights and gradients, bf16 products under autocast. accelerate's own FSDP2 policy (bf16 parameters, bf16
    gradient reduction, no autocast; the launcher applies it as accelerate does on GPUs) moved 1-2% of these
    weights by up to 3e-3 after 6 steps (a failure once seen on one GPU, reproduced here); now they agree to float32
    rounding, as in fp32.

    The weights: both runs compute the same bf16 products of the same micro-batches and differ in the order the fp32
    gradients are reduced alone, so the bound is the fp32 runs' (one process, and one micro-batch of 4), measured
    6e-8 here. Not the bf16 one-process run's own other-order distance: moving bf16 roundings, that grows to 2e-3 in
    6 AdamW steps and would admit that 3e-3. The evaluations agree to bf16 rounding: one process evaluates
    SCALE-Route in the merged inference form, a sharded run in the split form (`set_merged_inference`), equal to
    rounding (5e-5 of a perplexity here in bf16; 1e-7 in fp32); the bound is the bf16 evaluations' own distance from
    the fp32 evaluation of the same weights."""
    cfg = tiny_config(workspace, METHODS, steps=6, save_every=3)
    argv = [*cpt_argv(cfg, tmp_path), "--train.precision", "bf16"]
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    _in_process(cfg, one, precision="bf16")
    stdout = _run(_launch("fsdp2.yaml", [*argv, "--out", str(sharded)]))
    assert stdout.count("sharded (fsdp) across 2 processes") == len(METHODS)
    _assert_same_weights(sharded, one, one_process, METHODS)
    # The bf16 rounding of an evaluation: the one-process run's last evaluations' largest distance from the fp32
    # evaluation of the same weights (of both methods and both sets: one reading alone ranged 0.002-0.04 here, the
    # two forms differed by 0.004-0.016).
    want = {method: _perplexities(one, method) for method in METHODS}
    fp32 = {method: _fp32_readings(cfg, one / method) for method in METHODS}
    rounding = max((want[m][name][-1].double() - fp32[m][name]).abs().item() for m in METHODS for name in fp32[m])
    for method in METHODS:  # each step's evaluation no farther from the one-process run's than margin x that rounding
        assert [r["step"] for r in _metrics(sharded, method)] == [r["step"] for r in _metrics(one, method)]
        got = _perplexities(sharded, method)
        for name, reference in want[method].items():
            assert_within_noise(got[name], reference, noise=rounding, what=f"{method} bf16 {name}")


def _fp32_readings(cfg, folder: Path) -> dict[str, torch.Tensor]:
    """The last evaluation of the trained model in ``folder`` (learning, forgetting) in fp32 instead of bf16, on the
    run's evaluation data."""
    from scale_cl.eval.perplexity import perplexity
    from scale_cl.experiments.train.corpus import load_run_corpus
    from scale_cl.models import load_trained

    model, tokenizer, _ = load_trained(folder / "model")
    corpus = load_run_corpus(cfg, tokenizer)
    sets = {"learning_ppl": corpus.heldout, "forgetting_ppl": corpus.old_eval["toy"]}
    readings = {name: perplexity(model, data.blocks, cfg.eval.batch_size).perplexity for name, data in sets.items()}
    return {name: torch.tensor(value, dtype=torch.float64) for name, value in readings.items()}


@pytest.mark.slow
@needs_gloo
def test_fsdp2_writes_once(fsdp_on_cpu):
    out, stdout = fsdp_on_cpu.out, fsdp_on_cpu.stdout
    for method in METHODS:
        assert [r["step"] for r in _metrics(out, method)] == [0, 3, 6], "one record per evaluation"
        assert not (out / method / "run").exists()
    assert stdout.count("[cpt] data train:") == 1
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow
@pytest.mark.exactness
@needs_gloo
def test_a_killed_fsdp2_run_resumes_from_its_sharded_checkpoint(one_process, fsdp_on_cpu):
    run = fsdp_on_cpu
    assert run.meta is not None and not run.finished, "killed mid-run"
    assert run.meta["format"] == "accelerate" and run.meta["global_step"] == 3
    shards = run.shards
    assert len(shards) >= 2 and {s.split("_")[2] for s in shards} >= {"0", "1"}, f"each process's shards: {shards}"
    assert f"[train] resuming from {run.checkpoint.parent}" in run.stdout
    _assert_same_training(run.out, one_process, ["scale_route"])


def test_commands_that_do_not_shard_refuse_before_writing(workspace, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "bio"
    assert main(["bio", "--preset", "micro", "--out", str(out)]) == 2
    assert "scale-cl bio does not run with sharded weights (fsdp" in capsys.readouterr().err
    assert not out.exists()
    argv = cpt_argv(tiny_config(workspace, ["scale_route"]), tmp_path / "quant")
    assert main([*argv[argv.index("cpt") :], "--options.base_quant", "nf4"]) == 2
    assert "options.base_quant: not supported with sharded weights (fsdp" in capsys.readouterr().err
    assert not (tmp_path / "quant").exists()
    argv = cpt_argv(tiny_config(workspace, ["fft"]), tmp_path / "control")
    assert main([*argv[argv.index("cpt") :], "--eval.likelihood_control"]) == 2
    assert "eval.likelihood_control: not supported with sharded weights (fsdp" in capsys.readouterr().err
    assert not (tmp_path / "control").exists()


def test_zero3_is_sharding_and_zero2_is_not(monkeypatch):
    from scale_cl.train.sharding import requested_sharding

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert requested_sharding() is None
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert requested_sharding() == "deepspeed-zero3"


GPUS = torch.cuda.device_count()


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.skipif(GPUS == 0, reason="no GPU: accelerate enables FSDP and DeepSpeed on accelerator devices only")
@pytest.mark.parametrize(
    "config",
    [
        "fsdp2.yaml",
        pytest.param(
            "deepspeed_zero3.yaml",
            marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed"),
        ),
    ],
)
def test_sharded_on_gpus_trains_as_one_gpu(config, workspace, tmp_path):
    """Unpatched accelerate on the GPUs there are (up to 2); against one process on one GPU, to the rounding of that
    GPU's kernels (not bitwise reproducible across batch splits): as far as the one-GPU run moves with each batch as
    one micro-batch."""
    cfg = tiny_config(workspace, METHODS, steps=6, save_every=3)
    one, sharded, other = tmp_path / "one", tmp_path / "sharded", tmp_path / "other_order"
    _run(cpt_argv(cfg, one), cpu=False)
    _run(_one_micro_batch(cpt_argv(cfg, other)), cpu=False)
    _run(_launch(config, cpt_argv(cfg, sharded), processes=min(GPUS, 2), cpu=False), cpu=False)
    _assert_same_training(sharded, (one, other), METHODS)


@pytest.mark.slow
@pytest.mark.exactness
@needs_gloo
def test_an_fsdp2_sweep_matches_the_single_process_run(one_process, workspace, tmp_path):
    """`scale-cl sweep cpt` launched with fsdp2.yaml: the x1 point is the plain run of the same settings."""
    out = tmp_path / "sweep"
    argv = cpt_argv(tiny_config(workspace, ["scale_route"], steps=6, save_every=3), out)
    at = argv.index("cpt")
    sweep = [*argv[:at], "sweep", "cpt", "--lr-scales", "1", "--reference", "scale_route", *argv[at + 1 :]]
    stdout = _run(_launch("fsdp2.yaml", sweep))
    assert "weights sharded (fsdp) across 2 processes" in stdout and stdout.count("[sweep] run 1/1") == 1
    point = json.loads(next((out / "points").glob("*/point.json")).read_text())
    one, other = one_process
    want = torch.tensor(_metrics(one, "scale_route")[-1]["learning_ppl"])
    noise = max_error(torch.tensor(_metrics(other, "scale_route")[-1]["learning_ppl"]), want)
    got = torch.tensor(point["metrics"]["learning"])
    assert_within_noise(got, want, noise=noise, what="the x1 point's learning perplexity")
