"""The biography benchmark's outputs: results.json, results.md and a figure like the paper's Fig. 8 (a sequence of
tasks: its accuracy matrices and metrics, `sequence_report`)."""

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
from scale_cl.experiments.bio.sequence_report import plot_matrices, plot_sequence, sequence_markdown, sequence_summary
from scale_cl.experiments.method_run import GATE_RECIPE
from scale_cl.files import atomic_write, write_json, write_text


def result_path(out: Path, seed: int, method: str) -> Path:
    """Where a run into ``out`` writes ``method``'s result at ``seed`` (its presence means "finished")."""
    return Path(out) / f"seed-{seed}" / f"{method}.json"


def machine(device: str = "auto") -> dict[str, Any]:
    """The machine the results came from; ``device``: the runs' ``device`` setting (a GPU is named where they ran on
    one, the CPU where ``cpu`` kept them off the GPU)."""
    cuda = device != "cpu" and torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


# The Task-0 views: the paper's (held-out people, knowledge extracted from the biographies) and the
# QA-trained people's (memorised QA).
TASK0_VIEWS = {"task0": "Task 0 held-out", "task0_trained": "Task 0 QA-trained"}


def _summary(curve: list[dict]) -> dict[str, float]:
    """Start, minimum and end of each Task-0 view, and Task 1 at the end."""
    summary: dict[str, float] = {}
    for view in TASK0_VIEWS:
        values = [record[view]["overall"] for record in curve]
        summary.update({f"{view}_start": values[0], f"{view}_min": min(values), f"{view}_end": values[-1]})
    summary["task1_end"] = curve[-1]["task1"]["overall"]
    return summary


def _mean_spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


SHOWN_READING = "calibrated"  # the one-pass reading the figure shows beside the methods as trained


def one_pass_readings(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Each mixing router's reading of the trained models at alpha 1 (``readings`` of a SCALE-Route or SCALE-Preserve
    run, training nothing), over the seeds that have it: each view's accuracy, the Task-0 held-out share kept."""
    found: dict[str, list[dict]] = {}
    for run in runs:
        for reading in run.get("readings", []):
            if reading.get("router") and reading.get("alpha", 1.0) == 1.0 and not reading.get("control"):
                objective = reading.get("gate_fit", {}).get("objective", GATE_RECIPE.objective)  # another: apart
                name = reading["router"] + ("" if objective == GATE_RECIPE.objective else f" ({objective} fit)")
                found.setdefault(name, []).append({**reading, "start": run["curve"][0]})
    summary = {}
    for router, readings in found.items():
        if len(readings) != len(runs):
            continue
        each = {view: [r[view]["overall"] for r in readings] for view in (*TASK0_VIEWS, "task1")}
        kept = _mean_spread([r["task0"]["overall"] / max(r["start"]["task0"]["overall"], 1e-9) for r in readings])
        summary[router] = {**{view: _mean_spread(v) for view, v in each.items()}, "task0_kept": kept, "each": each}
    return summary


def collect(cfg: BioConfig, out: Path) -> dict[str, Any]:
    """Gather every finished method/seed result under ``out`` into one summary."""
    methods: dict[str, Any] = {}
    for method in cfg.methods:
        runs = [
            json.loads(path.read_text()) for seed in cfg.seeds if (path := result_path(out, seed, method)).is_file()
        ]
        if not runs:
            continue
        summaries = [_summary(run["curve"]) for run in runs]
        sequence = {"sequence": sequence_summary(runs)} if "matrix" in runs[0] else {}
        methods[method] = {
            **sequence,
            "seeds": [run["seed"] for run in runs],
            "lr": runs[0]["lr"],
            "trainable": runs[0]["trainable"],
            "seconds": _mean_spread([run["seconds"] for run in runs]),
            **{key: _mean_spread([s[key] for s in summaries]) for key in summaries[0]},
            **({"one_pass": readings} if (readings := one_pass_readings(runs)) else {}),
            "runs": runs,
        }
    stages = {
        str(seed): json.loads(path.read_text())
        for seed in cfg.seeds
        if (path := out / f"seed-{seed}" / "stages.json").is_file()
    }
    return {"config": cfg.to_dict(), "machine": machine(cfg.task1.device), "stages": stages, "methods": methods}


def stages_markdown(stages: dict[str, Any]) -> str:
    """One line on what the models knew before Task 1 (mean ± spread over seeds)."""
    if not stages:
        return ""

    def cell(stage: str, view: str) -> str:
        return _cell(_mean_spread([s[stage][view]["overall"] for s in stages.values()]))

    return (
        f"Before Task 1: the pre-trained model completes {cell('pretrained', 'completion')}% of the held-out "
        f"Task-0 people's facts in a sentence of their biographies (what pre-training stored); the "
        f"Task-0 model answers {cell('task0_model', 'task0')}% of their questions (what QA extracts) and "
        f"{cell('task0_model', 'task0_trained')}% of the QA-trained people's; it completes "
        f"{cell('task0_model', 'completion')}% of the biography facts.\n"
    )


def _cell(stat: dict[str, float], percent: bool = True) -> str:
    scale = 100 if percent else 1
    if stat["std"]:
        return f"{scale * stat['mean']:.1f} ± {scale * stat['std']:.1f}"
    return f"{scale * stat['mean']:.1f}"


def results_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    methods = results["methods"]
    header = [f"{label} {part} %" for label in TASK0_VIEWS.values() for part in ("start", "min", "end")]
    lines = [
        "| method | " + " | ".join(header) + " | Task 1 end % | trainable params | lr | wall s |",
        "|---" * (len(header) + 5) + "|",
    ]
    for name, r in methods.items():
        cells = [_cell(r[f"{v}_{part}"]) for v in TASK0_VIEWS for part in ("start", "min", "end")]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {_cell(r['task1_end'])} | {r['trainable']:,} | {r['lr']:g} | "
            f"{_cell(r['seconds'], percent=False)} |"
        )
    attributes = results["config"]["data"]["attributes"]
    lines += ["", "Task 0 (held-out people) at the end, per attribute (%, mean over seeds):", ""]
    lines.append("| method | " + " | ".join(attributes) + " |")
    lines.append("|---" * (len(attributes) + 1) + "|")
    for name, r in methods.items():
        ends = [run["curve"][-1]["task0"] for run in r["runs"]]
        cells = [f"{100 * statistics.fmean(end[a] for end in ends):.1f}" for a in attributes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    read = {name: r["one_pass"] for name, r in methods.items() if r.get("one_pass")}
    if read:
        lines += [
            "",
            "The same trained models read in one pass by each mixing router, training nothing (SCALE's Task-0 "
            "expert is the Task-0 model exactly; the calibrated router's gate is fitted on Task 1's training "
            "questions against the Task-0 model's own text, no Task-0 data), at the end of Task 1 (%):",
            "",
            "| method, reading | Task 0 held-out | Task 0 QA-trained | Task 1 | % of Task 0's held-out kept |",
            "|---|---|---|---|---|",
        ]
        for name, routers in read.items():
            for router, r in routers.items():
                cells = [_cell(r[view]) for view in (*TASK0_VIEWS, "task1")]
                lines.append(f"| {name}, {router} router | " + " | ".join(cells) + f" | {_cell(r['task0_kept'])} |")
    seeds = sorted({s for r in methods.values() for s in r["seeds"]})
    sequence = sequence_markdown(methods)
    if sequence:
        lines += ["", sequence.rstrip()]
    if results.get("stages"):
        lines += ["", stages_markdown(results["stages"]).rstrip()]
    lines.append("")
    lines.append(
        "Hard first-token accuracy. Task 0 held-out: people whose QA was never trained (the paper's view); "
        "QA-trained: Task 0's people whose QA was trained in stage 2"
        + (
            f" (with replay, {results['config']['task1']['replay_ratio']:.0%} of every Task-1 batch is their "
            "training questions: that view then reads replayed questions, not forgetting). "
            if results["config"]["task1"].get("replay_ratio")
            else ". "
        )
        + f"Mean ± spread (population std) over seeds {seeds}. "
        f"Preset `{results['config']['preset']}`, {m['device']}, torch {m['torch']}, {m['date']}."
    )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Each Task-0 view and Task 1 against Task-1 step, one line per method (mean over seeds, band: min-max).

    The x-axis is linear over the early evaluation schedule and logarithmic after it (symlog), so
    the early collapse stays visible in a long run; every evaluation is marked.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    panels = [*TASK0_VIEWS, "task1"]
    titles = {**{v: f"{label} (forgetting)" for v, label in TASK0_VIEWS.items()}, "task1": "Task 1 (learning)"}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharex=True, sharey=True)
    last_step = 0
    for name, r in methods.items():
        steps = [record["step"] for record in r["runs"][0]["curve"]]
        last_step = max(last_step, steps[-1])
        for ax, task in zip(axes, panels, strict=True):
            curves = [[rec[task]["overall"] * 100 for rec in run["curve"]] for run in r["runs"]]
            width = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(width)]
            (line,) = ax.plot(steps[:width], mean, label=name, marker=".", markersize=3)
            if len(curves) > 1:
                low = [min(c[i] for c in curves) for i in range(width)]
                high = [max(c[i] for c in curves) for i in range(width)]
                ax.fill_between(steps[:width], low, high, color=line.get_color(), alpha=0.15)
        reading = r.get("one_pass", {}).get(SHOWN_READING)
        if reading is not None:  # the same trained model read in one pass: a point at its last step
            for ax, task in zip(axes, panels, strict=True):
                each = [100 * value for value in reading["each"][task]]
                mean = statistics.fmean(each)
                ax.errorbar(
                    [steps[-1]],
                    [mean],
                    yerr=[[mean - min(each)], [max(each) - mean]],
                    marker="*",
                    markersize=11,
                    linestyle="none",
                    color=line.get_color(),
                    markeredgecolor="black",
                    label=f"{name}, one pass ({SHOWN_READING} reading)",
                )
    task1 = results["config"]["task1"]
    early = task1.get("early_eval_until", 0) if task1.get("early_eval_every", 0) else 0
    for ax, panel in zip(axes, panels, strict=True):
        label = "Task 1 training step"
        if early and last_step > 2 * early:
            ax.set_xscale("symlog", linthresh=early, linscale=2)
            ax.axvline(early, color="grey", linewidth=0.5, linestyle=":")
            label += f" (linear to {early}, log after)"
        ax.set_title(titles[panel])
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hard first-token accuracy (%)")
    axes[-1].legend(loc="best", fontsize="small")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def figures(results: dict[str, Any]) -> list[str]:
    """The figures `write_report` draws: accuracy.png, or for a sequence of tasks matrix.png and sequence.png."""
    if not results["methods"]:
        return []
    return ["matrix.png", "sequence.png"] if results["config"]["sequence"]["tasks"] > 1 else ["accuracy.png"]


def write_report(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and (with any finished method) the `figures`, each written atomically."""
    write_json(out / "results.json", results)
    write_text(out / "results.md", results_markdown(results))
    draw = {"accuracy.png": plot, "matrix.png": plot_matrices, "sequence.png": plot_sequence}
    for name in figures(results):
        draw[name](results if name == "accuracy.png" else results["methods"], out / name)
