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
    "train_floor_flops_per_token",
    "step_s",
    "train_tokens_per_s",
    "peak_train_mib",
    "state_mib",
    "forward_tokens_per_s",
    "generate_tokens_per_s",
    "peak_forward_mib",
)


# Environment variables that change the process's memory allocator (glibc's malloc tunables, a preloaded jemalloc or
# tcmalloc and their own settings).
ALLOCATOR_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", "TCMALLOC_RELEASE_RATE")


# Peak dense bf16 tensor-core TFLOP/s (no sparsity) of GPUs by a part of the name torch reports, the most specific
# first: NVIDIA's data sheets (H100 SXM / H200 989.4, H100 NVL 835, H100 PCIe 756, A100 312, L40S 362.05, L4 121).
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.05),
    ("L4", 121.0),
)


def peak_tflops(gpu: str | None, dtype: torch.dtype, given: float = 0.0) -> tuple[float | None, str]:
    """The peak MFU is measured against, and where it comes from: ``given`` (--peak_tflops) when set, else the bf16
    peak of a known GPU when the run is in bf16; None on a CPU or an unknown card."""
    if given:
        return given, "given (--peak_tflops)"
    if gpu is None or dtype != torch.bfloat16:
        return None, "no peak known: a CPU, or not bf16; --peak_tflops gives one"
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in gpu:
            return tflops, f"{part} dense bf16 data sheet"
    return None, f"unknown card {gpu!r} (give --peak_tflops)"


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
        # page-fault afresh, which costs the methods with more activation memory most (measurements/README.md).
        "allocator": {name: os.environ[name] for name in ALLOCATOR_VARIABLES if os.environ.get(name)},
        # SDPA's cuDNN kernel, switched off on CUDA as for training (scale_cl.train.device)
        "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled() if device.type == "cuda" else None,
    }
    return info


def add_ratios(methods: dict[str, dict[str, Any]], fft: dict[str, Any] | None = None) -> None:
    """Give every method (or reading) ``vs_fft[metric] = value / fft's value`` (None where either is missing); ``fft``:
    FFT's record, by default the one among ``methods``."""
    fft = methods.get("fft", {}) if fft is None else fft
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


def _target(
    issue: int, name: str, value: float | None, limit: float, at_most: bool = True, detail: str = ""
) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"issue": issue, "target": name, "value": value, "limit": limit, "at_most": at_most, "met": met,
            "detail": detail}  # fmt: skip


# Issue 38's step-time and FLOP limits against full fine-tuning (Llama-3.2-1B's shape, bf16, a GPU's default batch)
GPU_STEP_VS_FFT = {"scale_preserve": 0.6, "scale_adapt": 0.8, "scale_route": 1.0}
# The streams-apart targets' step-time limits against full fine-tuning: on a 2-core CPU at SmolLM2's shape, on one
# GPU at Llama-3.2-1B's
STREAMS_APART_CPU_VS_FFT = {"scale_preserve": 0.55, "scale_adapt": 0.70, "scale_route": 0.75}
STREAMS_APART_GPU_VS_FFT = {"scale_preserve": 0.50, "scale_adapt": 0.65, "scale_route": 0.72}


def evaluate_targets(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets, each with the measured ratio; only those whose measurements exist.

    Issue 5 states its targets for the SmolLM2 shape (training, generation) and the Llama-3.2-1B shape (upscale) on a
    2-core CPU; issue 38 for the Llama-3.2-1B shape in bf16 on one H100 or H200 at the GPU's default batch (step
    times, memory) and, on the CPU, the same ratios in counted FLOPs, each SCALE method within 10% of its floor; issue
    40 a one-pass likelihood reading's forward pass (SCALE-Preserve's with its router) at <= 1.5x FFT's; issue 53
    step times, SCALE-Preserve's memory and that reading's forward time, one row for the 2-core CPU at SmolLM2's
    shape and one for a GPU at Llama-3.2-1B's, with full fine-tuning's MFU on the GPU. They are evaluated on every
    shape measured, for information.
    """
    methods = entry.get("methods", {})
    targets: list[dict[str, Any]] = []

    def add(issue: int, name: str, value: float | None, limit: float, at_most: bool = True, detail: str = "") -> None:
        if value is not None:
            targets.append(_target(issue, name, value, limit, at_most, detail))

    for method in ("scale_preserve", "scale_adapt"):
        add(5, f"{method} step time / fft", _ratio(methods, method, "fft", "step_s"), 0.8)
        add(5, f"{method} step time / lora", _ratio(methods, method, "lora", "step_s"), 1.0)
    add(5, "scale_route step time / scale_adapt", _ratio(methods, "scale_route", "scale_adapt", "step_s"), 1.3)
    flop_ratio = _ratio(methods, "scale_route", "scale_adapt", "fwd_flops_per_token")
    step_ratio = _ratio(methods, "scale_route", "scale_adapt", "step_s")
    if flop_ratio and step_ratio:
        train_flop_ratio = _ratio(methods, "scale_route", "scale_adapt", "train_flops_per_token")
        detail = f"route/adapt forward FLOP ratio {flop_ratio:.3f}, measured step-time ratio {step_ratio:.3f}"
        if train_flop_ratio:
            detail += f", training (fwd+bwd) FLOP ratio {train_flop_ratio:.3f}"
        name = "|route/adapt step-time ratio / forward FLOP ratio - 1|"
        add(5, name, abs(step_ratio / flop_ratio - 1), 0.15, detail=detail)
    for method in SCALE_METHOD_NAMES:
        add(5, f"{method} peak training memory / lora", _ratio(methods, method, "lora", "peak_train_mib"), 1.15)
        add(5, f"{method} peak training memory / fft", _ratio(methods, method, "fft", "peak_train_mib"), 0.6)
    upscale = entry.get("upscale") or {}
    if "wall_s" in upscale:
        add(5, "upscale wall time (s)", upscale["wall_s"], 30.0)
        add(5, "upscale peak memory / upscaled model size", upscale["peak_over_model"], 1.5)
    for method in SCALE_METHOD_NAMES:  # issue 15's target: 0.9 (issue 5's was 0.85)
        speed = _ratio(methods, method, "fft", "generate_tokens_per_s")
        flops = _ratio(methods, "fft", method, "fwd_flops_per_token")
        if speed is not None and flops is not None:
            add(
                5,
                f"{method} generate tokens/s / (fft tokens/s x FLOP ratio fft/{method})",
                speed / flops,
                0.9,
                at_most=False,
                detail=f"generate speed {speed:.3f}x fft, FLOP ratio fft/{method} {flops:.3f}",
            )
    for method, limit in GPU_STEP_VS_FFT.items():
        add(38, f"{method} step time / fft (GPU)", _ratio(methods, method, "fft", "step_s"), limit)
        add(38, f"{method} step time / lora (GPU)", _ratio(methods, method, "lora", "step_s"), 0.8)
        add(38, f"{method} peak training memory / fft (GPU)", _ratio(methods, method, "fft", "peak_train_mib"), 0.55)
        add(38, f"{method} training FLOPs / fft", _ratio(methods, method, "fft", "train_flops_per_token"), limit)
        add(38, f"{method} training FLOPs / lora", _ratio(methods, method, "lora", "train_flops_per_token"), 0.8)
        record = methods.get(method, {})
        if record.get("train_flops_per_token") and record.get("train_floor_flops_per_token"):
            ratio = record["train_flops_per_token"] / record["train_floor_flops_per_token"]
            add(38, f"{method} training FLOPs counted / its floor", ratio, 1.1)
    for method, limit in STREAMS_APART_CPU_VS_FFT.items():
        add(53, f"{method} step time / fft (CPU)", _ratio(methods, method, "fft", "step_s"), limit)
    for method, limit in STREAMS_APART_GPU_VS_FFT.items():
        add(53, f"{method} step time / fft (GPU)", _ratio(methods, method, "fft", "step_s"), limit)
        add(53, f"{method} step time / lora (GPU)", _ratio(methods, method, "lora", "step_s"), 0.7)
    memory = _ratio(methods, "scale_preserve", "fft", "peak_train_mib")
    add(53, "scale_preserve peak training memory / fft (CPU)", memory, 0.7)
    add(53, "scale_preserve peak training memory / fft (GPU)", memory, 0.5)
    add(53, "fft MFU (GPU)", methods.get("fft", {}).get("mfu"), 0.45, at_most=False)
    for name, reading in entry.get("readings", {}).items():
        if name.endswith("-likelihood"):  # issue 40: a one-pass likelihood reading's inference cost
            versus = reading.get("vs_fft") or {}
            add(40, f"{name} forward FLOPs / fft", versus.get("fwd_flops_per_token"), 1.5)
            speed = versus.get("forward_tokens_per_s")
            add(40, f"{name} forward time / fft (1 / its speed ratio)", 1 / speed if speed else None, 1.5)
            if name == "preserve-likelihood":
                add(53, f"{name} forward time / fft", 1 / speed if speed else None, 1.35)
        if name == "preserve-calibrated":  # the calibrated reading held to the likelihood reading's forward target
            speed = (reading.get("vs_fft") or {}).get("forward_tokens_per_s")
            add(63, f"{name} forward time / fft", 1 / speed if speed else None, 1.35)
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


def _floor_cell(record: dict[str, Any]) -> str:
    """The floor, its ratio to fft's floor, and how far the counted FLOPs are above it."""
    floor, counted = record.get("train_floor_flops_per_token"), record.get("train_flops_per_token")
    if floor is None:
        return "—"
    text = _cell(record, "train_floor_flops_per_token", 1e-6)
    return f"{text}, counted {counted / floor:.2f}x" if counted else text


def shape_markdown(name: str, entry: dict[str, Any]) -> str:
    lines = [f"## {name}: {entry['description']}", ""]
    lines += [f"* {note}" for note in entry.get("notes", [])]
    if entry.get("notes"):
        lines.append("")
    methods = entry.get("methods", {})
    if methods:
        loss = f", the {entry['loss']} loss over a vocabulary of {entry['vocab']}" if "loss" in entry else ""
        lines += [
            f"Training{loss} (ratios against fft in brackets):",
            "",
            "| method | setting | trainable params | fwd MFLOP/token | train MFLOP/token | train floor MFLOP/token "
            "| s / step | train tokens/s | MFU | peak train MiB | state MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in methods.items():
            mfu = "—" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
            lines.append(
                f"| {method} | {r['setting']} | {_cell(r, 'trainable_params')} "
                f"| {_cell(r, 'fwd_flops_per_token', 1e-6)} | {_cell(r, 'train_flops_per_token', 1e-6)} "
                f"| {_floor_cell(r)} | {_cell(r, 'step_s')} | {_cell(r, 'train_tokens_per_s')} | {mfu} "
                f"| {_cell(r, 'peak_train_mib')} | {_cell(r, 'state_mib')} |"
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
        lines += _readings_markdown(entry)
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
        lines += [
            "Targets (issue 5: SmolLM2's shape on a 2-core CPU; issue 38: Llama-3.2-1B's shape, bf16, one H100 or "
            "H200 at the GPU's default batch, and the same ratios in counted FLOPs; issue 40: a one-pass likelihood "
            "reading's forward at <= 1.5x FFT's; issue 53: a CPU row at SmolLM2's shape and a GPU row at "
            "Llama-3.2-1B's; evaluated here for information):",
            "",
            "| issue | target | measured | limit | met |",
            "|---|---|---|---|---|",
        ]
        for t in targets:
            bound = f"{'<=' if t['at_most'] else '>='} {t['limit']:g}"
            met = "yes" if t["met"] else "**no**"
            detail = f" ({t['detail']})" if t.get("detail") else ""
            lines.append(f"| {t.get('issue', 5)} | {t['target']}{detail} | {t['value']:.3f} | {bound} | {met} |")
        lines.append("")
    return "\n".join(lines)


def _readings_markdown(entry: dict[str, Any]) -> list[str]:
    """The readings' table (`scale_cl.bench.readings`), FFT's row first: what each costs at inference."""
    readings = entry.get("readings") or {}
    if not readings:
        return []
    fft = entry["methods"].get("fft", {})
    lines = [
        "",
        "Inference read with the likelihood router (ratios against fft's model alone):",
        "",
        "| reading | setting | fwd MFLOP/token | forward tokens/s | generate() tokens/s | peak forward MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in [("fft", {**fft, "setting": "the model alone"}), *readings.items()]:
        lines.append(
            f"| {name} | {r['setting']} | {_cell(r, 'fwd_flops_per_token', 1e-6)} "
            f"| {_cell(r, 'forward_tokens_per_s')} | {_cell(r, 'generate_tokens_per_s')} "
            f"| {_cell(r, 'peak_forward_mib')} |"
        )
    errors = [f"{n}: {r['memory_error']}" for n, r in readings.items() if r.get("memory_error")]
    return lines + [f"* forward memory measurement failed for {e}" for e in errors]


def _compiled(cfg: dict[str, Any]) -> str:
    mode = cfg.get("compile", "none")
    return "" if mode == "none" else f"torch.compile(mode={mode!r}) in the timed steps, "


def _peak_text(meta: dict[str, Any]) -> str:
    peak = meta.get("peak_tflops")
    return f"{peak:g} TFLOP/s, {meta['peak_source']}" if peak else meta.get("peak_source", "none")


def to_markdown(results: dict[str, Any]) -> str:
    meta, cfg = results["meta"], results["config"]
    where = f"{meta['cpu_cores']} CPU cores ({meta['cpu']}), {meta['torch_threads']} torch threads"
    allocator = meta.get("allocator") or {}
    where += ", " + (" ".join(f"{k}={v}" for k, v in allocator.items()) or "the system's default allocator")
    if meta.get("gpu"):
        where = f"{meta['gpu']}; {where}"
    if meta.get("cudnn_attention") is not None:
        where += f", cuDNN attention {'on' if meta['cudnn_attention'] else 'off'}"
    lines = [
        "# scale-cl bench",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['date']}; {where}; {meta['ram_gib']} GiB RAM; torch {meta['torch']}, transformers "
        f"{meta['transformers']}, peft {meta['peft']}, Python {meta['python']}; device {meta['device']}, "
        f"{meta['dtype']}.",
        "",
        f"Training: batch {cfg['batch']} x {cfg['seq']} tokens ({cfg['batch'] * cfg['seq']:,} a step), AdamW (lr "
        f"{cfg['lr']:g}), {_compiled(cfg)}{cfg['warmup']} warm-up step(s), then {cfg['rounds']} rounds of "
        f"{cfg['steps']} step(s) per method, the methods interleaved; "
        "s / step is the median, train tokens/s = batch x seq / median. FLOPs per token: every matmul and "
        f"attention product of one pass (batch 1 x {cfg['seq']}) as run, counted by torch's FlopCounterMode "
        "(train = forward + backward, optimizer excluded); the floor is what the method's definition needs computed, "
        "by formula (scale_cl.bench.floor; fft and the SCALE methods). MFU: counted training FLOPs per second over "
        f"the device's peak ({_peak_text(meta)}). Peak train memory: a fresh process per method "
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
