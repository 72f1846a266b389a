"""`run_bench`: every measurement for every shape, in one process run (plus one child per memory figure)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from scale_cl.bench.config import REFERENCE, BenchConfig, split_method
from scale_cl.bench.floor import method_floor
from scale_cl.bench.measure import interleaved_inference, interleaved_training, median, state_bytes
from scale_cl.bench.memory import MIB, release_memory, run_child
from scale_cl.bench.readings import READINGS, reading_model
from scale_cl.bench.report import add_ratios, evaluate_targets, machine_info, peak_tflops, write_results
from scale_cl.bench.setup import build_method, describe, method_options, scale_configs
from scale_cl.bench.shapes import Shape, build_base, parameter_count
from scale_cl.eval.cost import forward_flops_per_token, train_flops_per_token
from scale_cl.methods import trainable_parameter_count


def _log(message: str) -> None:
    tqdm.write(f"[bench] {message}")


def _shape_entry(shape: Shape, cfg: BenchConfig) -> dict[str, Any]:
    scale = scale_configs(shape, cfg)
    return {
        "description": shape.description,
        "base_params": parameter_count(shape),
        "layers": shape.layers,
        "vocab": shape.make_config().vocab_size,
        "loss": cfg.loss,
        "hidden_up": shape.hidden_up,
        "ffn_up": shape.ffn_up,
        "preserve_layers": {method: sc.preserve_layers for method, sc in scale.items()},
        "upscale_only": cfg.is_upscale_only(shape.name),
        "methods": {},
        "readings": {},
        "notes": [],
    }


def _measure_methods(shape: Shape, cfg: BenchConfig, entry: dict[str, Any], peak: float | None) -> None:
    """Build every method's model from one random base, counting its FLOPs as it is built (kept only when training
    or inference is timed), then time training and inference."""
    device, dtype = cfg.torch_device, cfg.torch_dtype
    options = method_options(shape, cfg)
    vocab = shape.make_config().vocab_size
    generator = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, vocab, (cfg.batch, cfg.seq), generator=generator).to(device)
    prompt = torch.randint(0, vocab, (cfg.gen_batch, cfg.gen_prompt), generator=generator).to(device)
    base = build_base(shape, cfg.seed)
    timed = not (cfg.skip_training and cfg.skip_inference)  # else each model goes once counted: a large shape fits
    models: dict[str, torch.nn.Module] = {}
    for method in tqdm(cfg.methods, desc=f"build {shape.name}", disable=not cfg.progress, leave=False):
        model = build_method(base, method, options[method], device, dtype)
        entry["methods"][method] = record = {
            "setting": describe(method, model, options[method], cfg),
            "trainable_params": trainable_parameter_count(model),
            "total_params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
            "state_mib": state_bytes(model) / MIB,
        }
        if not cfg.skip_flops:
            name, kind = split_method(method)
            counted = model
            if kind != "none":  # torch's FLOP counter cannot see into bitsandbytes' kernels: count the dense twin
                dense = {k: v for k, v in options[method].items() if k != "base_quant"}
                counted = models.get(name) or build_method(base, name, dense, device, dtype)  # the same products
            record["fwd_flops_per_token"] = forward_flops_per_token(counted, ids[:1])
            record["train_flops_per_token"] = train_flops_per_token(counted, ids[:1])
            floor = method_floor(name, shape.make_config(), options[method].get("scale"), cfg.seq)
            record["train_floor_flops_per_token"] = floor.train if floor is not None else None
            del counted
        if timed:
            models[method] = model
        del model
        release_memory()
    del base

    if not cfg.skip_training:
        _log(f"{shape.name}: training, {len(models)} methods interleaved")
        times = interleaved_training(
            models,
            ids,
            lr=cfg.lr,
            warmup=cfg.warmup,
            steps=cfg.steps,
            rounds=cfg.rounds,
            compile_mode=cfg.compile,
            sliced=cfg.loss == "sliced",
            progress=cfg.progress,
        )
        for method, seconds in times.items():
            step = median(seconds)
            record = entry["methods"][method]
            record.update(step_s=step, step_s_all=seconds, train_tokens_per_s=cfg.batch * cfg.seq / step)
            if peak and record.get("train_flops_per_token"):  # model FLOPs utilisation: the FLOPs as run, per second
                record["mfu"] = record["train_flops_per_token"] * record["train_tokens_per_s"] / (peak * 1e12)
        gc.collect()

    if not cfg.skip_inference:
        readers = _reading_models(shape, cfg, entry, models, ids)
        _log(f"{shape.name}: inference" + (f", {len(readers)} readings" if readers else ""))
        times = interleaved_inference(
            {**models, **readers}, ids, prompt, new_tokens=cfg.gen_tokens, rounds=cfg.infer_rounds,
            progress=cfg.progress,
        )  # fmt: skip
        for row, t in times.items():
            record = entry["readings" if row in readers else "methods"][row]
            forward, generate = median(t["forward"]), median(t["generate"])
            record["forward_tokens_per_s"] = cfg.batch * cfg.seq / forward if forward else None
            record["generate_tokens_per_s"] = cfg.gen_batch * cfg.gen_tokens / generate if generate else None
        del readers
    del models
    release_memory()  # the memory children and the next shape get the memory back
    if cfg.readings and not cfg.skip_memory:
        for row in tqdm((REFERENCE, *cfg.readings), desc="peak forward memory", disable=not cfg.progress, leave=False):
            task = {"task": "forward_memory", "config": cfg.to_dict(), "shape": shape.name, "row": row}
            result = run_child(task)
            record = entry["readings" if row in READINGS else "methods"][row]
            if "error" in result:
                record["memory_error"] = result["error"]
                _log(f"{shape.name} {row}: forward memory measurement failed: {result['error']}")
            else:
                record["peak_forward_mib"] = result["peak_forward_mib"]

    if not cfg.skip_memory:
        for method in tqdm(cfg.methods, desc="peak memory (a process each)", disable=not cfg.progress, leave=False):
            result = run_child({"task": "train_memory", "config": cfg.to_dict(), "shape": shape.name, "method": method})
            record = entry["methods"][method]
            if "error" in result:
                record["memory_error"] = result["error"]
                _log(f"{shape.name} {method}: memory measurement failed: {result['error']}")
                continue
            record["peak_train_mib"] = result["peak_train_mib"]
            record["resident_before_training_mib"] = result["resident_before_training_mib"]
            if result["peak_includes_build"]:
                entry["notes"].append(f"{method}: the peak could not be reset after the build and includes it")


def _reading_models(
    shape: Shape, cfg: BenchConfig, entry: dict[str, Any], models: dict[str, torch.nn.Module], ids: torch.Tensor
) -> dict[str, torch.nn.Module]:
    """The models of ``cfg.readings`` (`scale_cl.bench.readings`), read from the (trained) method models, each
    recorded in ``entry["readings"]`` with its forward FLOPs counted."""
    base = build_base(shape, cfg.seed) if any(READINGS[r].two_models for r in cfg.readings) else None
    readers = {}
    for name in cfg.readings:
        reading = READINGS[name]
        readers[name] = model = reading_model(name, models[reading.method], base)
        record = entry["readings"][name] = {"setting": reading.setting, "reads": reading.method}
        if not cfg.skip_flops:
            record["fwd_flops_per_token"] = forward_flops_per_token(model, ids[:1])
    return readers


def run_bench(cfg: BenchConfig, out: Path | None = None, command: str = "scale-cl bench") -> dict[str, Any]:
    """Measure every shape of ``cfg``; write ``results.json`` / ``results.md`` into ``out`` after each shape.

    Returns the results dictionary (the JSON's content).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.use_training_kernels()
    meta = machine_info(cfg.torch_device, cfg.torch_dtype)
    meta["command"] = command
    meta["peak_tflops"], meta["peak_source"] = peak_tflops(meta["gpu"], cfg.torch_dtype, cfg.peak_tflops)
    results: dict[str, Any] = {"meta": meta, "config": cfg.to_dict(), "shapes": {}}
    for name in cfg.shapes:
        shape = cfg.shape(name)
        entry = _shape_entry(shape, cfg)
        results["shapes"][name] = entry
        if entry["upscale_only"]:
            entry["notes"].append(
                f"Only upscale's cost is measured for this shape on {cfg.torch_device.type} (training, memory, "
                "FLOPs and inference skipped: too slow here; --upscale-only with no shapes measures everything)."
            )
        else:
            _measure_methods(shape, cfg, entry, meta["peak_tflops"])
        if not cfg.skip_upscale:
            _log(f"{name}: upscale cost (fresh process)")
            entry["upscale"] = run_child({"task": "upscale", "config": cfg.to_dict(), "shape": name})
        add_ratios(entry["methods"])
        add_ratios(entry["readings"], entry["methods"].get(REFERENCE, {}))
        entry["targets"] = evaluate_targets(entry)
        if out is not None:
            write_results(results, out)
    return results
