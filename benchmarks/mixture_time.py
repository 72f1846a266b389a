"""What mixing the experts' distributions costs at inference (issue 40, part 5): the routers' ``log sum_j w_j
softmax(z_j)`` over SmolLM2's vocabulary at every position, written the textbook way (a log_softmax per expert, one
logsumexp over them: full-size temporaries) against `scale_cl.tuner.routing.mixing` (cache-sized chunks, one
output), for two experts (the likelihood router, the control) and four (the nested router after three tasks).

Interleaves the two (one call each, round after round) so machine drift hits both alike; reports the median
seconds per call, their ratio and the largest difference. Random logits, no gradient.

    python benchmarks/mixture_time.py [--rounds 5] [--batch 4] [--seq 256] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F

from scale_cl.tuner.routing.mixing import log_normalisers, mixture_log_probs


def textbook(logits: list[torch.Tensor], log_weights: torch.Tensor) -> torch.Tensor:
    log_p = torch.stack([F.log_softmax(z.float(), dim=-1) for z in logits])
    return torch.logsumexp(log_weights[..., None] + log_p, dim=0)


def chunked(logits: list[torch.Tensor], log_weights: torch.Tensor) -> torch.Tensor:
    shifts = [w - log_normalisers(z) for w, z in zip(log_weights, logits, strict=True)]
    return mixture_log_probs(logits, shifts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one call per way each)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{args.threads} threads, {os.cpu_count()} CPUs; ({args.batch}, {args.seq}, {args.vocab}) fp32, no gradient"
    )
    print("| experts | textbook s/call | chunked s/call | speed-up | max abs difference |")
    print("|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.no_grad():
        for experts in (2, 4):
            logits = [torch.randn(args.batch, args.seq, args.vocab) * 4 for _ in range(experts)]
            log_weights = torch.log_softmax(torch.randn(experts, args.batch, args.seq) * 4, dim=0)
            ways = {"textbook": textbook, "chunked": chunked}
            times: dict[str, list[float]] = {name: [] for name in ways}
            for round_ in range(args.rounds + 1):  # round 0 warms up
                for name, way in ways.items():
                    start = time.perf_counter()
                    way(logits, log_weights)
                    if round_:
                        times[name].append(time.perf_counter() - start)
            difference = (textbook(logits, log_weights) - chunked(logits, log_weights)).abs().max().item()
            old, new = (statistics.median(times[name]) for name in ways)
            print(f"| {experts} | {old:.3f} | {new:.3f} | {old / new:.2f}x | {difference:.1e} |")


if __name__ == "__main__":
    main()
