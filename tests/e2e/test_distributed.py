"""``scale-cl cpt`` under ``torchrun`` (DDP, 2 CPU processes on gloo) gives the single-process result.

The same command line runs once as one process (micro-batch 2 x gradient accumulation 2) and once
under ``torchrun --nproc_per_node 2`` (micro-batch 2 x 2 processes): the global batch is 4 either
way and the pipeline derives the accumulation from the world size. Both runs must see the same
samples at every optimizer step and end with the same weights; frozen weights must stay bitwise
the base model's; only the main process may write; a killed 2-process run must resume.

"The same weights" is measured against the rounding of the one-process run itself: the command trains in fp32 only
(no float64 run to measure from), so the bound is how far the one-process run moves when the same global batch is
summed in another valid order, one micro-batch of 4 instead of 2 x 2 accumulated
(`exactness.assert_within_noise`).

Each command started costs seconds of imports, so the module starts few: the one-process references run in this
process (on the CPU, as the 2-process runs), and the 2-process run of every method is the killed-and-resumed one
(killed in its first method, the others then run uninterrupted).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from scale_cl.data import tokens as tokens_module
from scale_cl.data.corpus import CorpusConfig, build_corpus
from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.train.trainer import CHECKPOINT_META
from tests.conftest import cpt_argv, kill_when, run_launch, tiny_config
from tests.exactness import assert_within_noise, max_error

pytestmark = [
    pytest.mark.slow,
    pytest.mark.exactness,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is missing",
    ),
]

# new weights only (Route: its output carries the routing share, which DDP takes apart and rebuilds) / full model
# with the embedding and layer 0 frozen
METHODS = ["scale_adapt", "scale_route", "freeze"]
WEIGHTS = {"scale_adapt": "model.safetensors", "scale_route": "model.safetensors"}
WEIGHTS["freeze"] = "model.safetensors"
# With two ranks the DDP all-reduce adds the same two micro-batch gradients that accumulation adds (two-term
# float addition is commutative, the 1/2 scalings are exact), so on CPU the weights agree bitwise (measured:
# max abs difference 0). The bound (`_assert_same_training`) admits the rounding of another reduction order, as far
# as the one-process run moves with its batch summed otherwise; a different data order or global batch moves the
# weights by ~1e-3 (about lr per Adam step; tests/e2e/test_fsdp.py refuses one such step in one weight).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("ACCELERATE_")}
    # No CUDA: both runs on the CPU, so DDP uses gloo (two processes cannot share one GPU through NCCL).
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def _torchrun(command: list[str]) -> list[str]:
    """``python -m scale_cl.cli ...`` as 2 processes on this machine (``--standalone`` picks a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *command[1:]]


def _run(command: list[str]) -> str:
    done = run_launch(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command[:6]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _weights(out: Path, method: str) -> dict[str, torch.Tensor]:
    return load_file(out / method / "model" / WEIGHTS[method])


def _metrics(out: Path, method: str) -> list[dict]:
    return [json.loads(line) for line in (out / method / "metrics.jsonl").read_text().splitlines()]


def _perplexities(out: Path, method: str) -> dict[str, torch.Tensor]:
    """Each evaluated perplexity of the run along its steps (fp32 computations, as fp32)."""
    records = _metrics(out, method)
    return {
        "learning_ppl": torch.tensor([r["learning_ppl"] for r in records]),
        "forgetting_ppl": torch.tensor([r["forgetting_ppl"]["toy"] for r in records]),
    }


def _assert_same_training(actual: Path, one: Path, other_order: Path, method: str) -> None:
    """``actual``'s weights and evaluations no farther from the one-process run's than the one-process run with the
    same batches summed in another order (``other_order``: one micro-batch of 4) lies from it."""
    got, want, noise = _weights(actual, method), _weights(one, method), _weights(other_order, method)
    assert got.keys() == want.keys() == noise.keys()
    for name in want:
        assert_within_noise(got[name], want[name], noise=max_error(noise[name], want[name]), what=f"{method} {name}")
    # same samples per step: the evaluations along the way agree too
    assert [r["step"] for r in _metrics(actual, method)] == [r["step"] for r in _metrics(one, method)]
    got, want, noise = (_perplexities(out, method) for out in (actual, one, other_order))
    for name in want:
        assert_within_noise(got[name], want[name], noise=max_error(noise[name], want[name]), what=f"{method} {name}")


# 4 steps, a checkpoint and an evaluation every 2: steps before and after the kill, >= 2 optimizer steps in all
STEPS, EVERY = 4, 2


def _config(workspace: Path, methods: list[str]) -> CptConfig:
    cfg = tiny_config(workspace, methods, steps=STEPS, save_every=EVERY)
    return replace(cfg, eval=replace(cfg.eval, every=EVERY))


def _in_process(cfg: CptConfig, out: Path) -> None:
    """``cfg``'s run as one process, in this one: the command's own pipeline, on the CPU (as the 2-process runs,
    whatever GPU there is), without the seconds of imports a command started costs."""
    run_cpt(replace(cfg, train=replace(cfg.train, device="cpu")), out)


@dataclass
class Runs:
    one: Path  # the single-process run
    two: Path  # the 2-process run, killed after its first checkpoint and resumed
    stdout: str  # the resumed 2-process run's
    other: Path  # the single-process run with each batch as one micro-batch
    checkpoint: Path  # the 2-process run's checkpoint it was killed after
    killed: set[str]  # that checkpoint's files when it was killed (none: there was no checkpoint)
    finished: bool  # its first method had finished when it was killed


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory) -> Runs:
    """The runs of the same command: one process, two processes (killed and resumed), and the one-process run with
    the same batches summed in another order."""
    cfg = _config(workspace, METHODS)
    one, two, other = (tmp_path_factory.mktemp(name) for name in ("one", "two", "other_order"))
    _in_process(cfg, one)
    _in_process(replace(cfg, train=replace(cfg.train, micro_batch_size=cfg.train.batch_size)), other)
    command = _torchrun(cpt_argv(cfg, two))
    target = two / "scale_adapt" / "run" / f"checkpoint-{EVERY}" / CHECKPOINT_META
    kill_when(command, _env(), target)  # torchrun and both workers
    killed = {p.name for p in target.parent.iterdir()} if target.is_file() else set()
    finished = (two / "scale_adapt" / "result.json").exists()
    return Runs(one, two, _run(command), other, target.parent, killed, finished)


def test_two_processes_train_the_same_weights_as_one(runs):
    for method in METHODS:
        _assert_same_training(runs.two, runs.one, runs.other, method)


def test_frozen_weights_stay_bitwise_the_base_models(runs, workspace):
    base = load_file(workspace / "base" / "model.safetensors")
    trained = _weights(runs.two, "freeze")
    frozen = [n for n in base if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    top = [n for n in base if n.startswith("model.layers.2.")]
    assert frozen and top and set(frozen + top) <= set(trained)
    assert all(torch.equal(trained[n], base[n]) for n in frozen)
    assert not all(torch.equal(trained[n], base[n]) for n in top), "the unfrozen layers trained"


def test_only_the_main_process_writes(runs):
    two, stdout = runs.two, runs.stdout
    results = json.loads((two / "results.json").read_text())
    assert list(results["methods"]) == METHODS
    for method in METHODS:
        records = _metrics(two, method)
        assert [r["step"] for r in records] == [0, EVERY, STEPS], "one evaluation record per step"
        assert records == json.loads((two / method / "result.json").read_text())["curve"]
        assert not (two / method / "run").exists()
    assert not [p for p in two.rglob("*") if p.name.endswith(".tmp")]
    # Messages of the main process only (a process that took itself for the main one would repeat them).
    assert stdout.count("[cpt] data train:") == 1
    assert all(stdout.count(f"[cpt] {method}: lr") == 1 for method in METHODS)


def test_killed_two_process_run_resumes_to_the_same_weights(runs):
    assert runs.killed and not runs.finished, "killed mid-run"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= runs.killed, "a checkpoint holds the RNG state of both processes"
    assert f"[train] resuming from {runs.checkpoint}" in runs.stdout
    _assert_same_training(runs.two, runs.one, runs.other, "scale_adapt")
    assert [r["step"] for r in _metrics(runs.two, "scale_adapt")] == [0, EVERY, STEPS]


def test_a_two_process_sweep_writes_once_and_matches_the_single_process_run(runs, workspace, tmp_path):
    """`scale-cl sweep cpt` under torchrun: every process trains, the main one alone evaluates and writes."""
    out = tmp_path / "sweep"
    cli = cpt_argv(_config(workspace, ["scale_adapt"]), out)
    at = cli.index("cpt")
    stdout = _run(
        _torchrun([*cli[:at], "sweep", "cpt", "--lr-scales", "1", "2", "--reference", "scale_adapt", *cli[at + 1 :]])
    )
    points = sorted((out / "points").glob("*/point.json"))
    assert len(points) == 2 and stdout.count("[sweep] run 1/2") == 1
    results = json.loads((out / "results.json").read_text())
    at_preset = next(p for p in results["points"] if p["scale"] == 1.0)
    # The x1 run is the plain `cpt` run of the same settings (single process): the same learning.
    want = torch.tensor(_metrics(runs.one, "scale_adapt")[-1]["learning_ppl"])
    noise = max_error(torch.tensor(_metrics(runs.other, "scale_adapt")[-1]["learning_ppl"]), want)
    got = torch.tensor(at_preset["metrics"]["learning"])
    assert_within_noise(got, want, noise=noise, what="the x1 point's learning perplexity")
    for metrics in (out / "points").glob("*/scale_adapt/metrics.jsonl"):
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, EVERY, STEPS]


SHARDED_TOKENS = """
import hashlib, json, sys
import torch
from accelerate import PartialState
from transformers import AutoTokenizer
from scale_cl.data import tokens as tokens_module
from scale_cl.data.corpus import CorpusConfig, build_corpus
from scale_cl.experiments.cpt.config import CptConfig

state = PartialState(cpu=True)
rows = []
encode = tokens_module._encode_batch
def counting(batch, *args, **kwargs):
    rows.append(len(batch["text"]))
    return encode(batch, *args, **kwargs)
tokens_module._encode_batch = counting
config = CorpusConfig(train=[sys.argv[1]], seq_len=32, heldout_fraction=0.1, cache_dir=sys.argv[2])
corpus = build_corpus(config, AutoTokenizer.from_pretrained(sys.argv[3]))
blocks = corpus.train.blocks
digest = hashlib.sha256(blocks.numpy().tobytes()).hexdigest()[:16]
result = {"rank": state.process_index, "tokenised": sum(rows), "blocks": digest}
with open(f"{sys.argv[4]}/rank-{state.process_index}.json", "w") as out:
    json.dump(result, out)
"""


def _blocks_alone(workspace: Path, cache: Path, monkeypatch) -> dict:
    """What `SHARDED_TOKENS` reports as one process, computed in this one (no command started)."""
    from transformers import AutoTokenizer

    rows = []
    encode = tokens_module._encode_batch

    def counting(batch, *args, **kwargs):
        rows.append(len(batch["text"]))
        return encode(batch, *args, **kwargs)

    monkeypatch.setattr(tokens_module, "_encode_batch", counting)
    config = CorpusConfig(train=[str(workspace / "new.jsonl")], seq_len=32, heldout_fraction=0.1, cache_dir=str(cache))
    blocks = build_corpus(config, AutoTokenizer.from_pretrained(workspace / "base")).train.blocks
    return {"rank": 0, "tokenised": sum(rows), "blocks": hashlib.sha256(blocks.numpy().tobytes()).hexdigest()[:16]}


def test_each_rank_tokenises_its_own_shard_and_every_rank_packs_the_one_process_blocks(
    workspace, tmp_path, monkeypatch
):
    """Under torchrun no rank tokenises the whole corpus: each maps its contiguous half into the cache, then every
    rank reads both halves, and the training blocks are those one process packs."""
    script = tmp_path / "tokens.py"
    script.write_text(SHARDED_TOKENS)
    # each rank writes its own file: two ranks' lines on one shared stdout can interleave mid-line (seen in CI)
    written = tmp_path / "results-two"
    written.mkdir()
    args = [str(workspace / "new.jsonl"), str(tmp_path / "cache-two"), str(workspace / "base"), str(written)]
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args])
    both = sorted((json.loads(path.read_text()) for path in written.glob("rank-*.json")), key=lambda r: r["rank"])

    alone = [_blocks_alone(workspace, tmp_path / "cache-one", monkeypatch)]
    documents = len((workspace / "new.jsonl").read_text().splitlines())
    assert [r["tokenised"] for r in alone] == [documents]
    assert [r["tokenised"] for r in both] == [documents // 2, documents - documents // 2], "each rank its own half"
    assert {r["blocks"] for r in both} == {alone[0]["blocks"]}, "every rank packs the one process's blocks"
