"""Issue 16's target read off `scale-cl sweep cpt` or `scale-cl sweep bio` folders: each point's share of FFT's
new-domain gain and of its old-domain degradation, seed by seed.

For seed ``s``, cpt: gain = ln(base new-domain ppl) - ln(point's), degradation = ln(point's old-domain ppl) -
ln(base's); bio: gain = Task-1 accuracy at the end - the Task-0 model's, degradation = the Task-0 model's Task-0
accuracy - the point's (held-out people at the end and at the minimum, QA-trained people at the end). Each is
divided by FFT's at its preset rate (x1) for the same seed; reported as mean ± population std over the seeds.
The target: degradation <= 10% of FFT's with gain >= 90% of FFT's. For cpt, log-perplexity (loss) differences are
used because perplexities multiply: a 26,000 -> 7 fall and a 38 -> 73 rise are not comparable as ratios of ppl.

Usage: python benchmarks/target_table.py SWEEP_DIR [SWEEP_DIR ...]   (the first holds FFT's x1 point)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
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


BIO_VIEWS = {"task0_end": "task0", "task0_min": "task0", "task0_trained_end": "task0_trained"}


def bio_main(folders: list[Path]) -> None:
    """The biography benchmark's version: accuracies in points, the Task-0 model per seed as the base."""
    base = json.loads((folders[0] / "base_metrics.json").read_text())
    fft = next(p for p in points(folders[0]) if p["method"] == "fft" and not p["label"] and p["scale"] == 1.0)
    seeds = sorted(fft["seeds"])

    def gain(record: dict, seed: str) -> float:
        return record["learning"] - base[seed]["task1"]["overall"]

    def degradation(record: dict, seed: str, view: str) -> float:
        return base[seed][BIO_VIEWS[view]]["overall"] - record[view]

    head = ["point", "lr", "Task 1 %", *[f"{v} %" for v in BIO_VIEWS], "% of FFT's gain"]
    head += [f"% of FFT's {v} loss" for v in BIO_VIEWS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for folder in folders:
        for point in points(folder):
            if not all(s in point["seeds"] for s in seeds):
                continue
            runs, ref = [point["seeds"][s] for s in seeds], [fft["seeds"][s] for s in seeds]
            label = point["method"] + (f" ({point['label']})" if point["label"] else "") + f" [{folder.name}]"
            row = [label, f"{point['lr']:g}", spread([r["learning"] for r in runs], 100, 1)]
            row += [spread([r[v] for r in runs], 100, 1) for v in BIO_VIEWS]
            row.append(
                spread([share(gain(r, s), gain(f, s)) for r, f, s in zip(runs, ref, seeds, strict=True)], 100, 1)
            )
            row += [
                spread(
                    [
                        share(degradation(r, s, v), degradation(f, s, v))
                        for r, f, s in zip(runs, ref, seeds, strict=True)
                    ],
                    100,
                    1,
                )
                for v in BIO_VIEWS
            ]
            print("| " + " | ".join(row) + " |")
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
    fft = next(p for p in points(folders[0]) if p["method"] == "fft" and not p["label"] and p["scale"] == 1.0)
    seeds = sorted(fft["seeds"])

    def gain(record: dict) -> float:
        return new0 - math.log(record["learning"])

    def degradation(record: dict, name: str) -> float:
        return math.log(record[f"old/{name}"]) - old0[name]

    names = sorted(old0)
    head = ["point", "lr", "new-domain ppl", *[f"`{n}` ppl" for n in names], "% of FFT's gain"]
    head += [f"% of FFT's `{n}` degradation" for n in names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for folder in folders:
        for point in points(folder):
            runs = [point["seeds"][s] for s in seeds if s in point["seeds"]]
            if len(runs) < len(seeds):
                continue
            ref = [fft["seeds"][s] for s in seeds]
            label = point["method"] + (f" ({point['label']})" if point["label"] else "") + f" [{folder.name}]"
            row = [label, f"{point['lr']:g}", spread([r["learning"] for r in runs])]
            row += [spread([r[f"old/{n}"] for r in runs], digits=1) for n in names]
            row.append(spread([gain(r) / gain(f) for r, f in zip(runs, ref, strict=True)], 100, 1))
            row += [
                spread([degradation(r, n) / degradation(f, n) for r, f in zip(runs, ref, strict=True)], 100, 1)
                for n in names
            ]
            print("| " + " | ".join(row) + " |")
    print(
        f"\nbase model: new-domain ppl {base['learning_ppl']:,.0f}, "
        + ", ".join(f"`{n}` {ppl:.2f}" for n, ppl in sorted(base["forgetting_ppl"].items()))
        + f"; {len(seeds)} seeds ({', '.join(seeds)})"
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main([Path(arg) for arg in sys.argv[1:]])
