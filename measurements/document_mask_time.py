"""What document masking costs (issue 49): a training step (forward and backward) on packed blocks with attention kept
inside each document (`scale_cl.data.packing.DocumentMaskCollator`: position_ids restart after every EOS, transformers
builds the block-diagonal mask from them) against the same blocks attending across their EOS (a causal mask, which
SDPA takes without building it).

The blocks are the clean-en preset's Korean training blocks (real document lengths; the clean base's tokenizer); the
models are the clean base itself (``clean-en``, SCALE widths +64 / +64 as its preset) and the bench's SmolLM2 shape with
random weights (`scale_cl.bench.shapes`), FFT and SCALE-Preserve. The two ways
alternate, round after round, so the machine's drift hits both alike; the median step of each is reported. Needs the
corpora and the clean base (`measurements/cpt_corpus.py`, `scale-cl base`). Nothing else should run meanwhile.

    python measurements/document_mask_time.py [--shapes clean-en smollm2] [--batch 4] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scale_cl.bench.shapes import SHAPES, build_base
from scale_cl.data.corpus import build_corpus
from scale_cl.data.packing import DocumentMaskCollator
from scale_cl.experiments.base.name import CLEAN_EN_DIR
from scale_cl.experiments.cpt.config import preset
from scale_cl.methods import prepare
from scale_cl.tuner.config import ScaleConfig


def step(model: torch.nn.Module, batch: dict) -> float:
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["clean-en", "smollm2"], choices=["clean-en", *sorted(SHAPES)])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(CLEAN_EN_DIR)
    corpus = build_corpus(preset("clean-en").data, tokenizer)
    items = [corpus.train[i] for i in range(args.batch)]
    masked = DocumentMaskCollator(tokenizer.eos_token_id)(items)
    plain = {k: masked[k] for k in ("input_ids", "labels")}
    documents = int((masked["position_ids"] == 0).sum()) / args.batch
    print(
        f"`python measurements/document_mask_time.py --shapes {' '.join(args.shapes)} --batch {args.batch} --rounds "
        f"{args.rounds} --threads {args.threads}`, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}; blocks of {plain['input_ids'].shape[1]} tokens holding "
        f"{documents:.1f} documents on average\n"
    )
    print("| shape | method | causal s / step | document-masked s / step | masked / causal |")
    print("|---|---|---|---|---|")
    for name in args.shapes:
        for method in ("fft", "scale_preserve"):
            if name == "clean-en":
                base, widths = AutoModelForCausalLM.from_pretrained(CLEAN_EN_DIR), (64, 64)
            else:
                base, widths = build_base(SHAPES[name]), (SHAPES[name].hidden_up, SHAPES[name].ffn_up)
            scale = ScaleConfig(hidden_up=widths[0], ffn_up=widths[1], method="preserve", w21_init="random")
            model = prepare(base, method, **({"scale": scale} if method != "fft" else {})).train()
            times = {"causal": [], "masked": []}
            for _ in range(args.rounds + 1):  # the first round warms up
                times["causal"].append(step(model, plain))
                times["masked"].append(step(model, masked))
            causal, document = (statistics.median(times[k][1:]) for k in ("causal", "masked"))
            print(f"| {name} | {method} | {causal:.3f} | {document:.3f} | {document / causal:.2f}x |")


if __name__ == "__main__":
    main()
