"""The biography benchmark's outputs: results.json, results.md and a figure like the paper's Fig. 8."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from scale_cl.experiments.bio.config import BioConfig
from scale_cl.files import atomic_write, write_json, write_text


def machine() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def _summary(curve: list[dict]) -> dict[str, float]:
    task0 = [record["task0"]["overall"] for record in curve]
    return {
        "task0_start": task0[0],
        "task0_min": min(task0),
        "task0_end": task0[-1],
        "task1_end": curve[-1]["task1"]["overall"],
    }


def _mean_spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def collect(cfg: BioConfig, out: Path) -> dict[str, Any]:
    """Gather every finished method/seed result under ``out`` into one summary."""
    methods: dict[str, Any] = {}
    for method in cfg.methods:
        runs = [
            json.loads(path.read_text())
            for seed in cfg.seeds
            if (path := out / f"seed-{seed}" / f"{method}.json").is_file()
        ]
        if not runs:
            continue
        summaries = [_summary(run["curve"]) for run in runs]
        methods[method] = {
            "seeds": [run["seed"] for run in runs],
            "lr": runs[0]["lr"],
            "trainable": runs[0]["trainable"],
            "seconds": _mean_spread([run["seconds"] for run in runs]),
            **{key: _mean_spread([s[key] for s in summaries]) for key in summaries[0]},
            "runs": runs,
        }
    return {"config": cfg.to_dict(), "machine": machine(), "methods": methods}


def _cell(stat: dict[str, float], percent: bool = True) -> str:
    scale = 100 if percent else 1
    if stat["std"]:
        return f"{scale * stat['mean']:.1f} ± {scale * stat['std']:.1f}"
    return f"{scale * stat['mean']:.1f}"


def results_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "| method | Task 0 start % | Task 0 min % | Task 0 end % | Task 1 end % | trainable params | lr | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["methods"].items():
        lines.append(
            f"| {name} | {_cell(r['task0_start'])} | {_cell(r['task0_min'])} | {_cell(r['task0_end'])} | "
            f"{_cell(r['task1_end'])} | {r['trainable']:,} | {r['lr']:g} | {_cell(r['seconds'], percent=False)} |"
        )
    attributes = results["config"]["data"]["attributes"]
    lines += ["", "Task 0 at the end, per attribute (%, mean over seeds):", ""]
    lines.append("| method | " + " | ".join(attributes) + " |")
    lines.append("|---" * (len(attributes) + 1) + "|")
    for name, r in results["methods"].items():
        ends = [run["curve"][-1]["task0"] for run in r["runs"]]
        cells = [f"{100 * statistics.fmean(end[a] for end in ends):.1f}" for a in attributes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    seeds = sorted({s for r in results["methods"].values() for s in r["seeds"]})
    lines.append("")
    lines.append(
        f"Hard first-token accuracy; mean ± spread (population std) over seeds {seeds}. "
        f"Preset `{results['config']['preset']}`, {m['device']}, torch {m['torch']}, {m['date']}."
    )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Task 0 and Task 1 accuracy against Task-1 step, one line per method (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True, sharey=True)
    for name, r in results["methods"].items():
        steps = [record["step"] for record in r["runs"][0]["curve"]]
        for ax, task in zip(axes, ("task0", "task1"), strict=True):
            curves = [[rec[task]["overall"] * 100 for rec in run["curve"]] for run in r["runs"]]
            width = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(width)]
            (line,) = ax.plot(steps[:width], mean, label=name)
            if len(curves) > 1:
                low = [min(c[i] for c in curves) for i in range(width)]
                high = [max(c[i] for c in curves) for i in range(width)]
                ax.fill_between(steps[:width], low, high, color=line.get_color(), alpha=0.15)
    for ax, title in zip(axes, ("Task 0 (forgetting)", "Task 1 (learning)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("Task 1 training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hard first-token accuracy (%)")
    axes[1].legend(loc="best", fontsize="small")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def write_report(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and (with any finished method) accuracy.png, each written atomically."""
    write_json(out / "results.json", results)
    write_text(out / "results.md", results_markdown(results))
    if results["methods"]:
        plot(results, out / "accuracy.png")
