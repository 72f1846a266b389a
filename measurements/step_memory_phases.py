"""Where a training step's peak memory falls: forward, backward, optimizer step (each phase's high-water mark).

    python measurements/step_memory_phases.py fft scale_preserve                               # glibc's defaults
    MALLOC_MMAP_THRESHOLD_=65536 python measurements/step_memory_phases.py fft scale_preserve  # freed blocks returned

The bench's SmolLM2 shape and batch (4 x 256, fp32, AdamW, sliced loss; `scale_cl.bench.child.train_memory`), three
steps per method, each method in a fresh process, MiB of resident memory above the imports. With glibc's defaults a
freed block may stay resident (RSS counts the allocator's retained heap); with a fixed 64 KiB mmap threshold every
large tensor goes back to the system when freed, so the peak is that of the live tensors, as CUDA's
``max_memory_allocated`` counts it.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from scale_cl.bench.config import BenchConfig
from scale_cl.bench.measure import make_optimizer
from scale_cl.bench.memory import MIB, PeakMemory
from scale_cl.bench.setup import build_method, method_options
from scale_cl.bench.shapes import build_base
from scale_cl.train.chunked_loss import LossTargets, sliced_head


def phases(method: str, steps: int = 3) -> None:
    torch.set_num_threads(2)
    cfg = BenchConfig(shapes=["smollm2"], methods=["fft", method])
    device, shape = cfg.torch_device, cfg.shape("smollm2")
    memory = PeakMemory(device)
    base = build_base(shape, cfg.seed)
    model = build_method(base, method, method_options(shape, cfg)[method], device, cfg.torch_dtype, copy_base=False)
    del base
    optimizer = make_optimizer(model, cfg.lr)
    ids = torch.randint(0, shape.make_config().vocab_size, (cfg.batch, cfg.seq))
    targets = LossTargets(ids, ids.shape[0] * (ids.shape[1] - 1))
    for step in range(steps):
        memory.reset()
        row = [("start", memory.above_baseline())]
        with sliced_head(model.get_output_embeddings(), targets):
            out = model(input_ids=ids).logits
            row.append(("forward peak", memory.peak()))
            memory.reset()
            row.append(("after forward", memory.above_baseline()))
            out.backward()
        del out
        row.append(("backward peak", memory.peak()))
        memory.reset()
        row.append(("after backward", memory.above_baseline()))
        optimizer.step()
        row.append(("step peak", memory.peak()))
        optimizer.zero_grad(set_to_none=True)
        print(f"{method} step {step}: " + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in row), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        phases(sys.argv[2])
    else:
        for name in sys.argv[1:] or ["fft", "scale_preserve"]:
            subprocess.run([sys.executable, __file__, "--one", name], check=True)
