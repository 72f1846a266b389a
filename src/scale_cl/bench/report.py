"""Ratios against FFT, the issue's targets, and the markdown / JSON output of `scale-cl bench`."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from scale_cl.files import write_text
from scale_cl.methods import SCALE_METHOD_NAMES

# Per-method metrics that get a ratio against FFT of the same base model.
RATIO_METRICS = (
    "trainable_params",
    "fwd_flops_per_token",
    "train_flops_per_token",
    "step_s",
    "train_tokens_per_s",
    "peak_train_mib",
    "state_mib",
    "forward_tokens_per_s",
    "generate_tokens_per_s",
)


# Environment variables that change the process's memory allocator (glibc's malloc tunables, a preloaded jemalloc or
# tcmalloc and their own settings).
ALLOCATOR_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", "TCMALLOC_RELEASE_RATE")


def machine_info(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Where and with what the benchmark ran: recorded with every result."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram_gib = None
    try:
        with open("/proc/meminfo") as f:
            ram_gib = round(int(f.readline().split()[1]) / 1024**2, 1)
    except (OSError, ValueError, IndexError):
        pass
    import peft
    import transformers

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": ram_gib,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        # The memory allocator: on a CPU, one that returns freed blocks to the system makes every large tensor
        # page-fault afresh, which costs the methods with more activation memory most (benchmarks/README.md).
        "allocator": {name: os.environ[name] for name in ALLOCATOR_VARIABLES if os.environ.get(name)},
    }
    return info


def add_ratios(methods: dict[str, dict[str, Any]]) -> None:
    """Give every method ``vs_fft[metric] = value / fft's value`` (None where either is missing)."""
    fft = methods.get("fft", {})
    for record in methods.values():
        record["vs_fft"] = {
            metric: (record[metric] / fft[metric])
            if record.get(metric) is not None and fft.get(metric) not in (None, 0)
            else None
            for metric in RATIO_METRICS
        }


def _ratio(methods: dict[str, dict[str, Any]], a: str, b: str, metric: str) -> float | None:
    x, y = methods.get(a, {}).get(metric), methods.get(b, {}).get(metric)
    return x / y if x is not None and y not in (None, 0) else None


def _target(name: str, value: float | None, limit: float, at_most: bool = True, detail: str = "") -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"target": name, "value": value, "limit": limit, "at_most": at_most, "met": met, "detail": detail}


def evaluate_targets(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured ratio; only those whose measurements exist.

    The issue states them for the SmolLM2 shape (training, generation) and the Llama-3.2-1B shape
    (upscale) on a 2-core CPU; they are evaluated on every shape measured, for information.
    """
    methods = entry.get("methods", {})
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, at_most: bool = True, detail: str = "") -> None:
        if value is not None:
            targets.append(_target(name, value, limit, at_most, detail))

    for method in ("scale_preserve", "scale_adapt"):
        add(f"{method} step time / fft", _ratio(methods, method, "fft", "step_s"), 0.8)
        add(f"{method} step time / lora", _ratio(methods, method, "lora", "step_s"), 1.0)
    add("scale_route step time / scale_adapt", _ratio(methods, "scale_route", "scale_adapt", "step_s"), 1.3)
    flop_ratio = _ratio(methods, "scale_route", "scale_adapt", "fwd_flops_per_token")
    step_ratio = _ratio(methods, "scale_route", "scale_adapt", "step_s")
    if flop_ratio and step_ratio:
        train_flop_ratio = _ratio(methods, "scale_route", "scale_adapt", "train_flops_per_token")
        detail = f"route/adapt forward FLOP ratio {flop_ratio:.3f}, measured step-time ratio {step_ratio:.3f}"
        if train_flop_ratio:
            detail += f", training (fwd+bwd) FLOP ratio {train_flop_ratio:.3f}"
        name = "|route/adapt step-time ratio / forward FLOP ratio - 1|"
        add(name, abs(step_ratio / flop_ratio - 1), 0.15, detail=detail)
    for method in SCALE_METHOD_NAMES:
        add(f"{method} peak training memory / lora", _ratio(methods, method, "lora", "peak_train_mib"), 1.15)
        add(f"{method} peak training memory / fft", _ratio(methods, method, "fft", "peak_train_mib"), 0.6)
    upscale = entry.get("upscale") or {}
    if "wall_s" in upscale:
        add("upscale wall time (s)", upscale["wall_s"], 30.0)
        add("upscale peak memory / upscaled model size", upscale["peak_over_model"], 1.5)
    for method in SCALE_METHOD_NAMES:  # issue 15's target: 0.9 (issue 5's was 0.85)
        speed = _ratio(methods, method, "fft", "generate_tokens_per_s")
        flops = _ratio(methods, "fft", method, "fwd_flops_per_token")
        if speed is not None and flops is not None:
            add(
                f"{method} generate tokens/s / (fft tokens/s x FLOP ratio fft/{method})",
                speed / flops,
                0.9,
                at_most=False,
                detail=f"generate speed {speed:.3f}x fft, FLOP ratio fft/{method} {flops:.3f}",
            )
    return targets


# -- markdown -----------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 3) -> str:
    """``digits`` significant digits, thousands separators for large numbers, '—' for missing."""
    if value is None:
        return "—"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _cell(record: dict[str, Any], metric: str, scale: float = 1.0, digits: int = 3) -> str:
    value = record.get(metric)
    if value is None:
        return "—"
    ratio = record.get("vs_fft", {}).get(metric)
    text = _num(value * scale, digits)
    return f"{text} ({ratio:.2f}x)" if ratio is not None else text


def shape_markdown(name: str, entry: dict[str, Any]) -> str:
    lines = [f"## {name}: {entry['description']}", ""]
    lines += [f"* {note}" for note in entry.get("notes", [])]
    if entry.get("notes"):
        lines.append("")
    methods = entry.get("methods", {})
    if methods:
        lines += [
            "Training (ratios against fft in brackets):",
            "",
            "| method | setting | trainable params | fwd MFLOP/token | train MFLOP/token | s / step | train tokens/s "
            "| peak train MiB | state MiB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in methods.items():
            lines.append(
                f"| {method} | {r['setting']} | {_cell(r, 'trainable_params')} "
                f"| {_cell(r, 'fwd_flops_per_token', 1e-6)} | {_cell(r, 'train_flops_per_token', 1e-6)} "
                f"| {_cell(r, 'step_s')} | {_cell(r, 'train_tokens_per_s')} | {_cell(r, 'peak_train_mib')} "
                f"| {_cell(r, 'state_mib')} |"
            )
        if any(r.get("forward_tokens_per_s") is not None for r in methods.values()):
            lines += [
                "",
                "Inference:",
                "",
                "| method | forward tokens/s | generate() tokens/s |",
                "|---|---|---|",
            ]
            for method, r in methods.items():
                lines.append(f"| {method} | {_cell(r, 'forward_tokens_per_s')} | {_cell(r, 'generate_tokens_per_s')} |")
        errors = [f"{m}: {r['memory_error']}" for m, r in methods.items() if r.get("memory_error")]
        if errors:
            lines += ["", *[f"* memory measurement failed for {e}" for e in errors]]
        lines.append("")
    upscale = entry.get("upscale")
    if upscale:
        if "error" in upscale:
            lines += [f"Upscale: failed ({upscale['error']})", ""]
        else:
            lines += [
                f"Upscale ({upscale['config']}, fresh process):",
                "",
                "| wall s | peak MiB | base model MiB | upscaled model MiB | peak / upscaled model |",
                "|---|---|---|---|---|",
                f"| {upscale['wall_s']:.2f} | {upscale['peak_mib']:,.0f} | {upscale['base_model_mib']:,.0f} "
                f"| {upscale['upscaled_model_mib']:,.0f} | {upscale['peak_over_model']:.2f} |",
                "",
            ]
    targets = entry.get("targets", [])
    if targets:
        lines += ["Targets of issue 5:", "", "| target | measured | limit | met |", "|---|---|---|---|"]
        for t in targets:
            bound = f"{'<=' if t['at_most'] else '>='} {t['limit']:g}"
            met = "yes" if t["met"] else "**no**"
            detail = f" ({t['detail']})" if t.get("detail") else ""
            lines.append(f"| {t['target']}{detail} | {t['value']:.3f} | {bound} | {met} |")
        lines.append("")
    return "\n".join(lines)


def to_markdown(results: dict[str, Any]) -> str:
    meta, cfg = results["meta"], results["config"]
    where = f"{meta['cpu_cores']} CPU cores ({meta['cpu']}), {meta['torch_threads']} torch threads"
    allocator = meta.get("allocator") or {}
    where += ", " + (" ".join(f"{k}={v}" for k, v in allocator.items()) or "the system's default allocator")
    if meta.get("gpu"):
        where = f"{meta['gpu']}; {where}"
    lines = [
        "# scale-cl bench",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['date']}; {where}; {meta['ram_gib']} GiB RAM; torch {meta['torch']}, transformers "
        f"{meta['transformers']}, peft {meta['peft']}, Python {meta['python']}; device {meta['device']}, "
        f"{meta['dtype']}.",
        "",
        f"Training: batch {cfg['batch']} x {cfg['seq']} tokens, AdamW (lr {cfg['lr']:g}), {cfg['warmup']} warm-up "
        f"step(s), then {cfg['rounds']} rounds of {cfg['steps']} step(s) per method, the methods interleaved; "
        "s / step is the median, train tokens/s = batch x seq / median. FLOPs per token: every matmul and "
        f"attention product of one pass (batch 1 x {cfg['seq']}) as run, counted by torch's FlopCounterMode "
        "(train = forward + backward, optimizer excluded). Peak train memory: a fresh process per method "
        f"({'CUDA max allocated' if meta['device'] == 'cuda' else 'peak RSS above the imports'}, model resident); "
        "state = parameters + gradients + AdamW moments. Inference: median of "
        f"{cfg['infer_rounds']} interleaved rounds of a forward pass on the training batch and generate() of "
        f"{cfg['gen_tokens']} greedy tokens after a {cfg['gen_prompt']}-token prompt (batch {cfg['gen_batch']}, "
        "prefill included). Ratios are against fft of the same base model (= the base model for inference).",
        "",
    ]
    for name, entry in results["shapes"].items():
        lines.append(shape_markdown(name, entry))
    return "\n".join(lines)


def write_results(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``out`` (atomically: temp file, then rename)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "results.json", out / "results.md")
    for path, text in zip(paths, (json.dumps(results, indent=2), to_markdown(results)), strict=True):
        write_text(path, text + "\n")
    return paths
