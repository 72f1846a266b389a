"""The stability-plasticity landscape of a learning-rate sweep (paper Fig. 2), read at matched learning.

Each run of a sweep is one `Point`: a method at a learning rate, with how much it learned (the learning metric,
e.g. held-out new-domain perplexity or Task-1 accuracy) and how much it forgot (the forgetting metric). A method
that learns less also forgets less, so methods are compared at MATCHED LEARNING: `matched_forgetting` reads a
method's forgetting off its sweep at a target learning level, interpolating between rates in log learning rate.
`default_target` takes that level from the reference method (FFT) at its preset rate.

Pure analysis, no training: tables come back as markdown, figures as PNG (matplotlib, Agg backend). Runs that
diverged (non-finite metrics) are kept out of frontiers and interpolation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

from scale_cl.files import atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Two metric values closer than this (relative) count as the same: "exactly at the target".
REL_TOL = 1e-12

STATUS_OK = "ok"
STATUS_NOT_REACHED = "not reached"
STATUS_BELOW_RANGE = "below range"
STATUS_MISSING = "missing"


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=0.0)


@dataclass(frozen=True)
class Metric:
    """A metric and its direction, so the analysis never has to guess whether bigger is better."""

    name: str  # e.g. "learning ppl (heldout)", "Task-1 accuracy" (accuracies are fractions in [0, 1])
    higher_is_better: bool
    log_scale: bool = False  # plot axis on log scale (perplexities)

    def better(self, a: float, b: float) -> bool:
        """``a`` strictly better than ``b`` (False if either is NaN)."""
        return a > b if self.higher_is_better else a < b

    def at_least(self, value: float, target: float) -> bool:
        """``value`` reaches ``target``: as good or better (equal within a relative 1e-12)."""
        return _same(value, target) or self.better(value, target)

    def axis_label(self) -> str:
        return f"{self.name} ({'higher' if self.higher_is_better else 'lower'} is better)"


@dataclass(frozen=True)
class Point:
    """One finished run of the sweep."""

    method: str
    lr: float
    learning: float
    forgetting: float
    setting: str = ""  # ablation axis value label, e.g. "preserve_layers=4"; "" for the plain sweep
    learning_sd: float = 0.0  # spread over seeds (population std) where the run's values are means over seeds
    forgetting_sd: float = 0.0


def _finite(p: Point) -> bool:
    return math.isfinite(p.learning) and math.isfinite(p.forgetting)


def frontier(points: Sequence[Point], learning: Metric, forgetting: Metric) -> list[Point]:
    """Pareto-optimal points (no other point is at least as good on both metrics and better on one), ordered from
    worst to best learning (ties by lr).

    Points with a non-finite metric (diverged runs) are never on the frontier. Identical points are all kept.
    """
    finite = [p for p in points if _finite(p)]

    def dominated(p: Point) -> bool:
        return any(
            learning.at_least(q.learning, p.learning)
            and forgetting.at_least(q.forgetting, p.forgetting)
            and (learning.better(q.learning, p.learning) or forgetting.better(q.forgetting, p.forgetting))
            for q in finite
        )

    front = [p for p in finite if not dominated(p)]
    sign = 1 if learning.higher_is_better else -1
    return sorted(front, key=lambda p: (sign * p.learning, p.lr))


@dataclass(frozen=True)
class Matched:
    """One method's forgetting at a target learning level.

    ``reached=False`` has two causes: "not reached" (the method never learns that much at any swept rate) and,
    with ``below_range=True``, "below range" (even the sweep's lowest rate already learns more than the target,
    so the grid should be widened downwards).
    """

    method: str
    target: float
    forgetting: float | None  # None = not reached / below range
    lr: float | None  # the (interpolated, geometric) learning rate where the target is met
    reached: bool
    below_range: bool = False
    # Reached, but the lowest swept rate already reaches the target: a lower rate (outside the grid) may reach it
    # too and forget less, so the value is an upper bound on how well the method can do (widen the grid downwards).
    open_below: bool = False

    @property
    def status(self) -> str:
        if self.reached:
            return STATUS_OK
        return STATUS_BELOW_RANGE if self.below_range else STATUS_NOT_REACHED


def _sorted_by_lr(points: Sequence[Point]) -> list[Point]:
    if not points:
        raise ValueError("no points")
    methods = sorted({p.method for p in points})
    if len(methods) > 1:
        raise ValueError(f"points of one method expected, got {methods}")
    ordered = sorted(points, key=lambda p: p.lr)
    if ordered[0].lr <= 0:
        raise ValueError(f"{methods[0]}: learning rates must be positive, got {ordered[0].lr}")
    for a, b in pairwise(ordered):
        if a.lr == b.lr:
            raise ValueError(f"{methods[0]}: duplicate learning rate {a.lr:g} (mixed ablation settings?)")
    return ordered


def matched_forgetting(points: Sequence[Point], target: float, learning: Metric, forgetting: Metric) -> Matched:
    """One method's forgetting at learning level ``target``, interpolated in log learning rate.

    ``points`` are one method's runs (ValueError if empty, if methods differ, or if two share a learning rate).
    Sorted by lr, learning(lr) and forgetting(lr) are taken as piecewise linear in log(lr) between consecutive
    rates. Every place where the learning curve meets the target is a candidate: a point exactly at the target
    (relative 1e-12), or a segment whose endpoints lie on either side of it, where forgetting is interpolated at
    the same fraction t along the segment and lr = exp of the interpolated log lr. A non-monotone curve can cross
    several times; the candidate with the best forgetting wins (reading it off the frontier), ties to the lowest
    lr. Segments touching a diverged run (non-finite metric) are skipped: there is nothing to interpolate to.

    No candidate gives ``reached=False`` with forgetting and lr None: "below range" (``below_range=True``) if every
    point with a finite learning value is strictly better than the target (the lowest rate already overshoots it),
    else "not reached" (the method never learns that much). A single point is reached only if it is at the target.
    """
    ordered = _sorted_by_lr(points)
    method = ordered[0].method
    candidates: list[tuple[float, float]] = []  # (lr, forgetting)
    for p in ordered:
        if _finite(p) and _same(p.learning, target):
            candidates.append((p.lr, p.forgetting))
    for a, b in pairwise(ordered):
        if not (_finite(a) and _finite(b)) or _same(a.learning, target) or _same(b.learning, target):
            continue
        if learning.better(a.learning, target) != learning.better(b.learning, target):
            t = (target - a.learning) / (b.learning - a.learning)
            lr = math.exp(math.log(a.lr) + t * (math.log(b.lr) - math.log(a.lr)))
            candidates.append((lr, a.forgetting + t * (b.forgetting - a.forgetting)))
    if not candidates:
        learned = [p for p in ordered if math.isfinite(p.learning)]
        below = bool(learned) and all(learning.better(p.learning, target) for p in learned)
        return Matched(method, target, None, None, reached=False, below_range=below)
    candidates.sort()
    best_lr, best = candidates[0]
    for lr, value in candidates[1:]:
        if forgetting.better(value, best):
            best_lr, best = lr, value
    lowest = next((p for p in ordered if _finite(p)), None)
    open_below = lowest is not None and learning.at_least(lowest.learning, target)
    return Matched(method, target, best, best_lr, reached=True, open_below=open_below)


def default_target(
    points_by_method: Mapping[str, Sequence[Point]], reference_method: str, reference_lr: float, learning: Metric
) -> float:
    """The learning level the reference method (default FFT) reaches at its preset rate (nearest lr in log space if
    not exact, ties to the lower rate), so every method is compared where the usual recipe lands."""
    points = points_by_method.get(reference_method)
    if not points:
        raise ValueError(f"reference method {reference_method!r} has no points")
    if reference_lr <= 0:
        raise ValueError(f"reference lr must be positive, got {reference_lr}")
    nearest = min(sorted(points, key=lambda p: p.lr), key=lambda p: abs(math.log(p.lr / reference_lr)))
    if not math.isfinite(nearest.learning):
        raise ValueError(f"{reference_method} at lr {nearest.lr:g} has no finite {learning.name} (diverged?)")
    return nearest.learning


@dataclass(frozen=True)
class Panel:
    """One learning/forgetting pair of a sweep, e.g. new-domain ppl against one old domain's ppl."""

    title: str
    learning: Metric
    forgetting: Metric
    points: tuple[Point, ...]
    base: tuple[float, float] | None = None  # (learning, forgetting) of the untrained base model, marked on the figure
    target: float | None = None  # matched-learning level, drawn as a dashed line

    def of(self, method: str) -> list[Point]:
        return [p for p in self.points if p.method == method]


def _methods(points: Sequence[Point]) -> list[str]:
    return list(dict.fromkeys(p.method for p in points))


def _save(fig: Figure, path: Path) -> Path:
    """Write through a temporary file so a reader never sees half a PNG."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log(ax: Axes, which: str) -> None:
    """Log scale with plain tick labels (6, 10, 20 rather than 6x10^0); minor ticks labelled only on an axis that
    spans less than ~a decade (elsewhere their labels would overlap)."""
    from matplotlib.ticker import FuncFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")

    def minor(value: float, _: int) -> str:
        low, high = sorted(axis.get_view_interval())
        return f"{value:g}" if low > 0 and high / low < 20 else ""

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def plot_landscape(panels: Sequence[Panel], path: Path, title: str = "") -> Path:
    """One subplot per panel, learning on x and forgetting on y: each method's runs (one colour per method, each
    annotated with its lr, error bars for the spread over seeds where there is one), its frontier as a line, the
    base model as a black star, the target as a dashed vertical line. Axis labels say which way is better; log
    scale where the metric asks for it. Writes a PNG."""
    if not panels:
        raise ValueError("no panels to plot")
    plt = _pyplot()
    methods = _methods([p for panel in panels for p in panel.points])
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for method in _methods(panel.points):
            runs = [p for p in panel.of(method) if _finite(p)]
            groups = dict.fromkeys(p.setting for p in runs)
            for setting in groups:
                group = [p for p in runs if p.setting == setting]
                label = f"{method} ({setting})" if setting else method
                ax.scatter([p.learning for p in group], [p.forgetting for p in group], color=colours[method], s=25)
                if any(p.learning_sd or p.forgetting_sd for p in group):  # spread over seeds
                    ax.errorbar(
                        [p.learning for p in group],
                        [p.forgetting for p in group],
                        xerr=[p.learning_sd for p in group],
                        yerr=[p.forgetting_sd for p in group],
                        fmt="none",
                        ecolor=colours[method],
                        alpha=0.5,
                        capsize=2,
                        linewidth=1,
                    )
                line = frontier(group, panel.learning, panel.forgetting)
                style = "-" if not setting else ":"
                ax.plot([p.learning for p in line], [p.forgetting for p in line], style, color=colours[method])
                ax.plot([], [], style, marker="o", color=colours[method], label=label)
                for p in group:
                    ax.annotate(
                        f"{p.lr:.0e}", (p.learning, p.forgetting), xytext=(3, 3), textcoords="offset points", fontsize=6
                    )
        if panel.base is not None:
            ax.scatter([panel.base[0]], [panel.base[1]], marker="*", s=150, color="black", zorder=5, label="base")
        if panel.target is not None:
            ax.axvline(panel.target, linestyle="--", color="grey", linewidth=1, label="matched learning")
        ax.set_xlabel(panel.learning.axis_label())
        ax.set_ylabel(panel.forgetting.axis_label())
        if panel.learning.log_scale:
            _log(ax, "x")
        if panel.forgetting.log_scale:
            _log(ax, "y")
        ax.set_title(panel.title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_ablation(
    axis: str,
    values: Sequence[str],
    by_method: Mapping[str, Mapping[str, tuple[float, float, float | None]]],
    learning: Metric,
    forgetting: Metric,
    path: Path,
) -> Path:
    """Paper Fig. 5-7 style: x = axis value (categorical, in the given order), left panel learning at the preset
    rate, middle forgetting at the preset rate, right forgetting at matched learning (None = not reached, not
    drawn); one line per method. ``by_method[method][value] = (learning, forgetting, matched_forgetting)``; a value
    missing for a method is a gap in its line."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = list(range(len(values)))
    titles = (
        (learning, f"learning at the preset rate: {learning.name}"),
        (forgetting, f"forgetting at the preset rate: {forgetting.name}"),
        (forgetting, "forgetting at matched learning"),
    )
    for column, (ax, (metric, subtitle)) in enumerate(zip(axes, titles, strict=True)):
        drawn = False
        for method, cells in by_method.items():
            y = [cells[v][column] if v in cells and cells[v][column] is not None else math.nan for v in values]
            ax.plot(x, y, marker="o", label=method)
            drawn = drawn or any(value > 0 for value in y)  # NaN compares false
        ax.set_xticks(x, list(values))
        ax.set_xlabel(axis)
        ax.set_ylabel(metric.axis_label())
        if metric.log_scale and drawn:  # an empty panel (no method reaches the target) has nothing to scale
            _log(ax, "y")
        ax.set_title(subtitle, fontsize=10)
        ax.grid(alpha=0.3)
    missing = [m for m, cells in by_method.items() if all(v not in cells or cells[v][2] is None for v in values)]
    if missing:
        axes[2].text(0.02, 0.02, "not reached: " + ", ".join(missing), transform=axes[2].transAxes, fontsize=8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def matched_table(panels: Sequence[Panel], methods: Sequence[str]) -> list[dict]:
    """Rows for the matched-learning table, one per panel and method (JSON-ready): panel, method, learning and
    forgetting metric names, target, matched forgetting and lr, and status ('ok' | 'not reached' | 'below range',
    or 'missing' where the panel has no run of the method). Every panel needs a target."""
    rows = []
    for panel in panels:
        if panel.target is None:
            raise ValueError(f"panel {panel.title!r} has no matched-learning target")
        for method in methods:
            points = panel.of(method)
            row = {
                "panel": panel.title,
                "method": method,
                "learning": panel.learning.name,
                "forgetting": panel.forgetting.name,
                "target": panel.target,
                "matched_forgetting": None,
                "matched_lr": None,
                "status": STATUS_MISSING,
            }
            if points:
                m = matched_forgetting(points, panel.target, panel.learning, panel.forgetting)
                row.update(matched_forgetting=m.forgetting, matched_lr=m.lr, status=m.status, open_below=m.open_below)
            rows.append(row)
    return rows


def format_value(metric_name: str, value: float) -> str:
    """Accuracies (fractions; metric name contains 'accuracy') as percent with one decimal, else 4 significant
    digits."""
    if "accuracy" in metric_name.lower():
        return f"{100 * value:.1f}%"
    return f"{value:.4g}"


def matched_markdown(rows: Sequence[dict], fmt: Callable[[str, float], str] = format_value) -> str:
    """Markdown table of `matched_table` rows: one row per method, a column group (forgetting, lr) per panel.
    'not reached' / 'below range' are spelled out; ``fmt(metric_name, value)`` formats the numbers."""
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["panel"], r["method"]): r for r in rows}
    header = ["method"]
    for panel in panels:
        first = next(r for r in rows if r["panel"] == panel)
        target = fmt(first["learning"], first["target"])
        header += [f"{panel}: {first['forgetting']} at {first['learning']} = {target}", f"{panel}: lr"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        line = [method]
        for panel in panels:
            r = cell.get((panel, method))
            if r is None or r["status"] == STATUS_MISSING:
                line += ["—", "—"]
            elif r["status"] == STATUS_OK:
                mark = " †" if r.get("open_below") else ""
                spread = seed_spread(r.get("seed_forgetting") or [], r["forgetting"], fmt)
                text = fmt(r["forgetting"], r["matched_forgetting"]) + spread + mark
                line += [text, f"{r['matched_lr']:.3g}"]
            else:
                line += [r["status"], "—"]
        lines.append("| " + " | ".join(line) + " |")
    lines += [
        "",
        "Forgetting read off each method's sweep where it reaches the target learning level (linear in log "
        "learning rate between swept rates; the best crossing where the curve crosses more than once). "
        "'not reached': no swept rate learns that much; 'below range': the lowest swept rate already learns more "
        "(widen the grid downwards); '†': the lowest swept rate already reaches the target, so a lower rate may "
        "reach it too and forget less (the value is a bound; widen the grid downwards); '—': no runs.",
    ]
    if any(len(r.get("seed_forgetting") or ()) > 1 for r in rows):
        lines[-1] += (
            " With several seeds the value is read off the sweep of the seeds' means; '±' is the spread (population "
            "std) of the same reading taken off each seed's own sweep (at that seed's own reference level when the "
            "target is the reference's: paired), and 'k/n seeds' says how many of them reach the target where not "
            "all do."
        )
    return "\n".join(lines) + "\n"


def seed_spread(
    values: Sequence[float | None], metric_name: str, fmt: Callable[[str, float], str] = format_value
) -> str:
    """' ± sd' of a matched reading's per-seed values (None: that seed does not reach the target), and 'k/n seeds'
    where some seeds do not reach it; '' with fewer than two seeds."""
    if len(values) < 2:
        return ""
    reached = [v for v in values if v is not None]
    text = f" ± {fmt(metric_name, statistics.pstdev(reached))}" if len(reached) > 1 else ""
    return text + (f" ({len(reached)}/{len(values)} seeds)" if len(reached) < len(values) else "")


def _at_rate(points: Sequence[Point], method: str, lr: float) -> Point | None:
    hits = [p for p in points if p.method == method and math.isclose(p.lr, lr, rel_tol=1e-9)]
    if len(hits) > 1:
        raise ValueError(f"{method} has {len(hits)} runs at lr {lr:g} (mixed ablation settings?)")
    return hits[0] if hits else None


def _sd(metric_name: str, sd: float) -> str:
    return f" ± {format_value(metric_name, sd)}" if sd else ""


def single_rate_markdown(panels: Sequence[Panel], preset_rates: Mapping[str, float]) -> str:
    """Paper-style table at one rate per method (its preset): one row per method, learning and forgetting per
    panel; '—' where that run is missing. The matched table is the fair comparison; this one is the usual recipe."""
    header = ["method", "lr"]
    for panel in panels:
        header += [f"{panel.title}: {panel.learning.name}", f"{panel.title}: {panel.forgetting.name}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, lr in preset_rates.items():
        line = [method, f"{lr:g}"]
        for panel in panels:
            p = _at_rate(panel.points, method, lr)
            if p is None:
                line += ["—", "—"]
            else:
                line += [
                    format_value(panel.learning.name, p.learning) + _sd(panel.learning.name, p.learning_sd),
                    format_value(panel.forgetting.name, p.forgetting) + _sd(panel.forgetting.name, p.forgetting_sd),
                ]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n"
