"""Training step time of SCALE against FFT and LoRA on SmolLM2-135M's shape (random weights).

Interleaves the methods (one step each, round after round) so machine drift hits all of them
alike, and reports the median step time (forward, backward, AdamW) and its ratio to FFT. Also
times each SCALE method with the constant-stream optimisation switched off ("plain"), which is
the reference the optimisation must match in gradients (tests/tuner/test_fast_backward.py).

    python measurements/step_time.py [--rounds 5] [--batch 4] [--seq 256]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from scale_cl import ScaleConfig, prepare
from scale_cl.bench.shapes import SHAPES
from scale_cl.methods import method_spec
from scale_cl.tuner.layers import SplitInput

SMOLLM2 = SHAPES["smollm2"].make_config()  # SmolLM2-135M's shape, random weights
UP = {"hidden_up": 192, "ffn_up": 192, "w21_init": "svd", "w22_init": "zero"}
# name -> (prepare method, options); the targets of issue 5 name these settings.
METHODS = {
    "fft": ("fft", {}),
    "lora (matched)": ("lora", {"rank": "match", "match": ScaleConfig(**UP, method="preserve")}),
    "scale_preserve": ("scale_preserve", {**UP}),
    "scale_adapt (top 3)": ("scale_adapt", {**UP, "preserve_layers": 27}),
    "scale_route (top 1)": ("scale_route", {**UP, "preserve_layers": 29}),
}


def plain(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, SplitInput):
            module.constant_input = False
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one step per method each)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()

    torch.manual_seed(0)
    base = LlamaForCausalLM(SMOLLM2)
    models = {}
    for name, (method, options) in METHODS.items():
        models[name] = prepare(copy.deepcopy(base), method, **options)
        if method_spec(method).is_scale:
            models[f"{name} plain"] = plain(prepare(copy.deepcopy(base), method, **options))
    optimizers = {
        name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for name, m in models.items()
    }
    ids = torch.randint(0, SMOLLM2.vocab_size, (args.batch, args.seq))
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, model in models.items():
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if round_:
                times[name].append(time.perf_counter() - start)
    fft = statistics.median(times["fft"])
    print(
        f"SmolLM2-135M shape, batch {args.batch} x {args.seq}, AdamW, median of {args.rounds} interleaved rounds; "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {datetime.date.today()}"
    )
    print("| method | s / step | ratio to fft | trainable params |")
    print("|---|---|---|---|")
    for name, model in models.items():
        median = statistics.median(times[name])
        trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
        print(f"| {name} | {median:.2f} | {median / fft:.2f} | {trainable:,} |")


if __name__ == "__main__":
    main()
