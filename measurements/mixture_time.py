"""What mixing the experts' distributions costs at inference (issue 40, part 5): the routers' ``log sum_j w_j
softmax(z_j)`` over SmolLM2's vocabulary at every position, written the textbook way (a log_softmax per expert, one
logsumexp over them: full-size temporaries) against `scale_cl.tuner.routing.mixing` (cache-sized chunks, one
output), for two experts (the likelihood router, the control) and four (the nested router after three tasks).
Nested experts (SCALE-Preserve's one path ``Z``, ``Z + alpha Z_up``; a grown model's cumulative head sums) are
timed twice more: summed into whole tensors first, then mixed (the routers until 2026-11-27), and mixed from their
increments (``Z``, ``alpha Z_up``, ...) without forming the sums (now).

Interleaves the ways (one call each, round after round) so machine drift hits all alike; reports the median
seconds per call (normalisers included), the speed-ups and the largest difference. Random logits, no gradient.

    python measurements/mixture_time.py [--rounds 5] [--batch 4] [--seq 256] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F

from scale_cl.tuner.routing.mixing import log_normalisers, mixture_log_probs


def textbook(logits: list[torch.Tensor], log_weights: torch.Tensor) -> torch.Tensor:
    log_p = torch.stack([F.log_softmax(z.float(), dim=-1) for z in logits])
    return torch.logsumexp(log_weights[..., None] + log_p, dim=0)


def chunked(logits: list[torch.Tensor], log_weights: torch.Tensor, increments: bool = False) -> torch.Tensor:
    return mixture_log_probs(logits, list(log_weights - log_normalisers(logits, increments)), increments)


def summed_then_chunked(parts: list[torch.Tensor], log_weights: torch.Tensor) -> torch.Tensor:
    return chunked(list(accumulate(parts)), log_weights)


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
    print(
        "| experts | textbook s/call | chunked s/call | speed-up | nested, summed then chunked s/call | nested, "
        "from increments s/call | speed-up | max abs difference |"
    )
    print("|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.no_grad():
        for experts in (2, 4):
            parts = [torch.randn(args.batch, args.seq, args.vocab) * 4 for _ in range(experts)]
            logits = list(accumulate(parts))  # the nested experts the increments give, as whole tensors
            log_weights = torch.log_softmax(torch.randn(experts, args.batch, args.seq) * 4, dim=0)
            ways = {
                "textbook": partial(textbook, logits, log_weights),
                "chunked": partial(chunked, logits, log_weights),
                "summed": partial(summed_then_chunked, parts, log_weights),
                "increments": partial(chunked, parts, log_weights, increments=True),
            }
            times: dict[str, list[float]] = {name: [] for name in ways}
            for round_ in range(args.rounds + 1):  # round 0 warms up
                for name, way in ways.items():
                    start = time.perf_counter()
                    way()
                    if round_:
                        times[name].append(time.perf_counter() - start)
            reference = ways["textbook"]()
            difference = max((way() - reference).abs().max().item() for name, way in ways.items() if name != "textbook")
            old, new, summed, incremental = (statistics.median(times[name]) for name in ways)
            print(
                f"| {experts} | {old:.3f} | {new:.3f} | {old / new:.2f}x | {summed:.3f} | {incremental:.3f} | "
                f"{summed / incremental:.2f}x | {difference:.1e} |"
            )


if __name__ == "__main__":
    main()
