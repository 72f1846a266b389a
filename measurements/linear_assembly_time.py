"""What assembling a `ScaleLinear`'s output costs: its two output blocks written apart and concatenated (the
split form every SCALE-Preserve linear takes, ``cat((W x, W21 x + W22 x_up))``) against both written into one
preallocated output (``addmm_`` into its two column blocks, no concatenation, no temporary for ``W21 x + W22
x_up``), at SmolLM2-135M's shape (+192 hidden, +192 FFN: the bench's) for a batch of 4 x 256 tokens. The first
measurement for keeping SCALE's streams apart (the step's ``cat`` after every linear, measurements/README.md).

For context each linear's base product ``W x`` alone (full fine-tuning's linear: the same tokens, the original
width) and the merged form (one product with the whole block matrix, the FLOPs of a zero W12 block included). No
gradient: forward only. Interleaves the forms (one call each, round after round) so machine drift hits all
alike; reports the median milliseconds per call per linear, their sum over one decoder layer, and whether the
buffer's output equals the split form's bitwise.

    python measurements/linear_assembly_time.py [--rounds 15] [--tokens 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F

from scale_cl.tuner.arch.llama import LLAMA
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.widths import Dims, growth

SMOLLM2 = Dims(hidden=576, ffn=1536, head_dim=64, heads=9, kv_heads=3, layers=30)
SIZES = {"hidden": 576, "q": 576, "kv": 192, "ffn": 1536}


def split_form(x: torch.Tensor, x_up: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """SCALE-Preserve's linear as `ScaleLinear` computes it: the blocks apart, then one concatenation."""
    return torch.cat((F.linear(x, w["w"]), F.linear(x, w["w21"]) + F.linear(x_up, w["w22"])), dim=-1)


def buffer_form(x: torch.Tensor, x_up: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same products written into the two column blocks of one output."""
    rows, out = w["w"].shape[0], torch.empty(x.shape[0], w["w"].shape[0] + w["w21"].shape[0])
    out[:, :rows].addmm_(x, w["w"].t(), beta=0)
    added = out[:, rows:]
    added.addmm_(x, w["w21"].t(), beta=0).addmm_(x_up, w["w22"].t())
    return out


def merged_form(hidden: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(hidden, w["full"])


def base_form(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.linear(x, w["w"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per call (4 x 256: the bench's CPU batch)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    grow = growth(ScaleConfig(hidden_up=192, ffn_up=192), SMOLLM2)
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for lin in LLAMA.linears:
        d, o, u, ou = SIZES[lin.grow_in], SIZES[lin.grow_out], grow[lin.grow_in], grow[lin.grow_out]
        w = {name: torch.randn(shape, generator=gen) / shape[1] ** 0.5 for name, shape in
             (("w", (o, d)), ("w21", (ou, d)), ("w22", (ou, u)))}  # fmt: skip
        w["full"] = torch.cat((torch.cat((w["w"], torch.zeros(o, u)), 1), torch.cat((w["w21"], w["w22"]), 1)))
        hidden = torch.randn(args.tokens, d + u, generator=gen)
        cases[lin.path] = (hidden, *hidden.split((d, u), dim=-1), w)
    forms = {
        "split + cat": lambda h, x, xu, w: split_form(x, xu, w),
        "one buffer": lambda h, x, xu, w: buffer_form(x, xu, w),
        "merged": lambda h, x, xu, w: merged_form(h, w),
        "W x alone (fft)": lambda h, x, xu, w: base_form(x, w),
    }
    times = {(path, form): [] for path in cases for form in forms}
    with torch.no_grad():
        equal = {
            path: torch.equal(split_form(x, xu, w), buffer_form(x, xu, w)) for path, (_, x, xu, w) in cases.items()
        }
        for _ in range(args.rounds + 2):  # two warm-up rounds
            for path, case in cases.items():
                for form, call in forms.items():
                    start = time.perf_counter()
                    call(*case)
                    times[path, form].append(time.perf_counter() - start)
    median = {key: statistics.median(values[2:]) * 1e3 for key, values in times.items()}
    print(
        f"# {datetime.date.today()}, torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
        f"{args.tokens} tokens, {args.rounds} rounds; median ms per call"
    )
    print("| linear | " + " | ".join(forms) + " | buffer == split |")
    print("|---|" + "---|" * (len(forms) + 1))
    for path in cases:
        cells = " | ".join(f"{median[path, form]:.2f}" for form in forms)
        print(f"| {path} | {cells} | {'bitwise' if equal[path] else 'differs'} |")
    totals = {form: sum(median[path, form] for path in cases) for form in forms}
    split = totals["split + cat"]
    cells = " | ".join(f"{total:.2f} ({total / split:.2f}x)" for total in totals.values())
    print(f"| one decoder layer | {cells} | |")


if __name__ == "__main__":
    main()
