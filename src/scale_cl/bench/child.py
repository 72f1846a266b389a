"""The measurements that need a fresh process: peak training memory of one method, peak forward memory of a method or
a reading, and upscale's cost.

``python -m scale_cl.bench.child '<task JSON>'`` prints one line ``SCALE_BENCH_RESULT {json}``.
Tasks: ``{"task": "train_memory", "config": {...}, "shape": NAME, "method": METHOD}``, ``{"task": "forward_memory",
..., "row": METHOD or READING}`` and
``{"task": "upscale", "config": {...}, "shape": NAME}`` (``config`` is a `BenchConfig` as a dict).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from scale_cl.bench.config import BenchConfig
from scale_cl.bench.measure import make_optimizer, synchronize, train_step
from scale_cl.bench.memory import MIB, RESULT_PREFIX, PeakMemory
from scale_cl.bench.readings import READINGS, reading_model
from scale_cl.bench.setup import build_method, method_options, scale_configs
from scale_cl.bench.shapes import build_base
from scale_cl.tuner.upscale import upscale


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def train_memory(cfg: BenchConfig, shape_name: str, method: str) -> dict[str, Any]:
    """Peak memory of training ``method`` for ``warmup + 2`` steps (at least 2: AdamW's state exists from step 1)."""
    device, shape = cfg.torch_device, cfg.shape(shape_name)
    memory = PeakMemory(device)
    base = build_base(shape, cfg.seed)
    options = method_options(shape, cfg)[method]
    model = build_method(base, method, options, device, cfg.torch_dtype, copy_base=False)
    del base
    optimizer = make_optimizer(model, cfg.lr)
    ids = torch.randint(0, shape.make_config().vocab_size, (cfg.batch, cfg.seq), device=device)
    memory.reset()
    resident = memory.above_baseline()
    for _ in range(max(2, cfg.warmup + 2)):
        train_step(model, optimizer, ids, cfg.loss == "sliced")
    synchronize(device)
    return {
        "peak_train_mib": memory.peak() / MIB,
        "resident_before_training_mib": resident / MIB,
        "peak_includes_build": memory.includes_setup,
    }


def forward_memory(cfg: BenchConfig, shape_name: str, row: str) -> dict[str, Any]:
    """Peak memory of one forward pass (no gradient) of a method's model or a reading's (`scale_cl.bench.readings`:
    the control holds the base beside its model), model resident."""
    device, shape = cfg.torch_device, cfg.shape(shape_name)
    memory = PeakMemory(device)
    base = build_base(shape, cfg.seed)
    method = READINGS[row].method if row in READINGS else row
    model = build_method(base, method, method_options(shape, cfg)[method], device, cfg.torch_dtype)
    if row in READINGS:
        model = reading_model(row, model, base)
    del base
    model.eval()
    ids = torch.randint(0, shape.make_config().vocab_size, (cfg.batch, cfg.seq), device=device)
    memory.reset()
    resident = memory.above_baseline()
    with torch.no_grad():
        model(input_ids=ids)
    synchronize(device)
    return {
        "peak_forward_mib": memory.peak() / MIB,
        "resident_before_mib": resident / MIB,
        "peak_includes_build": memory.includes_setup,
    }


def upscale_cost(cfg: BenchConfig, shape_name: str) -> dict[str, Any]:
    """Wall time and peak memory of `upscale` (SVD initialisation included) on a freshly built base model."""
    device, shape = cfg.torch_device, cfg.shape(shape_name)
    memory = PeakMemory(device)
    model = build_base(shape, cfg.seed).to(device=device, dtype=cfg.torch_dtype)
    base_bytes = _param_bytes(model)
    scale = scale_configs(shape, cfg)["route"]
    memory.reset()
    resident = memory.above_baseline()
    synchronize(device)
    start = time.perf_counter()
    upscale(model, scale)
    synchronize(device)
    wall = time.perf_counter() - start
    peak = memory.peak()
    upscaled = _param_bytes(model)
    return {
        "config": f"hidden_up {scale.hidden_up}, ffn_up {scale.ffn_up}, W21 {scale.w21_init}, W22 {scale.w22_init}",
        "wall_s": wall,
        "peak_mib": peak / MIB,
        "base_model_mib": base_bytes / MIB,
        "resident_before_mib": resident / MIB,
        "upscaled_model_mib": upscaled / MIB,
        "peak_over_model": peak / upscaled,
        "peak_includes_build": memory.includes_setup,
    }


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    cfg = BenchConfig.from_dict(task["config"])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.use_training_kernels()
    if task["task"] == "train_memory":
        return train_memory(cfg, task["shape"], task["method"])
    if task["task"] == "forward_memory":
        return forward_memory(cfg, task["shape"], task["row"])
    if task["task"] == "upscale":
        return upscale_cost(cfg, task["shape"])
    raise ValueError(f"unknown task {task['task']!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = run_task(json.loads(argv[0]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
