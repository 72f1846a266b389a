"""An upscaled model under FSDP2 (``fully_shard``), 2 CPU processes on gloo: sharded like any model, trained as one.

What accelerate's FSDP2 plugin does to a model (``fully_shard`` on each decoder layer, then on the root), done by
hand: accelerate turns FSDP on for accelerator devices only (its ``AcceleratorState`` leaves a CPU run DDP), so a
CPU test cannot go through ``accelerate launch``. Every parameter, frozen originals included, becomes a DTensor
sharded across both processes; only SCALE's new blocks train; the weights after training equal one process
accumulating the same two micro-batches, as close to the same training in float64 as that one process is (measured
bitwise equal to it on CPU: each reduction adds two terms); a sharded checkpoint (``torch.distributed.checkpoint``:
model and optimizer) taken mid-run resumes, in new processes, to the same weights, bitwise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.exactness,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is missing"
    ),
]
pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")

from scale_cl.tuner.layers import is_new_parameter  # noqa: E402
from tests.conftest import run_launch  # noqa: E402
from tests.e2e import fsdp_worker as worker  # noqa: E402
from tests.exactness import assert_exact_to_rounding  # noqa: E402

WORKER = Path(__file__).parent / "fsdp_worker.py"
# Route: the harder case (its stacked paths and its routed head under sharding). SCALE-Preserve under FSDP2 is
# trained end to end by `scale-cl cpt` in test_sharded_commands.py (each launch here costs ~12 s of the suite).
METHODS = ["scale_route"]


def _launch(method: str, out: Path, save: int, resume: Path | None = None) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(WORKER), method.removeprefix("scale_"), str(out), str(save), *([str(resume)] if resume else [])]
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    done = run_launch(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command[-4:]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-5000:]}"


def _one_process(method: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The reference: one process, each batch as the same two micro-batches, accumulated (in ``dtype``: float64, the
    exact training every fp32 run rounds away from)."""
    model = worker.build(method.removeprefix("scale_")).to(dtype)
    optimizer = worker.optimizer_for(model)
    for ids in worker.batches():
        worker.step(model, optimizer, ids, [0, 1], 2)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=METHODS)
def runs(request, tmp_path_factory):
    """(method, uninterrupted 2-process output, output of 2 new processes resumed from its checkpoint after step 2
    of 4). The uninterrupted run writes that checkpoint and trains on: a run killed after it would have left the
    same files, and each launch costs ~10 s of imports."""
    method = request.param
    whole, resumed = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("resumed")
    _launch(method, whole, save=2)
    assert (whole / "checkpoint").is_dir(), "a checkpoint mid-run"
    _launch(method, resumed, save=2, resume=whole)
    return method, whole, resumed


def test_every_parameter_is_sharded_and_only_the_new_blocks_train(runs):
    _, whole, _ = runs
    sharding = json.loads((whole / "sharding.json").read_text())
    assert sharding and all(p["dtensor"] for p in sharding.values()), "fully_shard made every parameter a DTensor"
    frozen = {n: p for n, p in sharding.items() if not is_new_parameter(n)}
    assert frozen and all(not p["trains"] for p in frozen.values())
    assert all(p["trains"] for n, p in sharding.items() if n.endswith((".w21", ".w22", ".weight_up")))
    big = [p for p in frozen.values() if p["rows"] >= 2]
    assert big and all(p["local_rows"] == (p["rows"] + 1) // 2 for p in big), "dim-0 shards across 2 processes"


@pytest.fixture(scope="module")
def trained(runs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the sharded run's weights, one process's in fp32, one process's in float64) after the same steps."""
    method, whole, _ = runs
    return load_file(whole / "final.safetensors"), _one_process(method), _one_process(method, torch.float64)


def _assert_trains_as_one_process(sharded, stock, exact) -> None:
    """Every weight as close to the float64 training as one fp32 process's (after 4 AdamW steps: 1e-8 to 6e-5)."""
    assert sharded.keys() == stock.keys() == exact.keys()
    for name, tensor in exact.items():
        assert_exact_to_rounding(sharded[name], tensor, stock=stock[name], what=name)


def test_two_sharded_processes_train_what_one_process_trains(runs, trained):
    method, _, _ = runs
    sharded, stock, exact = trained
    _assert_trains_as_one_process(sharded, stock, exact)
    base = worker.build(method.removeprefix("scale_")).state_dict()
    originals = [n for n in base if not is_new_parameter(n)]
    assert originals and all(torch.equal(sharded[n], base[n]) for n in originals), "frozen weights bitwise"
    assert any(not torch.equal(sharded[n], base[n]) for n in base if n.endswith(".w21")), "the new blocks trained"


def test_a_weight_one_step_off_is_outside_the_bound(trained):
    """The mutation: the sharded run's weights with one element of one trained block moved by one AdamW step (the
    learning rate: an update applied twice, or a micro-batch's gradient lost from its step). The bound that holds
    the run must refuse it, in whichever trained tensor it lands."""
    sharded, stock, exact = trained
    for name in ("model.layers.0.mlp.up_proj.w21", "model.layers.2.self_attn.q_proj.w12", "lm_head.weight_up"):
        off = dict(sharded)
        off[name] = sharded[name].clone()
        off[name].view(-1)[7] += worker.LR
        with pytest.raises(AssertionError, match=name):
            _assert_trains_as_one_process(off, stock, exact)


def test_a_sharded_checkpoint_resumes_to_the_same_weights(runs):
    _, whole, killed = runs
    resumed, uninterrupted = load_file(killed / "final.safetensors"), load_file(whole / "final.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
