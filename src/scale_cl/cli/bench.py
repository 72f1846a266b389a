"""``scale-cl bench``: a `Command` over `scale_cl.bench.config.BenchCommand` (what to measure, where it goes)."""

from __future__ import annotations

from pathlib import Path

from scale_cl.bench.config import BenchCommand
from scale_cl.bench.shapes import SHAPES
from scale_cl.cli.command import Command

DESCRIPTION = (
    "Time every method of scale_cl.prepare on random-weight models of real shapes, in one process run with the "
    "methods interleaved (so machine drift hits all alike): training throughput, peak training memory (a fresh "
    "process per method), trainable parameters, forward FLOPs per token of the model as run, inference "
    "(forward and generate() tokens/s) and the one-off cost of upscale (wall time and peak memory, SVD "
    "included). Writes OUT/results.md and OUT/results.json with ratios against fft of the same base model, the "
    "machine, torch version and date, and the cost targets met or missed. Runs on the GPU in bf16 when "
    "there is one (--device auto).\n\nshapes:\n"
    + "\n".join(f"  {name:9s} {shape.description}" for name, shape in SHAPES.items())
)
EPILOG = (
    "examples:\n"
    "  scale-cl bench --shapes smollm2 llama-1b --out outputs/bench\n"
    "  scale-cl bench --shapes tiny --seq 64 --rounds 2 --skip_memory          # a smoke run, seconds\n"
    "  scale-cl bench --shapes smollm2 --methods fft lora scale_adapt --skip_inference --skip_upscale\n"
    "  scale-cl bench --shapes smollm2 --methods fft scale_preserve scale_route --skip_training \\\n"
    "      --readings route-likelihood preserve-likelihood control   # inference read with the likelihood router"
)


BENCH_CONFIG = "bench_config.json"


def run(settings: BenchCommand) -> int:
    """Refuse an ``--out`` that is a file, cannot be written, holds another kind of run or this command's results of
    other settings (as every command does, before anything is measured); then measure and write there."""
    from scale_cl.bench.runner import run_bench
    from scale_cl.experiments.run_folder import claim_output_folder

    out = Path(settings.out)
    recorded = {k: v for k, v in settings.bench.to_dict().items() if k != "progress"}  # bars change no result
    claim_output_folder(out, BENCH_CONFIG, recorded)
    run_bench(settings.bench, out, command=settings.command or "scale-cl bench")
    print((out / "results.md").read_text())
    print(f"[bench] wrote {out / 'results.md'} and {out / 'results.json'}")
    return 0


COMMAND = Command(
    name="bench",
    help="time every method: training throughput, memory, FLOPs, inference, upscale cost",
    description=DESCRIPTION,
    epilog=EPILOG,
    settings=BenchCommand,
    run=run,
    config_example="{shapes: [tiny, smollm2], rounds: 9, skip_memory: true}",
)
