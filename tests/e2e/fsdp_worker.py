"""One process of `test_fsdp.py`: an upscaled tiny Llama trained under FSDP2 (``fully_shard``) on CPU/gloo.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/e2e/fsdp_worker.py METHOD OUT SAVE [FROM]

Trains `STEPS` optimizer steps on `batches()` (each rank its share of every batch); after step SAVE it writes a
sharded checkpoint (model and optimizer, `torch.distributed.checkpoint`) to OUT/checkpoint and trains on. With FROM
(another run's OUT) it starts in new processes from FROM/checkpoint, as a run killed after that checkpoint resumes,
and trains the remaining steps. Rank 0 writes the full state dict (OUT/final.safetensors) and what sharding did
(OUT/sharding.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository, for its `tests` package when run as a script
from scale_cl import ScaleConfig, upscale
from tests.conftest import tiny_llama_config

STEPS, ROWS, LENGTH, LR = 4, 4, 16, 1e-3


def build(method: str) -> torch.nn.Module:
    """The same upscaled model in every process (and in the test's single-process reference)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    cfg = ScaleConfig(hidden_up=32, ffn_up=32, method=method, preserve_layers=1, w21_init="random")
    return upscale(base, cfg)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 90, (ROWS, LENGTH), generator=generator) for _ in range(STEPS)]


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, parts: list[int], of: int):
    """One optimizer step on ``ids``' parts ``parts`` of ``of`` (gradient accumulation when several)."""
    for part in parts:
        rows = ids.chunk(of)[part]
        (model(input_ids=rows, labels=rows).loss / len(parts)).backward()
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    method, out, save = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    resume = Path(sys.argv[4]) / "checkpoint" if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(method)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = optimizer_for(model)
    first = 0
    if resume is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(resume))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = int(state["step"])
    for index, ids in enumerate(batches()[first:], start=first + 1):
        step(model, optimizer, ids, [rank], world)
        if index == save and resume is None:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "step": torch.tensor(index)}
            dcp.save(state, checkpoint_id=str(out / "checkpoint"))
    full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[0]
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, out / "final.safetensors")
        sharding = {
            name: {
                "dtensor": isinstance(param, DTensor),
                "local_rows": param.to_local().shape[0] if isinstance(param, DTensor) else None,
                "rows": param.shape[0],
                "trains": param.requires_grad,
            }
            for name, param in model.named_parameters()
        }
        (out / "sharding.json").write_text(json.dumps(sharding))
    _finish()


def _finish() -> None:
    """Wait for every process before tearing gloo down: a process that leaves while another still works aborts
    ("terminate called without an active exception", seen once in 12 runs)."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
