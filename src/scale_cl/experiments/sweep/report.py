"""A sweep's outputs: the landscape figure, the matched-learning and single-rate tables, the ablation figures, and
(cpt) the representation drift at the preset rates."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

from scale_cl.experiments.sweep.drift import drift_curves, drift_markdown, drift_table, plot_drift
from scale_cl.experiments.sweep.landscape import (
    Panel,
    Point,
    default_target,
    format_value,
    matched_forgetting,
    matched_markdown,
    matched_table,
    plot_ablation,
    plot_landscape,
    seed_spread,
    single_rate_markdown,
)
from scale_cl.experiments.sweep.runner import SweepResult, SweepSettings, stored_overrides
from scale_cl.files import write_json, write_text


def _spread(record: dict, key: str) -> float:
    """Population std over the record's seeds of one metric (0 with one seed)."""
    seeds = record.get("seeds") or {}
    return statistics.pstdev(m[key] for m in seeds.values()) if len(seeds) > 1 else 0.0


def _points(records: list[dict], key: str) -> list[Point]:
    return [
        Point(
            r["method"],
            r["lr"],
            r["metrics"]["learning"],
            r["metrics"][key],
            r["label"],
            _spread(r, "learning"),
            _spread(r, key),
        )
        for r in records
    ]


def seed_targets(settings: SweepSettings, result: SweepResult, target: float) -> dict[str, float]:
    """Each seed's own learning level to read its sweep at.

    With the reference's learning as the target, a seed is read at its own reference run's level (the
    reference at the rate the target was taken from, in that seed): paired, so the reference reads
    exactly its own forgetting in every seed and the spread is not inflated by how much the seeds
    learn. A given ``--target`` is the same level for every seed.
    """
    plain = _plain(result.points)
    seeds = sorted({seed for r in plain for seed in r.get("seeds") or {}}, key=int)
    if settings.target is None:
        at_target = (r for r in plain if r["method"] == settings.reference and r["metrics"]["learning"] == target)
        reference = next(at_target, {})
        own = reference.get("seeds") or {}
        if all(seed in own for seed in seeds):
            return {seed: own[seed]["learning"] for seed in seeds}
    return dict.fromkeys(seeds, target)


def seed_readings(
    experiment: Any, result: SweepResult, targets: dict[str, float]
) -> dict[tuple[str, str], list[float | None]]:
    """Per (panel title, method), the matched-learning reading taken off each seed's own sweep at that seed's
    target (`seed_targets`; None where that seed's sweep does not reach it): the spread behind the table's
    reading of the seeds' means."""
    plain = _plain(result.points)
    return {
        (spec.title, method): _per_seed_matched(experiment, spec, [r for r in plain if r["method"] == method], targets)
        for spec in experiment.panels
        for method in experiment.cfg.methods
    }


def _per_seed_matched(experiment: Any, spec: Any, records: list[dict], targets: dict[str, float]) -> list[float | None]:
    """One method's matched-learning reading off each seed's own runs (``records``: that method's points of one
    setting), at that seed's target; None where the seed does not reach it."""
    values: list[float | None] = []
    for seed, target in targets.items():
        points = [
            Point(r["method"], r["lr"], r["seeds"][seed]["learning"], r["seeds"][seed][spec.key])
            for r in records
            if seed in (r.get("seeds") or {})
        ]
        if points:
            values.append(matched_forgetting(points, target, experiment.learning, spec.metric).forgetting)
    return values


def _plain(records: list[dict]) -> list[dict]:
    return [r for r in records if not r["overrides"]]


def target_level(experiment: Any, settings: SweepSettings, result: SweepResult) -> tuple[float, str]:
    """``settings.target``, or the learning the reference method reaches at its preset rate; and where it came from."""
    if settings.target is not None:
        return settings.target, f"given (--target {settings.target:g})"
    plain = _points(_plain(result.points), experiment.panels[0].key)
    by_method = {m: [p for p in plain if p.method == m] for m in {p.method for p in plain}}
    lr = getattr(experiment.cfg, experiment.rates_section).lr_of(settings.reference)
    target = default_target(by_method, settings.reference, lr, experiment.learning)
    used = next(p.lr for p in by_method[settings.reference] if p.learning == target)
    if math.isclose(used, lr, rel_tol=1e-9):
        return target, f"{settings.reference} at its preset rate {lr:g}"
    return target, f"{settings.reference} at lr {used:g}, the swept rate nearest its preset {lr:g}"


def panels(experiment: Any, result: SweepResult, target: float) -> list[Panel]:
    """One landscape panel per forgetting view, from the plain sweep's runs (ablation runs have their own figures)."""
    plain = _plain(result.points)
    return [
        Panel(
            spec.title,
            experiment.learning,
            spec.metric,
            tuple(_points(plain, spec.key)),
            (result.base["learning"], result.base[spec.key]),
            target,
        )
        for spec in experiment.panels
    ]


def ablation(
    experiment: Any, settings: SweepSettings, result: SweepResult, target: float, targets: dict[str, float]
) -> list[dict[str, Any]]:
    """Per axis, per forgetting view and method: learning and forgetting at the preset rate and at matched learning,
    with the matched reading taken off each seed's own runs too (at ``targets``, as `seed_readings`)."""
    tables = []
    for axis in settings.axes:
        for spec in experiment.panels:
            cells: dict[str, dict[str, tuple[float, float, float | None, float, float, list[float | None]]]] = {}
            status: dict[str, dict[str, str]] = {}
            for method in axis.methods(experiment.cfg.methods):
                for value in axis.values:
                    wanted = stored_overrides(axis.overrides(experiment.cfg, value))
                    records = [r for r in result.points if r["method"] == method and r["overrides"] == wanted]
                    if not records:
                        continue
                    points = _points(records, spec.key)
                    preset = min(records, key=lambda r: abs(math.log(r["scale"])))
                    matched = matched_forgetting(points, target, experiment.learning, spec.metric)
                    cells.setdefault(method, {})[str(value)] = (
                        preset["metrics"]["learning"],
                        preset["metrics"][spec.key],
                        matched.forgetting,
                        _spread(preset, "learning"),
                        _spread(preset, spec.key),
                        _per_seed_matched(experiment, spec, records, targets),
                    )
                    status.setdefault(method, {})[value] = matched.status + (" †" if matched.open_below else "")
            tables.append(
                {
                    "axis": axis.setting,
                    "name": axis.name,
                    "panel": spec.key,
                    "values": list(axis.values),
                    "scale": min(settings.lr_scales, key=lambda x: abs(math.log(x))),
                    "cells": cells,
                    "status": status,
                }
            )
    return tables


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text).strip("-")


def _with_spread(name: str, value: float, spread: float) -> str:
    return format_value(name, value) + (f" ± {format_value(name, spread)}" if spread > 0 else "")


def _ablation_markdown(table: dict[str, Any], experiment: Any, spec: Any) -> str:
    learning, forgetting = experiment.learning.name, spec.metric.name
    lines = [
        f"### Ablation: {table['axis']} ({spec.title})",
        "",
        f"Each cell: {learning} / {forgetting} at the swept rate nearest the method's preset "
        f"(x{table['scale']:g}; ± the population std over seeds, with several); {forgetting} at matched learning "
        "(± the spread of the same reading off each seed's own runs; 'k/n seeds' where not all reach it).",
        "",
        "| method | " + " | ".join(table["values"]) + " |",
        "|---|" + "---|" * len(table["values"]),
    ]
    for method, cells in table["cells"].items():
        row = []
        for value in table["values"]:
            if value not in cells:
                row.append("—")
                continue
            learn, forget, matched, learn_sd, forget_sd, per_seed = cells[value]
            state = table["status"][method][value]
            at_target = state
            if matched is not None:
                at_target = format_value(forgetting, matched) + seed_spread(per_seed, forgetting)
                at_target += state.removeprefix("ok")
            at_rate = f"{_with_spread(learning, learn, learn_sd)} / {_with_spread(forgetting, forget, forget_sd)}"
            row.append(f"{at_rate}; {at_target}")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_report(experiment: Any, settings: SweepSettings, result: SweepResult, out: Path) -> dict[str, Any]:
    """results.md, results.json, landscape.png and one ablation figure per axis and forgetting view."""
    from scale_cl.experiments.bio.report import machine

    target, reference = target_level(experiment, settings, result)
    views = panels(experiment, result, target)
    methods = list(experiment.cfg.methods)
    rows = matched_table(views, methods)
    targets = seed_targets(settings, result, target)
    spread = seed_readings(experiment, result, targets)
    for row in rows:
        row["seed_forgetting"] = spread.get((row["panel"], row["method"]), [])
    section = getattr(experiment.cfg, experiment.rates_section)
    presets = {m: section.lr_of(m) for m in methods}
    ablations = ablation(experiment, settings, result, target, targets)
    plot_landscape(views, out / "landscape.png", f"{experiment.name}: stability-plasticity landscape")
    specs = {spec.key: spec for spec in experiment.panels}
    figures = ["landscape.png"]
    for table in ablations:
        name = f"ablation-{_slug(table['name'])}-{_slug(table['panel'])}.png"
        spec = specs[table["panel"]]
        plot_ablation(table["axis"], table["values"], table["cells"], experiment.learning, spec.metric, out / name)
        figures.append(name)
    drift = drift_table(drift_curves(experiment, result.points, out))
    if drift:
        plot_drift(drift, out / "drift.png", f"{experiment.name}: representation drift at the preset rates")
        figures.append("drift.png")
    info = machine(section.device)  # the runs' device setting (the learning-rate section is the trained stage)
    text = [
        f"# Sweep: {experiment.name} ({experiment.cfg.preset} preset)",
        "",
        f"Command: `scale-cl {' '.join(sys.argv[1:])}`" if sys.argv[1:] else "",
        f"Machine: {info['device']}, torch {info['torch']}, {info['date']}. "
        f"Learning-rate scales: {', '.join(f'x{s:g}' for s in settings.lr_scales)} of each method's preset rate"
        + "".join(
            f"; {method} also {', '.join(f'x{s:g}' for s in scales)}"
            for method, scales in settings.method_lr_scales.items()
        )
        + ".",
        "",
        f"## Matched learning: {experiment.learning.name} = {format_value(experiment.learning.name, target)}",
        "",
        f"Target: {reference}. Base model: {experiment.learning.name} "
        f"{format_value(experiment.learning.name, result.base['learning'])}.",
        "",
        matched_markdown(rows),
        "## At each method's preset rate (paper-style)",
        "",
        single_rate_markdown(views, presets),
        *(_ablation_markdown(t, experiment, specs[t["panel"]]) for t in ablations),
        *([drift_markdown(drift)] if drift else []),
        "Figures: " + ", ".join(figures),
        "",
    ]
    report = {
        "experiment": experiment.name,
        "config": experiment.cfg.to_dict(),
        "seeds": experiment.seeds,
        "sweep": {
            "lr_scales": list(settings.lr_scales),
            "method_lr_scales": {m: list(s) for m, s in settings.method_lr_scales.items()},
            "axes": [{"setting": a.setting, "values": list(a.values)} for a in settings.axes],
            "reference": settings.reference,
            "target": settings.target,
        },
        "machine": info,
        "target": target,
        "base": result.base,
        "matched": rows,
        "ablations": ablations,
        "drift": drift,
        "points": result.points,
    }
    write_text(out / "results.md", "\n".join(text))
    write_json(out / "results.json", report)
    return report
