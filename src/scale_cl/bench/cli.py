"""``scale-cl bench`` (and ``python -m scale_cl.bench``): argument parsing and the entry point."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from scale_cl.bench.config import MATCH_TARGETS, BenchConfig
from scale_cl.bench.shapes import SHAPES
from scale_cl.methods import METHOD_NAMES

DESCRIPTION = (
    "Time every method of scale_cl.prepare on random-weight models of real shapes, in one process run with the\n"
    "methods interleaved (so machine drift hits all alike): training throughput, peak training memory (a fresh\n"
    "process per method), trainable parameters, forward FLOPs per token of the model as run, inference\n"
    "(forward and generate() tokens/s) and the one-off cost of upscale (wall time and peak memory, SVD\n"
    "included). Writes OUT/results.md and OUT/results.json with ratios against fft of the same base model, the\n"
    "machine, torch version and date, and the issue-5 targets met or missed. Runs on the GPU in bf16 when\n"
    "there is one (--device auto).\n\nshapes:\n"
    + "\n".join(f"  {name:9s} {shape.description}" for name, shape in SHAPES.items())
)
EPILOG = (
    "examples:\n"
    "  scale-cl bench --shapes smollm2 llama-1b --out outputs/bench\n"
    "  scale-cl bench --shapes tiny --seq 64 --rounds 2 --skip-memory          # a smoke run, seconds\n"
    "  scale-cl bench --shapes smollm2 --methods fft lora scale_adapt --skip-inference --skip-upscale"
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``scale-cl bench`` (defaults are `BenchConfig`'s)."""
    d = BenchConfig()
    add = parser.add_argument
    add("--shapes", nargs="+", choices=list(SHAPES), default=list(d.shapes), help="model shapes to measure")
    add("--methods", nargs="+", choices=list(METHOD_NAMES), default=list(d.methods), help="methods (keep fft: ratios)")
    add("--out", default="outputs/bench", help="output folder for results.md and results.json")
    add("--batch", type=int, default=d.batch, help="training / forward batch size (sequences)")
    add("--seq", type=int, default=d.seq, help="tokens per sequence")
    add("--warmup", type=int, default=d.warmup, help="untimed optimizer steps per method before timing")
    add("--steps", type=int, default=d.steps, help="timed optimizer steps per method in each round")
    add("--rounds", type=int, default=d.rounds, help="timed rounds; each runs --steps steps of every method in turn")
    add("--lr", type=float, default=d.lr, help="AdamW learning rate (timing does not depend on it)")
    add("--device", choices=["auto", "cpu", "cuda"], default=d.device, help="auto: cuda when available")
    add("--dtype", choices=["auto", "fp32", "bf16"], default=d.dtype, help="auto: bf16 on CUDA, fp32 on CPU")
    add("--threads", type=int, default=d.threads, help="torch intra-op threads (0: torch's default)")
    add("--adapt-top", type=int, default=d.adapt_top, help="scale_adapt: how many top layers are collaborative")
    add("--route-top", type=int, default=d.route_top, help="scale_route: how many top layers are collaborative")
    add(
        "--match",
        choices=list(MATCH_TARGETS),
        default=d.match,
        help="the SCALE config (scale_<match>) whose trainable parameters LoRA's rank and LLaMA Pro's blocks match",
    )
    add("--w21-init", choices=["zero", "random", "svd"], default=d.w21_init, help="SCALE W21 initialiser")
    add("--w22-init", choices=["zero", "random", "svd"], default=d.w22_init, help="SCALE W22 initialiser")
    add(
        "--upscale-only",
        nargs="*",
        choices=list(SHAPES),
        default=None,
        metavar="SHAPE",
        help="shapes measured for upscale's cost only (default: llama-1b on CPU, none on CUDA; give the option "
        "with no shape to measure everything everywhere)",
    )
    add("--infer-rounds", type=int, default=d.infer_rounds, help="timed inference rounds (after one warm-up round)")
    add("--gen-batch", type=int, default=d.gen_batch, help="generate(): prompts per call")
    add("--gen-prompt", type=int, default=d.gen_prompt, help="generate(): prompt length in tokens")
    add("--gen-tokens", type=int, default=d.gen_tokens, help="generate(): new tokens (greedy; 0 skips generate)")
    add("--skip-training", action="store_true", help="do not time training")
    add("--skip-memory", action="store_true", help="do not measure peak training memory (one process per method)")
    add("--skip-inference", action="store_true", help="do not time forward passes and generate()")
    add("--skip-flops", action="store_true", help="do not count FLOPs")
    add("--skip-upscale", action="store_true", help="do not measure upscale's cost")
    add("--seed", type=int, default=d.seed, help="seed of the random weights and inputs")
    add("--no-progress", action="store_true", help="no progress bars")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        shapes=tuple(args.shapes),
        methods=tuple(dict.fromkeys(args.methods)),
        batch=args.batch,
        seq=args.seq,
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
        lr=args.lr,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        adapt_top=args.adapt_top,
        route_top=args.route_top,
        match=args.match,
        w21_init=args.w21_init,
        w22_init=args.w22_init,
        upscale_only=None if args.upscale_only is None else tuple(args.upscale_only),
        infer_rounds=args.infer_rounds,
        gen_batch=args.gen_batch,
        gen_prompt=args.gen_prompt,
        gen_tokens=args.gen_tokens,
        skip_training=args.skip_training,
        skip_memory=args.skip_memory,
        skip_inference=args.skip_inference,
        skip_flops=args.skip_flops,
        skip_upscale=args.skip_upscale,
        seed=args.seed,
        progress=not args.no_progress,
    )


def _command_line() -> str:
    """How this run was started, for the record: ``scale-cl bench ...`` or ``python -m scale_cl.bench ...``."""
    argv = sys.argv
    if argv and Path(argv[0]).name == "scale-cl":
        return shlex.join(["scale-cl", *argv[1:]])
    if argv and argv[0].endswith(("scale_cl/bench/__main__.py", "-m")):
        return shlex.join(["python", "-m", "scale_cl.bench", *argv[1:]])
    return shlex.join(["scale-cl", "bench", *argv[1:]])


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    from scale_cl.bench.runner import run_bench

    try:
        cfg = config_from_args(args)
        out = Path(args.out)
        run_bench(cfg, out, command=command or _command_line())
    except ValueError as err:
        print(f"scale-cl bench: error: {err}", file=sys.stderr)
        return 2
    print((out / "results.md").read_text())
    print(f"[bench] wrote {out / 'results.md'} and {out / 'results.json'}")
    return 0


def add_bench_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``scale-cl bench`` on the ``add_subparsers()`` object of the main parser."""
    parser = commands.add_parser(
        "bench",
        help="time every method: training throughput, memory, FLOPs, inference, upscale cost (issue 5)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m scale_cl.bench``: the same command without the ``scale-cl`` entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m scale_cl.bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = None if argv is None else shlex.join(["scale-cl", "bench", *argv])
    return run_from_args(args, command)
