"""``scale-cl bench``: the cost of every continual-learning method, measured side by side.

One run times training (tokens/s, interleaved across methods), peak training memory (a fresh
process per method), forward FLOPs per token of the model as run, inference (forward and
``generate()``), and the one-off cost of `scale_cl.tuner.upscale`, for random-weight models of real
shapes; the output is a markdown and a JSON table with ratios against FFT::

    from scale_cl.bench import BenchConfig, run_bench
    results = run_bench(BenchConfig(shapes=("tiny",)), out=Path("outputs/bench"))

Modules: ``config`` (`BenchConfig`: the settings, and the command's options), ``shapes`` (model
shapes), ``setup`` (each method's options), ``measure`` (timing, FLOPs), ``memory`` + ``child``
(fresh-process peaks), ``report`` (ratios, targets, markdown). The command is `scale_cl.cli.bench`
(``python -m scale_cl.bench`` runs it too).
"""

from scale_cl.bench.config import BenchConfig
from scale_cl.bench.runner import run_bench

__all__ = ["BenchConfig", "run_bench"]
