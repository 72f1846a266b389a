"""What the sliced training loss costs against transformers' whole-logit loss, at the head alone (issue 53, part 2).

The forward and backward of the LM head and its cross-entropy on random hidden states at SmolLM2-135M's shape
(tied head; SCALE-Preserve's head with +192 hidden), for the whole loss and for `scale_cl.train.chunked_loss` at
several positions per slice. Interleaves the forms (one call each, round after round) so machine drift hits all
alike; reports the median milliseconds per call and the logits each form holds at once (whole: tokens x vocabulary;
sliced: a slice's rows x vocabulary).

    python measurements/sliced_loss_time.py [--rounds 5] [--batch 4] [--seq 256] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from scale_cl import ScaleConfig, upscale
from scale_cl.train.chunked_loss import LossTargets, sliced_head


def model_of(vocab: int, scale: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if scale:
        model = upscale(model, ScaleConfig(method="preserve", hidden_up=192, ffn_up=192, w21_init="random"))
        with torch.no_grad():
            model.get_output_embeddings().weight_up.normal_(0, 0.02)
    return model.train()


def whole(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> None:
    logits = head(hidden)
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()).backward()


def sliced(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, positions: int) -> None:
    with sliced_head(head, LossTargets(labels, labels[:, 1:].numel()), positions):
        head(hidden).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {args}")
    for scale in (False, True):
        time_head(args, scale)


def time_head(args: argparse.Namespace, scale: bool) -> None:
    """Print one table: the whole loss and each slice size, interleaved round after round."""
    model = model_of(args.vocab, scale)
    head = model.get_output_embeddings()
    hidden = torch.randn(args.batch, args.seq, head.in_features, requires_grad=True)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    forms = {"whole": lambda: whole(head, hidden, labels)}
    for rows in (64, 256, 512, 1024, 2048):
        if args.batch <= rows < args.batch * args.seq:
            forms[f"{rows} rows"] = lambda p=rows // args.batch: sliced(head, hidden, labels, p)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for round_ in range(args.rounds + 1):
        for name, form in forms.items():
            model.zero_grad(set_to_none=True)
            hidden.grad = None
            start = time.perf_counter()
            form()
            if round_:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["whole"])
    print(f"\n{'SCALE-Preserve' if scale else 'FFT (tied)'} head, {args.batch * args.seq} tokens:")
    print("| form | ms per step | vs whole | logits kept (MiB, fp32) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        rows = args.batch * args.seq if name == "whole" else int(name.split()[0])
        step = statistics.median(values)
        print(f"| {name} | {1000 * step:.0f} | {step / base:.2f}x | {rows * args.vocab * 4 / 2**20:.0f} |")


if __name__ == "__main__":
    main()
