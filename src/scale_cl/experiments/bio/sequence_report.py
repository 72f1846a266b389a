"""A task sequence's report (``--sequence.tasks T``): the accuracy matrix per method, ACC/BWT/FWT/forgetting, a
heatmap of each matrix (``matrix.png``) and each task's accuracy along the whole sequence (``sequence.png``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from scale_cl.eval.continual import continual_metrics
from scale_cl.files import atomic_write

METRICS = {
    "la": "LA (learning)",
    "acc": "ACC",
    "bwt": "BWT",
    "fwt": "FWT",
    "forgetting": "forgetting",
    "max_forgetting": "max forgetting",
}


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def sequence_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's runs (one per seed): the mean matrix, each metric's mean and spread over seeds (each seed's
    metrics from its own matrix), the parameters after each task and the growth strategy."""
    summary = {
        "tasks": runs[0]["tasks"],
        "growth": runs[0]["growth"],
        **_matrix_summary([run["matrix"] for run in runs]),
        "parameters": runs[0]["parameters"],
    }
    if all("control" in run for run in runs):  # the Task-0 model and each task's model, mixed (likelihood_control)
        summary["control"] = _matrix_summary([run["control"]["matrix"] for run in runs])
    return summary


def _matrix_summary(matrices: list[list[list[float]]]) -> dict[str, Any]:
    """The seeds' mean matrix, each metric's mean and spread (each seed's from its own matrix), forgetting per task."""
    size = len(matrices[0])
    mean = [[statistics.fmean(m[i][j] for m in matrices) for j in range(size)] for i in range(size)]
    per_seed = [continual_metrics(m) for m in matrices]
    return {
        "matrix": mean,
        "metrics": {key: _spread([metrics[key] for metrics in per_seed]) for key in METRICS},
        "forgetting_per_task": [
            statistics.fmean(metrics["forgetting_per_task"][j] for metrics in per_seed) for j in range(size - 1)
        ],
    }


def _cell(stat: dict[str, float]) -> str:
    text = f"{100 * stat['mean']:+.1f}" if stat["mean"] < 0 else f"{100 * stat['mean']:.1f}"
    return f"{text} ± {100 * stat['std']:.1f}" if stat["std"] else text


def sequence_markdown(methods: dict[str, Any]) -> str:
    """The metrics of every method side by side, then each method's mean accuracy matrix (%)."""
    sequences = {name: r["sequence"] for name, r in methods.items() if "sequence" in r}
    if not sequences:
        return ""
    tasks = next(iter(sequences.values()))["tasks"]
    lines = [
        f"A sequence of {tasks} new-people tasks after Task 0. Accuracy matrix R[i][j]: accuracy on task j after "
        "task i (row 0: before Task 1; column 0: Task 0's held-out people). LA: mean of R[j][j] (each task just "
        "after it was trained: how much a method learns); ACC: the final row's mean; BWT: mean "
        "of R[T][j] - R[j][j] over j < T; FWT: mean of R[j-1][j] - R[0][j]; forgetting: mean (and largest) over "
        "j < T of the best R[l][j] (l >= j) less R[T][j]. In points of accuracy (%), mean ± spread over seeds.",
        "",
        "| method | growth | " + " | ".join(METRICS.values()) + " | parameters after the last task |",
        "|---" * (len(METRICS) + 3) + "|",
    ]
    for name, s in sequences.items():
        cells = [_cell(s["metrics"][key]) for key in METRICS]
        params = s["parameters"][-1]
        lines.append(
            f"| {name} | {s['growth']} | " + " | ".join(cells) + f" | {params['total']:,} "
            f"({params['trainable']:,} trainable) |"
        )
        if "control" in s:  # kept apart and mixed by the likelihood router: every model's parameters and pass
            cells = [_cell(s["control"]["metrics"][key]) for key in METRICS]
            models = len(s["control"]["matrix"])
            lines.append(
                f"| {name} + the Task-0 model and each task's model, mixed (control) | kept apart | "
                + " | ".join(cells)
                + f" | {models} models x {params['total']:,} |"
            )
    lines += [
        "",
        f"Cost at Task 1 and at Task {tasks} (the model each trains; FLOPs per token counted on one 64-token "
        "sequence, a training step's forward and backward and inference's forward):",
        "",
        "| method | growth | parameters | trainable | training MFLOPs/token | inference MFLOPs/token |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in sequences.items():
        cells = [_first_to_last(s["parameters"], key) for key in ("total", "trainable")]
        cells += [
            _first_to_last(s["parameters"], key, 1e6) for key in ("train_flops_per_token", "inference_flops_per_token")
        ]
        lines.append(f"| {name} | {s['growth']} | " + " | ".join(cells) + " |")
    for name, s in sequences.items():
        header = ["Task 0", *(f"Task {j}" for j in range(1, tasks + 1))]
        lines += ["", f"{name} (growth: {s['growth']}):", "", "| after | " + " | ".join(header) + " |"]
        lines.append("|---" * (len(header) + 1) + "|")
        for i, row in enumerate(s["matrix"]):
            label = "Task 0 (start)" if i == 0 else f"Task {i}"
            lines.append(f"| {label} | " + " | ".join(f"{100 * v:.1f}" for v in row) + " |")
    return "\n".join(lines) + "\n"


def _first_to_last(costs: list[dict[str, Any]], key: str, unit: float | None = None) -> str:
    """``first -> last`` of one cost over the sequence: counts whole, FLOPs in ``unit``s with two decimals."""
    first, last = costs[0][key], costs[-1][key]
    return f"{first:,} -> {last:,}" if unit is None else f"{first / unit:,.2f} -> {last / unit:,.2f}"


def plot_matrices(methods: dict[str, Any], path: Path) -> None:
    """A heatmap of each method's mean accuracy matrix, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sequences = {name: r["sequence"] for name, r in methods.items() if "sequence" in r}
    fig, axes = plt.subplots(1, len(sequences), figsize=(3.6 * len(sequences), 3.4), squeeze=False)
    for ax, (name, s) in zip(axes[0], sequences.items(), strict=True):
        matrix = [[100 * v for v in row] for row in s["matrix"]]
        image = ax.imshow(matrix, vmin=0, vmax=100, cmap="viridis")
        for i, row in enumerate(matrix):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7, color="w" if value < 60 else "k")
        ax.set_title(f"{name} ({s['growth']})", fontsize=9)
        ax.set_xlabel("evaluated on task")
        ax.set_ylabel("after training task")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy (%)")
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def plot_sequence(methods: dict[str, Any], path: Path) -> None:
    """Each task's accuracy along the whole sequence (one panel per task, one line per method, mean over seeds);
    dotted lines mark where each task starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: r["runs"] for name, r in methods.items() if "sequence" in r}
    tasks = next(iter(runs.values()))[0]["tasks"]
    panels = ["task0", *(f"task{j}" for j in range(1, tasks + 1))]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), sharey=True)
    for name, method_runs in runs.items():
        curve = method_runs[0]["curve"]
        steps = [record["step"] for record in curve]
        for ax, task in zip(axes, panels, strict=True):
            width = min(len(run["curve"]) for run in method_runs)
            mean = [
                statistics.fmean(run["curve"][i][task]["overall"] * 100 for run in method_runs) for i in range(width)
            ]
            ax.plot(steps[:width], mean, label=name, linewidth=1)
    starts = [record["step"] for record in next(iter(runs.values()))[0]["curve"] if record["task_step"] == 0]
    for ax, task in zip(axes, panels, strict=True):
        for start in starts[1:]:
            ax.axvline(start, color="grey", linewidth=0.5, linestyle=":")
        ax.set_title("Task 0 held-out" if task == "task0" else f"Task {task.removeprefix('task')}", fontsize=9)
        ax.set_xlabel("training step (all tasks)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hard first-token accuracy (%)")
    axes[-1].legend(loc="best", fontsize="x-small")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


__all__ = ["plot_matrices", "plot_sequence", "sequence_markdown", "sequence_summary"]
