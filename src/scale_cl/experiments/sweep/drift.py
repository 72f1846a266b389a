"""Representation drift at each method's preset rate (paper Fig. 4a), mean over seeds with the spread as a band.

Drift is the mean cosine similarity of the final hidden states' original part with the base model's, on a
fixed old-domain batch (`scale_cl.eval.perplexity.final_hidden_original`); cpt records it at every
evaluation. A sweep has every method's run at its preset rate (x1) for every seed: that is the figure.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from scale_cl.files import atomic_write

KEY = "representation_similarity"


def drift_curves(experiment: Any, records: list[dict], out: Path) -> dict[str, list[list[dict]]]:
    """Per method, each seed's curve at the preset rate (the plain x1 point); methods whose curves lack drift are
    left out (bio measures none)."""
    from scale_cl.experiments.sweep.runner import SweepPoint

    found = {}
    for r in records:
        if r["label"] or r["scale"] != 1.0:
            continue
        key = SweepPoint(r["method"], r["lr"]).key
        curves = experiment.curves(r["method"], out / "points" / key)
        if curves and all(KEY in c[-1] for c in curves):
            found[r["method"]] = curves
    return found


def drift_table(curves: dict[str, list[list[dict]]]) -> list[dict[str, Any]]:
    """Per method: step, mean and population std over seeds of the similarity at each evaluation."""
    rows = []
    for method, runs in curves.items():
        steps = sorted(set.intersection(*({r["step"] for r in run} for run in runs)))
        for step in steps:
            values = [next(r[KEY] for r in run if r["step"] == step) for run in runs]
            rows.append(
                {"method": method, "step": step, "mean": statistics.fmean(values), "sd": statistics.pstdev(values)}
            )
    return rows


def drift_markdown(rows: list[dict[str, Any]]) -> str:
    """The similarity at the end of each method's run, mean ± spread over seeds."""
    last: dict[str, dict] = {}
    for row in rows:
        last[row["method"]] = row
    lines = [
        "## Representation drift at each method's preset rate (paper Fig. 4a)",
        "",
        "Mean cosine similarity of the final hidden states' original part with the base model's on a fixed "
        "old-domain batch, at the end of the run (mean ± population std over seeds; 1 = unchanged).",
        "",
        "| method | step | similarity |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {r['step']} | {r['mean']:.4f} ± {r['sd']:.4f} |" for m, r in last.items()]
    return "\n".join(lines) + "\n"


def plot_drift(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Similarity against step per method: the mean as a line, ± one std over seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        steps = [r["step"] for r in mine]
        mean = [r["mean"] for r in mine]
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=method)
        low = [r["mean"] - r["sd"] for r in mine]
        high = [r["mean"] + r["sd"] for r in mine]
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("cosine similarity with step 0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path
