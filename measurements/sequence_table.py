"""One table of issue 29's sequence metrics over several output folders (each a `scale-cl bio --sequence.tasks T` or
a `scale-cl cpt --sequence.then ...` run), with the verdict: does the best SCALE strategy's BWT reach half of FFT's
(closer to zero) with an ACC at least FFT's?

    python measurements/sequence_table.py outputs/bio-seq/once outputs/bio-seq/per-task outputs/bio-seq/lora-merged
    python measurements/sequence_table.py outputs/cpt-seq/once/seed-0 outputs/cpt-seq/once/seed-1 ...
    python measurements/sequence_table.py --matrices fft:once scale_preserve:per_task -- outputs/bio-seq/once ...

Biography folders hold every seed (mean ± population std over them); a cpt folder holds one seed, and folders of
the same strategy are pooled by method and growth. Values: biography accuracy points (%), cpt nats of -ln(ppl).
A cpt run with --eval.likelihood_control also gives its control's row (growth "control": the base and the method's
model after each task, mixed; its parameters and FLOPs those of all k + 1 models).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from scale_cl.eval.continual import continual_metrics

KEYS = ("la", "acc", "bwt", "fwt", "forgetting", "max_forgetting")


def runs_of(folder: Path) -> list[dict]:
    """Every method run in a folder: a cpt run's finished methods (each <method>/result.json, so methods run by
    separate commands into one folder all count), a biography run's results.json (its seeds) or, not finished yet,
    each finished method's seed-<s>/<method>.json."""
    if (folder / "cpt_config.json").is_file():
        found = [json.loads(path.read_text()) for path in sorted(folder.glob("*/result.json"))]
        return [run for run in found if "ppl_matrix" in run]
    if not (folder / "results.json").is_file():
        found = [json.loads(path.read_text()) for path in sorted(folder.glob("seed-*/*.json"))]
        return [run for run in found if "matrix" in run]
    results = json.loads((folder / "results.json").read_text())
    runs = []
    for method, summary in results["methods"].items():
        for run in summary.get("runs", [summary]):  # bio: per seed; cpt: the method's result itself
            runs.append({**run, "method": method})
    return runs


def control_run(run: dict) -> dict:
    """A run's control (the base and its model after each task, kept apart and mixed by the likelihood routers'
    posterior) as a run of its own: its matrices, and the cost of every model it runs (k + 1 after task k)."""
    control, models = run["control"], len(run["control"]["matrix"])
    last = run["parameters"][-1]
    cost = {
        **last,
        "total": last["total"] * models,
        "inference_flops_per_token": last["inference_flops_per_token"] * models,
    }
    perplexities = {"ppl_matrix": control["ppl_matrix"]} if "ppl_matrix" in control else {}  # a cpt run's only
    return {**run, "matrix": control["matrix"], **perplexities, "parameters": [cost]}


def spread(values: list[float], scale: float) -> str:
    mean = statistics.fmean(values) * scale
    std = statistics.pstdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:+.1f} ± {std:.1f}" if scale == 100 else f"{mean:+.3f} ± {std:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument(
        "--matrices",
        nargs="*",
        default=[],
        metavar="METHOD:GROWTH",
        help="also print these runs' mean matrices over seeds (accuracy in %%; cpt: perplexity, every set), e.g. "
        "fft:once scale_preserve:per_task",
    )
    args = parser.parse_args()
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    bio = True
    for folder in args.folders:
        for run in runs_of(folder):
            bio = bio and "ppl_matrix" not in run
            groups[(run["method"], run["growth"])].append(run)
            if run.get("control"):  # cpt --eval.likelihood_control: the base and each task's model, mixed
                groups[(run["method"], "control")].append(control_run(run))
    scale = 100 if bio else 1
    unit = "accuracy points (%)" if bio else "nats of -ln(perplexity)"
    print(f"| method | growth | seeds | {' | '.join(KEYS)} | parameters after the last task | inference FLOPs/token |")
    print("|---" * (len(KEYS) + 5) + "|")
    table = {}
    for (method, growth), runs in sorted(groups.items()):
        metrics = [continual_metrics(run["matrix"]) for run in runs]
        table[(method, growth)] = {k: statistics.fmean(m[k] for m in metrics) for k in KEYS}
        cells = [spread([m[k] for m in metrics], scale) for k in KEYS]
        last = runs[0]["parameters"][-1]
        print(
            f"| {method} | {growth} | {len(runs)} | " + " | ".join(cells) + f" | {last['total']:,} | "
            f"{last['inference_flops_per_token'] / 1e6:.2f} M |"
        )
    print(f"\nIn {unit}; mean ± population std over seeds.")
    fft = table.get(("fft", "once"))
    scale_rows = {key: row for key, row in table.items() if key[0].startswith("scale_")}
    if fft and scale_rows:
        (method, growth), best = max(scale_rows.items(), key=lambda item: item[1]["bwt"])
        met = best["bwt"] >= fft["bwt"] / 2 and best["acc"] >= fft["acc"]
        print(
            f"Verdict: the best SCALE strategy by BWT is {method} ({growth}): BWT {best['bwt'] * scale:+.2f} against "
            f"FFT's {fft['bwt'] * scale:+.2f} (target: at least {fft['bwt'] * scale / 2:+.2f}), ACC "
            f"{best['acc'] * scale:.2f} against {fft['acc'] * scale:.2f}: target {'met' if met else 'missed'}."
        )
    for wanted in args.matrices:
        method, _, growth = wanted.partition(":")
        if (method, growth or "once") not in groups:
            raise SystemExit(f"--matrices {wanted}: no such run; runs found: {', '.join(map(':'.join, groups))}")
        print_mean_matrix(f"{method} ({growth or 'once'})", groups[(method, growth or "once")], bio)


def print_mean_matrix(title: str, runs: list[dict], bio: bool) -> None:
    """The mean over seeds of the runs' matrices: rows after each task (start first), columns each task (bio) or
    every evaluated set (cpt, perplexity)."""
    first = runs[0]
    key, columns = ("matrix", first["tasks"]) if bio else ("ppl_matrix", first["columns"])
    if bio:
        columns = [f"Task {j}" for j in range(len(first[key][0]))]
    mean = [
        [statistics.fmean(run[key][i][j] for run in runs) for j in range(len(columns))] for i in range(len(first[key]))
    ]
    print(f"\n{title}, mean of {len(runs)} seed(s), after each task:\n")
    print("| after | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for i, row in enumerate(mean):
        label = "start" if i == 0 else (f"Task {i}" if bio else first["tasks"][i])
        print(f"| {label} | " + " | ".join(f"{v * 100:.1f}" if bio else f"{v:,.2f}" for v in row) + " |")


if __name__ == "__main__":
    main()
