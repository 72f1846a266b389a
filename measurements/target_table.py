"""Issue 16's target read off `scale-cl sweep cpt` or `scale-cl sweep bio` folders: each point's share of FFT's
new-domain gain and of its old-domain degradation, seed by seed.

For seed ``s``, cpt: gain = ln(base new-domain ppl) - ln(point's), degradation = ln(point's old-domain ppl) -
ln(base's); bio: gain = Task-1 accuracy at the end - the Task-0 model's, degradation = the Task-0 model's Task-0
accuracy - the point's (held-out people at the end and at the minimum, QA-trained people at the end). Each is
divided by FFT's at its preset rate (x1) for the same seed; reported as mean ± population std over the seeds.
The target: degradation <= 10% of FFT's with gain >= 90% of FFT's. For cpt, log-perplexity (loss) differences are
used because perplexities multiply: a 26,000 -> 7 fall and a 38 -> 73 rise are not comparable as ratios of ppl.

Usage: python measurements/target_table.py SWEEP_DIR [SWEEP_DIR ...]   (the first holds FFT's x1 point)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path


def points(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / "points").glob("*/point.json"))]


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    if any(math.isnan(v) for v in values):
        return "n/a"
    mean, std = statistics.fmean(values) * scale, statistics.pstdev(values) * scale
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def share(part: float, whole: float) -> float:
    """``part / whole``, NaN where FFT itself neither learnt nor forgot (a micro run)."""
    return part / whole if whole else math.nan


Metric = Callable[[dict, str], float]  # (a seed's record, the seed) -> a value


def reference(folder: Path) -> tuple[dict, list[str]]:
    """FFT's point at its preset rate (x1, no ablation setting) and its seeds."""
    fft = next(p for p in points(folder) if p["method"] == "fft" and not p["label"] and p["scale"] == 1.0)
    return fft, sorted(fft["seeds"])


def print_table(
    folders: list[Path],
    values: dict[str, tuple[Callable[[dict], float], int]],
    scale: float,
    gain: Metric,
    losses: dict[str, Metric],
) -> list[str]:
    """One row per point that has every seed of FFT's x1 point: each value's mean ± std over the seeds, then the
    point's gain and each loss as a share of FFT's for the same seed. ``values``: header -> (a seed's value, digits
    shown); ``scale``: their unit (100: a share as %). Returns the seeds."""
    fft, seeds = reference(folders[0])
    head = ["point", "lr", *values, "% of FFT's gain", *[f"% of FFT's {name}" for name in losses]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def shares(runs: list[dict], metric: Metric) -> str:
        pairs = zip(runs, [fft["seeds"][s] for s in seeds], seeds, strict=True)
        return spread([share(metric(r, s), metric(f, s)) for r, f, s in pairs], 100, 1)

    for folder in folders:
        for point in points(folder):
            if not all(s in point["seeds"] for s in seeds):
                continue
            runs = [point["seeds"][s] for s in seeds]
            label = point["method"] + (f" ({point['label']})" if point["label"] else "") + f" [{folder.name}]"
            row = [label, f"{point['lr']:g}"]
            row += [spread([value(r) for r in runs], scale, digits) for value, digits in values.values()]
            row += [shares(runs, gain), *[shares(runs, loss) for loss in losses.values()]]
            print("| " + " | ".join(row) + " |")
    return seeds


BIO_VIEWS = {"task0_end": "task0", "task0_min": "task0", "task0_trained_end": "task0_trained"}


def bio_main(folders: list[Path]) -> None:
    """The biography benchmark's version: accuracies in points, the Task-0 model per seed as the base."""
    base = json.loads((folders[0] / "base_metrics.json").read_text())

    def loss(view: str) -> Metric:
        return lambda record, seed: base[seed][BIO_VIEWS[view]]["overall"] - record[view]

    values = {"Task 1 %": (lambda r: r["learning"], 1), **{f"{v} %": (lambda r, v=v: r[v], 1) for v in BIO_VIEWS}}
    seeds = print_table(
        folders,
        values,
        100,
        gain=lambda record, seed: record["learning"] - base[seed]["task1"]["overall"],
        losses={f"{v} loss": loss(v) for v in BIO_VIEWS},
    )
    starts = {
        v: [base[s][key]["overall"] for s in seeds]
        for v, key in (("Task 0 held-out", "task0"), ("QA-trained", "task0_trained"), ("Task 1", "task1"))
    }
    print(
        "\nTask-0 model: "
        + ", ".join(f"{name} {spread(values, 100, 1)}%" for name, values in starts.items())
        + f"; {len(seeds)} seeds ({', '.join(seeds)})"
    )


def main(folders: list[Path]) -> None:
    base = json.loads((folders[0] / "base_metrics.json").read_text())
    if "learning_ppl" not in base:
        bio_main(folders)
        return
    new0 = math.log(base["learning_ppl"])
    old0 = {name: math.log(ppl) for name, ppl in base["forgetting_ppl"].items()}
    names = sorted(old0)

    def degradation(name: str) -> Metric:
        return lambda record, seed: math.log(record[f"old/{name}"]) - old0[name]

    values = {
        "new-domain ppl": (lambda r: r["learning"], 2),
        **{f"`{n}` ppl": (lambda r, n=n: r[f"old/{n}"], 1) for n in names},
    }
    seeds = print_table(
        folders,
        values,
        1,
        gain=lambda record, seed: new0 - math.log(record["learning"]),
        losses={f"`{n}` degradation": degradation(n) for n in names},
    )
    print(
        f"\nbase model: new-domain ppl {base['learning_ppl']:,.0f}, "
        + ", ".join(f"`{n}` {ppl:.2f}" for n, ppl in sorted(base["forgetting_ppl"].items()))
        + f"; {len(seeds)} seeds ({', '.join(seeds)})"
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main([Path(arg) for arg in sys.argv[1:]])
