"""What distillation to the base costs per training step (issue 28, item 1): free for SCALE-Preserve/Route (the head
hands over the base logits it computes anyway), one more forward pass of a frozen copy for FFT (LwF) and the others.

Interleaves the settings (one step each, round after round) so machine drift hits all alike, and reports the
median step time (forward, backward, AdamW; the term with ``distill_new_tokens confidence``) and its ratio to the
same method without the term. SmolLM2-135M's shape with random weights.

    python measurements/distill_step_time.py [--rounds 5] [--batch 4] [--seq 256] [--threads 2]
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

from scale_cl import prepare
from scale_cl.bench.shapes import SHAPES
from scale_cl.train.distill import DistillConfig, distill_sum, teacher_for

SMOLLM2 = SHAPES["smollm2"].make_config()
UP = {"hidden_up": 192, "ffn_up": 192, "w21_init": "svd", "w22_init": "zero"}
METHODS = {
    "fft": ("fft", {}),
    "scale_preserve": ("scale_preserve", UP),
    "scale_route (top 1)": ("scale_route", {**UP, "preserve_layers": 29}),
    "scale_adapt (top 3)": ("scale_adapt", {**UP, "preserve_layers": 27}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one step per setting each)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = LlamaForCausalLM(SMOLLM2)
    config = DistillConfig(1.0, new_tokens="confidence")
    runs = {}
    for name, (method, options) in METHODS.items():
        for distill in (False, True):
            model = prepare(copy.deepcopy(base), method, **options).train()
            teacher = teacher_for(model, lambda: copy.deepcopy(base)) if distill else None
            label = f"{name} + distill ({'head' if type(teacher).__name__ == 'HeadTeacher' else 'copy'})"
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            runs[label if distill else name] = (model, teacher, optimizer)
    ids = torch.randint(0, SMOLLM2.vocab_size, (args.batch, args.seq))
    inputs = {"input_ids": ids, "labels": ids}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (model, teacher, optimizer) in runs.items():
            start = time.perf_counter()
            if teacher is None:
                loss = model(**inputs).loss
            else:
                outputs, base_logits = teacher.run(lambda m=model: m(**inputs), inputs)
                loss = outputs.loss + distill_sum(outputs.logits, base_logits, ids, None, config) / ids[:, 1:].numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_:
                times[name].append(time.perf_counter() - start)
    print(
        f"SmolLM2-135M shape, batch {args.batch} x {args.seq}, AdamW, median of {args.rounds} interleaved rounds; "
        f"{os.cpu_count()} CPU cores, {args.threads} torch threads, torch {torch.__version__}, {datetime.date.today()}"
    )
    print("| setting | s / step | ratio to the method without the term |")
    print("|---|---|---|")
    for name, values in times.items():
        own = statistics.median(times[name.split(" + distill")[0]])
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / own:.2f} |")


if __name__ == "__main__":
    main()
