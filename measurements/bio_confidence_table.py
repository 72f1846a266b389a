"""Issue 50's biography table: every reading of the routers at the end of Task 1, over the seeds, beside its oracle.

Reads the runs of ``scale-cl bio ... --methods fft scale_preserve [scale_route] --task1.likelihood_control`` (ROOT:
its ``--out``): FFT's two-model control (the Task-0 model and FFT's model mixed by each router) and SCALE's one-pass
readings (SCALE-Preserve's and SCALE-Route's models as trained and read with each router, at each alpha of
``task1.reading_alphas``). For every reading: hard first-token accuracy on Task 0's held-out and QA-trained people and
on Task 1 (%), the AUROC of Task-0 against Task-1 questions by the base's weight where the answer is predicted, the
base's mean weight (the share routed to the Task-0 expert) on Task-0 held-out and Task-1 questions, and the share of
the Task-0 model's held-out accuracy kept. The oracle of a pair is each cohort read by its own expert: the Task-0
model on Task 0 (the run's step 0), the trained expert on Task 1 (FFT's model, or SCALE's full output as trained:
for SCALE-Route its Eq.-5 output, a proxy, since its adapt path alone is not read).

Then SCALE-Route as trained along Task 1: the share of each split's answers Eq. 5 sends to the preserve path.

Usage: python measurements/bio_confidence_table.py ROOT [ROOT ...] (the seeds of every ROOT together)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

SETS = ("task0", "task0_trained", "task1")


def mean_spread(values: list[float]) -> str:
    """``mean ± population std`` (one decimal); a single value alone."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.pstdev(values):.1f}"


def reading_name(method: str, reading: dict) -> str:
    """A row's label: the method, its alpha where not 1, the router (or 'as trained', Eq. 5's route_exact)."""
    fit = f" ({reading['gate_fit']['objective']} fit)" if "gate_fit" in reading else ""
    if reading.get("control"):
        return f"control: Task-0 model + {method}, {reading['router']}{fit}"
    router = (reading.get("router") or ("route_exact" if reading.get("route_exact") else "as trained")) + fit
    alpha = reading.get("alpha", 1.0)
    return f"{method} one pass, {router}" + ("" if alpha == 1.0 else f", alpha {alpha:g}")


def rows_of(run: dict) -> list[tuple[str, dict, dict]]:
    """(label, the reading, the oracle's accuracies) of each reading of one run."""
    start = run["curve"][0]  # the Task-0 model before Task 1
    oracle = {"task0": start["task0"]["overall"], "task0_trained": start["task0_trained"]["overall"]}
    rows = []
    if "likelihood_control" in run:
        learned = run["curve"][-1]["task1"]["overall"]
        rows += [(reading_name(run["method"], r), r, {**oracle, "task1": learned}) for r in run["likelihood_control"]]
    # the new expert alone: SCALE-Preserve's full output at that alpha; for SCALE-Route its Eq.-5 output as trained
    # (its adapt path alone is not read), so Route's oracle is a proxy
    as_trained = {
        r.get("alpha", 1.0): r for r in run.get("readings", []) if "router" not in r and not r.get("route_exact")
    }
    for reading in run.get("readings", []):
        own = as_trained.get(reading.get("alpha", 1.0), run["curve"][-1])
        rows.append((reading_name(run["method"], reading), reading, {**oracle, "task1": own["task1"]["overall"]}))
    return rows


def run_files(*roots: Path) -> list[Path]:
    """Every seed's method result under each root (runs of other seeds, kept in separate folders, read together)."""
    return [path for root in roots for path in sorted(root.glob("seed-*/*.json"))]


def table(*roots: Path) -> str:
    cells: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in run_files(*roots):
        run = json.loads(path.read_text())
        if "curve" not in run:
            continue
        start_task0 = run["curve"][0]["task0"]["overall"]
        for label, reading, oracle in rows_of(run):
            cell = cells[label]
            for name in SETS:
                cell[name].append(100 * reading[name]["overall"])
                cell[f"oracle_{name}"].append(100 * oracle[name])
            cell["kept"].append(100 * reading["task0"]["overall"] / start_task0)
            router = reading.get("likelihood_router")
            if router:
                cell["auroc"].append(router["auroc"])
                cell["w_task0"].append(router["task0_base_weight"])
                cell["w_task1"].append(router["task1_base_weight"])
    header = (
        "| reading | seeds | Task 0 held-out | Task 0 QA-trained | Task 1 | % of the Task-0 model's held-out kept "
        "| AUROC | base weight on Task 0 / Task 1 | oracle (held-out / QA-trained / Task 1) |"
    )
    lines = [header, "|" + "---|" * 9]
    for label, cell in cells.items():
        auroc = "-"
        if cell["auroc"]:
            auroc = f"{statistics.fmean(cell['auroc']):.3f}"
            if len(cell["auroc"]) > 1:
                auroc += f" ({min(cell['auroc']):.2f}-{max(cell['auroc']):.2f})"
        weights = (
            f"{statistics.fmean(cell['w_task0']):.2f} / {statistics.fmean(cell['w_task1']):.2f}"
            if cell["w_task0"]
            else "-"
        )
        oracle = " / ".join(mean_spread(cell[f"oracle_{name}"]) for name in SETS)
        lines.append(
            f"| {label} | {len(cell['task1'])} | "
            + " | ".join(mean_spread(cell[name]) for name in SETS)
            + f" | {mean_spread(cell['kept'])} | {auroc} | {weights} | {oracle} |"
        )
    return "\n".join(lines)


def eq5_table(*roots: Path, steps: tuple[int, ...] = (0, 10, 20, 50, 100, 200)) -> str:
    """SCALE-Route as trained (Eq. 5) along Task 1 (at ``steps`` and its last step): the share of each split's answers
    it sends to the preserve path and the AUROC of that decision (Task 0 held-out against Task 1), beside the
    accuracies; means over the seeds."""
    cells: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in run_files(*roots):
        run = json.loads(path.read_text())
        if run.get("method") != "scale_route":
            continue
        last = run["curve"][-1]["step"]
        for record in run["curve"]:
            if (record["step"] in steps or record["step"] == last) and "eq5_routing" in record:
                cell, routing = cells[record["step"]], record["eq5_routing"]
                for name in SETS:
                    cell[name].append(100 * record[name]["overall"])
                    cell[f"share_{name}"].append(routing[f"{name}_base_weight"])
                cell["auroc"].append(routing["auroc"])
    lines = [
        "| step | seeds | to the preserve path: Task 0 held-out / QA-trained / Task 1 | AUROC | Task 0 held-out | "
        "Task 0 QA-trained | Task 1 |",
        "|" + "---|" * 7,
    ]
    for step in sorted(cells):
        cell = cells[step]
        shares = " / ".join(f"{statistics.fmean(cell[f'share_{name}']):.2f}" for name in SETS)
        accuracies = " | ".join(mean_spread(cell[name]) for name in SETS)
        auroc = statistics.fmean(cell["auroc"])
        lines.append(f"| {step} | {len(cell['auroc'])} | {shares} | {auroc:.3f} | {accuracies} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", type=Path, nargs="+", help="the --out folders of the scale-cl bio runs")
    roots = parser.parse_args().roots
    print(table(*roots))
    print()
    print(eq5_table(*roots))


if __name__ == "__main__":
    main()
