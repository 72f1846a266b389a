"""`scale-cl train --dry_run`: the run sized before it starts, from the model's configuration alone (the bench's
measurements applied to a run).

Parameters are counted on the meta device (no weight is allocated; SCALE's from the shapes,
`scale_cl.methods.matching.scale_trainable_count`). Memory per GPU is the weights (fp32 masters, sharded under FSDP /
ZeRO-3), the gradients and the optimizer state of what trains, and the activations: bytes per token measured by
`scale-cl bench` (`ACTIVATIONS`) scaled to the model's layers, width and vocabulary. Time is the method's training
FLOP floor per token (`scale_cl.bench.floor`) at the FLOP rate the bench measured for the method (`RATES`).
Estimates, said to be so: the measured anchors are listed with their source.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from scale_cl.data.corpus import eval_sets
from scale_cl.experiments.train.config import TRAINED, TrainConfig
from scale_cl.experiments.train.sections import AUTO_MEASUREMENTS
from scale_cl.methods import method_spec
from scale_cl.remote_code import own_code_kwargs
from scale_cl.tuner.sliced_loss import slice_positions

GIB = 1024**3
# Activation bytes per token at SmolLM2-135M's shape (30 layers, hidden 576, vocabulary 49,152; +192/+192 for SCALE),
# fp32 on the CPU, 4 x 256 tokens: the bench's peak training memory minus parameters, gradients and AdamW state
# (measurements/README.md, "Measured: SmolLM2-135M's shape", run 4, 2026-11-22). Split into the logits' part
# (12 bytes per vocabulary entry: logits, log-probabilities, their gradient) and the rest, per layer and hidden unit.
_MEASURED_MIB = {
    "fft": 1874,
    "lora": 2894,
    "freeze": 1708,
    "llama_pro": 2462,
    "scale_preserve": 1995,
    "scale_adapt": 2081,
    "scale_route": 2122,
}
_SHAPE = {"layers": 30, "hidden": 576, "vocab": 49152, "hidden_up": 192, "tokens": 1024}
# Training FLOP/s the bench measured (train FLOPs per token x tokens per second). One H200, Llama-3.2-1B's shape,
# 16 x 1,024 tokens, bf16 (measurements/README.md, "The bench at Llama-3.2-1B's shape", 2026-11-26); the 2-core CPU,
# SmolLM2's shape, fp32 (run 4). Methods not timed there take FFT's rate.
RATES = {
    "h200": {"fft": 405.4e12, "scale_preserve": 293.5e12, "scale_adapt": 326.5e12, "scale_route": 283.5e12},
    "cpu": {"fft": 171.8e9, "scale_preserve": 141.1e9, "scale_adapt": 146.2e9, "scale_route": 140.4e9},
}


@dataclass
class Plan:
    """What a run will be: its sizes, its data, its memory per GPU and its time."""

    lines: list[tuple[str, str]]

    def __str__(self) -> str:
        width = max(len(key) for key, _ in self.lines)
        return "\n".join(f"  {key:<{width}}  {value}" for key, value in self.lines)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:,.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86400:,.1f} days"


def parameter_counts(config: Any, cfg: TrainConfig) -> tuple[int, int]:
    """(total, trainable) parameters of the prepared model, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    from scale_cl.methods import prepare, trainable_parameter_count
    from scale_cl.methods.matching import scale_trainable_count

    # a config with custom code came through `scale_cl.remote_code` (this scale-cl's own modeling file) or not at all
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=bool(getattr(config, "auto_map", None)))
    base = sum(p.numel() for p in model.parameters())
    spec = method_spec(cfg.method)
    if spec.is_scale:
        trained = scale_trainable_count(model, cfg.options.scale_config(spec.scale_method, cfg.seed))
        return base + trained, trained  # a fresh SCALE model holds what it trains (W12 only where used) and the base
    with torch.device("meta"):
        prepared = prepare(model, cfg.method, **cfg.options.prepare_options(cfg.method, cfg.seed))
    return sum(p.numel() for p in prepared.parameters()), trainable_parameter_count(prepared)


def activation_bytes(config: Any, cfg: TrainConfig, bf16: bool, sliced: bool = True) -> float:
    """Activation bytes of one micro-batch (module doc). ``sliced``: the loss's logits live a slice of positions at a
    time (`scale_cl.train.chunked_loss`, the Trainer's default; a sharded run keeps them whole)."""
    text = config.get_text_config()
    layers, hidden, vocab = text.num_hidden_layers, text.hidden_size, text.vocab_size
    up = cfg.options.scale.hidden_up if method_spec(cfg.method).is_scale else 0
    measured = _MEASURED_MIB[cfg.method] * 2**20 / _SHAPE["tokens"]
    logits = 12 * _SHAPE["vocab"]
    width = _SHAPE["hidden"] + (_SHAPE["hidden_up"] if up else 0)
    per_unit = (measured - logits) / (_SHAPE["layers"] * width)  # bytes per layer, hidden unit and token (fp32)
    layer_part = per_unit * (hidden + up) * (0.5 if bf16 else 1.0)
    if cfg.train.gradient_checkpointing:  # each layer keeps its input; one layer's activations live at a time
        per_token = layers * (hidden + up) * (2 if bf16 else 4) + layer_part
    else:
        per_token = layers * layer_part
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    rows = micro * seq
    if sliced:
        rows = min(rows, slice_positions(micro, seq, hidden + up, vocab) * micro)
    return per_token * micro * seq + 12 * vocab * rows


def _steps(cfg: TrainConfig) -> tuple[int, str]:
    """The run's optimizer steps and what set them (0: epochs, unknown until the corpus is tokenised)."""
    t = cfg.train
    if t.token_budget:
        return math.ceil(t.token_budget / (t.batch_size * cfg.data.seq_len)), f"train.tokens {t.tokens}"
    if t.max_steps:
        return t.max_steps, "train.max_steps"
    return 0, f"{t.epochs:g} epoch(s) of the corpus (its size is known once it is tokenised)"


def _data_memory(cfg: TrainConfig, tokens: int) -> str:
    """What the data path holds in memory beside the model: a streamed run its shuffle window of blocks; a cached
    run the order of the corpus's blocks (`scale_cl.train.sampler`: 8 bytes a block on every process), the corpus
    itself memory-mapped from the datasets cache."""
    d = cfg.data
    if d.streaming:
        held = d.shuffle_buffer * d.seq_len * 8  # int64 tokens, input_ids and labels one tensor
        return f"~{_gib(held)}: a shuffle window of {d.shuffle_buffer:,} blocks" if held else "a block at a time"
    if not tokens:
        return "8 bytes a block of the corpus (its order), the corpus memory-mapped from the datasets cache"
    blocks = math.ceil(tokens / d.seq_len)
    return (
        f"~{_gib(8 * blocks)}: the order of the corpus's blocks, 8 bytes each, for the ~{blocks:,} the run reads "
        "(more for a larger corpus); the corpus memory-mapped from the datasets cache"
    )


def _sources(cfg: TrainConfig) -> str:
    d = cfg.data
    named = [f"{s} ({w:g})" for s, w in zip(d.train, d.weights, strict=True)] if d.weights else list(d.train)
    read = (
        "streamed" + (f", shuffle buffer {d.shuffle_buffer}" if d.shuffle_buffer else "")
        if d.streaming
        else ("tokenised once into the datasets cache")
    )
    return f"{', '.join(named) or '(none: --data.train)'}; {d.heldout_fraction:g} held out; {read}"


def plan(cfg: TrainConfig, config: Any, processes: int = 0, model_note: str = "") -> Plan:
    """The run's plan (module doc) for ``processes`` training processes (0: the launcher's, else 1)."""
    from scale_cl.bench.floor import method_floor
    from scale_cl.train.arguments import resolved_optimizer
    from scale_cl.train.sharding import requested_sharding

    world = processes or int(os.environ.get("WORLD_SIZE", "1"))
    t, d, spec = cfg.train, cfg.data, method_spec(cfg.method)
    cfg.options.validate(config, cfg.methods)  # the widths fit the model, as the run will check them
    if t.batch_size % (t.micro_batch_size * world):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be a multiple of train.micro_batch_size={t.micro_batch_size} x "
            f"{world} process(es)"
        )
    total, trainable = parameter_counts(config, cfg)
    steps, budget = _steps(cfg)
    tokens = steps * t.batch_size * d.seq_len
    gpu = torch.cuda.is_available() or world > 1 or t.device == "cuda"
    bf16 = t.precision == "bf16" or (t.precision == "auto" and gpu)
    text = config.get_text_config()
    read = "" if cfg.read_with == TRAINED else f", read with the {cfg.read_with} router"
    lines = [
        (
            "model",
            f"{cfg.model} ({text.num_hidden_layers} layers, hidden {text.hidden_size}, vocabulary "
            f"{text.vocab_size:,}){model_note}",
        ),
        ("method", spec.title + read),
        ("parameters", f"{total:,} in all, {trainable:,} trained ({trainable / total:.1%})"),
        ("data", _sources(cfg)),
    ]
    if d.old_eval:
        lines.append(("old domain", ", ".join(f"{n} = {s}" for n, s in eval_sets(d.old_eval).items())))
    if d.replay:
        lines.append(("replay", f"{d.replay_ratio:g} of the sequences from {', '.join(d.replay)}"))
    steps_text = f"{tokens:,} = {steps:,} steps x {t.batch_size} sequences x {d.seq_len} tokens ({budget})"
    lines.append(("tokens", steps_text if steps else budget))
    accumulation = t.batch_size // (t.micro_batch_size * world)
    lines.append(
        (
            "per process",
            f"{world} process(es): {t.batch_size // world} sequences a step each = micro-batch "
            f"{t.micro_batch_size} x {accumulation} accumulation steps, {d.seq_len} tokens each",
        )
    )
    warmup = max(t.warmup_steps, math.ceil(t.warmup_ratio * steps)) if steps else t.warmup_steps
    lines.append(
        (
            "schedule",
            f"lr {t.lr_of(cfg.method):g}, {t.schedule} after {warmup:,} warm-up steps; "
            f"{resolved_optimizer(t)}, clip {t.max_grad_norm:g}; {'bf16 autocast' if bf16 else 'fp32'}",
        )
    )
    saves = (f"every {t.save_every} steps" if t.save_every else "at the end") + (
        f" and every {t.save_minutes:g} min" if t.save_minutes else ""
    )
    measured = (
        f"every {cfg.eval.interval(steps):,} steps"
        if cfg.eval.every or steps
        else f"{AUTO_MEASUREMENTS} times (the run's length is known once the data is read)"
    )
    lines.append(("checkpoints", f"{saves}, the last {t.save_total_limit} kept; evaluation {measured}"))
    sharded = requested_sharding()
    shard = world if sharded else 1
    weights, grads = 4 * total / shard, 4 * trainable / shard
    state = (2 if t.optim == "adamw_8bit" else 8) * trainable / shard
    acts = activation_bytes(config, cfg, bf16, sliced=not sharded and t.loss == "sliced")
    checkpointed = ", checkpointed" if t.gradient_checkpointing else ""
    lines.append(
        (
            "memory / process",
            f"~{_gib(weights + grads + state + acts)}: weights {_gib(weights)}, "
            f"gradients {_gib(grads)}, optimizer {_gib(state)}"
            + (f" ({sharded}, {shard} shards)" if sharded else "")
            + f", activations ~{_gib(acts)} (micro-batch {t.micro_batch_size} x {d.seq_len}"
            f"{checkpointed}; estimated from the bench)",
        )
    )
    lines.append(("data / process", _data_memory(cfg, tokens)))
    scale = cfg.options.scale_config(spec.scale_method or "preserve", cfg.seed)
    floor = method_floor(cfg.method, config, scale, d.seq_len) or method_floor("fft", config, None, d.seq_len)
    if steps:
        device = "h200" if gpu else "cpu"
        rate = RATES[device].get(cfg.method, RATES[device]["fft"])
        where = f"{world} x H200" if gpu else "a 2-core CPU"
        seconds = tokens * floor.train / (rate * (world if gpu else 1))
        shape = "Llama-3.2-1B" if gpu else "SmolLM2-135M"
        lines.append(
            (
                "time",
                f"~{_duration(seconds)} on {where}: {floor.train / 1e9:,.2f} GFLOP a token at the "
                f"{rate / 1e12:,.3g} TFLOP/s the bench measured for this method at {shape}'s shape (an estimate:"
                " a smaller model runs below that rate)",
            )
        )
    return Plan(lines)


def plan_config(cfg: TrainConfig) -> tuple[Any, str]:
    """The base model's configuration for a plan, and a note when it is scale-cl's copy of a known hub model's shape
    (its own is neither local nor cached: nothing is downloaded for it). The data sources are checked first."""
    from transformers import AutoConfig

    from scale_cl.bench.shapes import shape_of_hub_id
    from scale_cl.data.corpus import check_corpus
    from scale_cl.experiments.train.prepare import base_model_config, base_model_ref

    check_corpus(cfg.data)
    shape = shape_of_hub_id(cfg.model)
    if shape is None:
        return base_model_config(cfg), ""
    ref = base_model_ref(cfg)
    try:
        trust = {} if ref.gguf_file else own_code_kwargs(ref.name_or_path, local_files_only=True)
        return AutoConfig.from_pretrained(ref.name_or_path, local_files_only=True, **trust), ""
    except OSError:
        return shape.make_config(), " [not in the local cache: scale-cl's copy of its shape]"
