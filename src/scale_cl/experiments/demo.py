"""The upscale-and-verify demo on SmolLM2-135M: Theorem 3.1 checked on a real pre-trained model.

For each method it upscales a copy of the base model with random W21/W22 (the hardest case for
preservation) and checks that the logits and the greedy generation equal the base model's.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from scale_cl.bounds import check_fields
from scale_cl.methods import METHOD_NAMES, method_spec
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.upscale import upscale

PROMPTS = (
    "The capital of France is",
    "Continual learning means that a model",
)


@dataclass
class DemoResult:
    method: str
    max_abs_logit_diff: float
    same_generation: bool
    upscale_seconds: float
    trainable: int
    total: int

    @property
    def ok(self) -> bool:
        return self.same_generation and self.max_abs_logit_diff <= 1e-4


# the SCALE methods, spelt as every command spells them (scale_preserve, ...)
SCALE_METHODS = tuple(name for name in METHOD_NAMES if method_spec(name).is_scale)
# SmolLM2-135M's sizes, which bound the demo's settings before it loads: 30 decoder layers, and 3 KV heads of 64
# (9 query heads), so new width comes in whole GQA groups of head_dim x group = 64 x 3 = 192
# (`scale_cl.tuner.widths.check_fits`; scale_cl.bench.shapes has the same config)
SMOLLM2_LAYERS, SMOLLM2_HEAD_UNIT = 30, 192


@dataclass
class DemoSettings:
    """How SmolLM2-135M is upscaled for the check (``scale-cl demo``'s options)."""

    section: ClassVar[str] = ""  # where its settings are given (messages name them so)

    hidden_up: int = field(
        default=192,
        metadata={"gt": 0, "help": f"width added to the residual stream (multiple of {SMOLLM2_HEAD_UNIT})"},
    )
    ffn_up: int = field(default=512, metadata={"ge": 0, "help": "width added to every FFN"})
    preserve_layers: int = field(
        default=27,
        metadata={
            "ge": -SMOLLM2_LAYERS,
            "le": SMOLLM2_LAYERS,
            "help": f"L_fp: layers below it keep W12 frozen (SmolLM2 has {SMOLLM2_LAYERS})",
        },
    )
    max_new_tokens: int = field(default=16, metadata={"ge": 1, "help": "greedy tokens generated per prompt"})
    methods: tuple[str, ...] = field(
        default=SCALE_METHODS, metadata={"help": "methods to check", "choices": SCALE_METHODS}
    )

    def __post_init__(self) -> None:
        check_fields(self)
        # refused here, before SmolLM2 loads (`upscale` and the method registry would refuse them only after it)
        unknown = [m for m in self.methods if m not in SCALE_METHODS]
        if unknown or not self.methods:
            spelt = {m: f"scale_{m}" for m in unknown if f"scale_{m}" in SCALE_METHODS}
            hint = "".join(f"; {m!r} is spelt {name!r}" for m, name in spelt.items())
            raise ValueError(
                f"methods: the demo checks the SCALE methods, one or more of {', '.join(SCALE_METHODS)}; got "
                f"{list(self.methods)}{hint} (e.g. methods: [scale_route])"
            )
        if self.hidden_up % SMOLLM2_HEAD_UNIT:
            raise ValueError(
                f"hidden_up={self.hidden_up} must add whole attention heads to SmolLM2-135M: a multiple of head_dim "
                f"x GQA group = 64 x 3 = {SMOLLM2_HEAD_UNIT} (e.g. {SMOLLM2_HEAD_UNIT}, {2 * SMOLLM2_HEAD_UNIT})"
            )


def run_demo(settings: DemoSettings | None = None) -> list[DemoResult]:
    """Upscale SmolLM2-135M with each of ``settings.methods`` and compare it with the base model."""
    from scale_cl.models.smollm2 import load_smollm2

    s = settings or DemoSettings()

    base, tokenizer = load_smollm2()
    tokenizer.padding_side = "left"
    batch = tokenizer(list(PROMPTS), return_tensors="pt", padding=True)
    generate = {"max_new_tokens": s.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        base_logits = base(**batch).logits
        base_tokens = base.generate(**batch, **generate)
    mask = batch["attention_mask"].bool()
    results = []
    for method in s.methods:
        cfg = ScaleConfig(
            hidden_up=s.hidden_up,
            ffn_up=s.ffn_up,
            method=method_spec(method).scale_method,
            preserve_layers=s.preserve_layers,
            w21_init="random",
            w22_init="random",
        )
        start = time.perf_counter()
        model = upscale(copy.deepcopy(base), cfg)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            logits = model(**batch).logits
            tokens = model.generate(**batch, **generate)
        summary = model.scale_summary()
        results.append(
            DemoResult(
                method=method,
                max_abs_logit_diff=(logits - base_logits)[mask].abs().max().item(),
                same_generation=torch.equal(tokens, base_tokens),
                upscale_seconds=seconds,
                trainable=summary.trainable,
                total=summary.total,
            )
        )
        del model
    print("Base model greedy continuations:")
    for text in tokenizer.batch_decode(base_tokens, skip_special_tokens=True):
        print(f"  {text!r}")
    return results


def format_results(results: list[DemoResult]) -> str:
    lines = [
        "| method | max abs logit diff | same greedy text | trainable / total params | upscale s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.method} | {r.max_abs_logit_diff:.2e} | {'yes' if r.same_generation else 'NO'} | "
            f"{r.trainable:,} / {r.total:,} | {r.upscale_seconds:.1f} |"
        )
    return "\n".join(lines)
