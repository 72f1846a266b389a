"""Plan and run a sweep: every method over a grid of learning rates, and the ablation axes beside it.

Output folder::

    sweep_config.json        the experiment's settings (a later run into this folder must use the same
                             ones; the methods, grid and axes may change: points are keyed by their settings)
    base_metrics.json        the step-0 evaluation, shared by every run
    cache/                   bio: tokenizer and stage-1/2 models; cpt: nothing
    points/<key>/            one run each (the experiment's own files) and point.json, its metrics (means
                             over seeds) and each seed's; point.json's presence means "done" (for cpt
                             with --seeds: done with exactly those seeds), so a re-run recomputes nothing
                             (cpt: a re-run with more seeds runs only the new seeds' runs)
    results.md, results.json, landscape.png, ablation-<axis>.png
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from scale_cl.experiments.overrides import apply_overrides, nest
from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.experiments.settings import settings_of
from scale_cl.experiments.sweep.experiments import CONFIG_FILE
from scale_cl.files import write_json
from scale_cl.methods import METHOD_NAMES, REGISTRY

POINT_FILE = "point.json"
DEFAULT_LR_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
OPTIONS = "options."  # settings below it concern only the methods that read them (`settings_of`)


def concerns(setting: str, method: str) -> bool:
    """Whether ``setting`` (dotted) changes ``method``: a method setting only if the method reads it.

    A setting no method names (outside ``options``, or unknown) concerns every method; an unknown one
    is then refused when its value is read.
    """
    name = setting.removeprefix(OPTIONS)
    if not setting.startswith(OPTIONS) or not any(name in spec.reads for spec in REGISTRY.values()):
        return True
    return name in settings_of(method)


def stored_overrides(overrides: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """A point's ablation settings as point.json holds them (a tuple value is a list there): the one form every
    record has, whether just run or read back, so records and axis values compare equal."""
    return json.loads(json.dumps(dict(overrides)))


def format_value(value: Any) -> str:
    """A setting's value as written in point keys and labels (a tuple as ``a+b``, as on the command line)."""
    return "+".join(map(str, value)) if isinstance(value, tuple) else str(value)


@dataclass(frozen=True)
class Axis:
    """An ablation: a setting (dotted, e.g. ``options.scale.preserve_layers``) and the values it takes.

    Settings that vary together (paper Fig. 5's W21/W22 initialiser pairs) are joined by commas, and
    so are each value's parts: ``Axis("options.scale.w21_init,options.scale.w22_init", ("svd,zero",
    "random,random"))``. A tuple setting's items are joined by ``+`` (``collab_modules`` ``attn+ffn``).
    """

    setting: str
    values: tuple[str, ...]

    @property
    def settings(self) -> tuple[str, ...]:
        return tuple(self.setting.split(","))

    @property
    def name(self) -> str:
        return ",".join(s.rsplit(".", 1)[-1] for s in self.settings)

    def methods(self, methods: list[str]) -> list[str]:
        """The swept methods every one of the axis's settings concerns."""
        return [m for m in methods if all(concerns(s, m) for s in self.settings)]

    def overrides(self, cfg: Any, text: str) -> tuple[tuple[str, Any], ...]:
        """The settings ``text`` changes in ``cfg`` (those equal to ``cfg``'s own are left out)."""
        parts = text.split(",") if len(self.settings) > 1 else [text]
        if len(parts) != len(self.settings):
            raise ValueError(
                f"axis {self.setting}: value {text!r} must give {len(self.settings)} comma-separated parts"
            )
        changes = []
        for setting, part in zip(self.settings, parts, strict=True):
            value = typed_value(cfg, setting, part)
            if value != current_value(cfg, setting):
                changes.append((setting, value))
        return tuple(changes)


@dataclass
class SweepSettings:
    """What a sweep varies: learning-rate multipliers of each method's preset rate, and ablation axes."""

    lr_scales: tuple[float, ...] = DEFAULT_LR_SCALES
    axes: tuple[Axis, ...] = ()
    reference: str = "fft"  # the method whose learning at its preset rate is the default target
    target: float | None = None  # the learning level methods are compared at (default: the reference's)
    # More multiples for some methods only: a frontier that stops short of the target is extended
    # without running every method at the new rates.
    method_lr_scales: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def scales_of(self, method: str) -> tuple[float, ...]:
        """The multiples ``method`` runs at: the common grid and its own extra ones, in increasing order."""
        return tuple(sorted({*self.lr_scales, *self.method_lr_scales.get(method, ())}))

    def validate(self, methods: list[str]) -> None:
        if not self.lr_scales or any(not (s > 0 and math.isfinite(s)) for s in self.lr_scales):
            raise ValueError(f"learning-rate scales must be positive numbers, got {list(self.lr_scales)}")
        if len(set(self.lr_scales)) != len(self.lr_scales):
            raise ValueError(f"learning-rate scales repeat: {list(self.lr_scales)}")
        for method, scales in self.method_lr_scales.items():
            if method not in METHOD_NAMES:  # a method that is known but not swept this time adds nothing
                raise ValueError(
                    f"--method_lr_scales names {method!r}, which is not a method (one of {', '.join(METHOD_NAMES)})"
                )
            if not scales or any(not (s > 0 and math.isfinite(s)) for s in scales):
                raise ValueError(f"--method_lr_scales {method}: scales must be positive numbers, got {list(scales)}")
        if self.target is None and self.reference not in methods:
            raise ValueError(
                f"the reference method {self.reference!r} is not swept: add it to --methods, name another "
                "--reference, or give the learning level with --target"
            )
        for axis in self.axes:
            if not axis.values:
                raise ValueError(f"axis {axis.setting} has no values")
            if not axis.methods(methods):
                concerned = sorted({m for s in axis.settings for m in METHOD_NAMES if concerns(s, m)})
                raise ValueError(f"axis {axis.setting} applies to {', '.join(concerned)}; none is swept")


@dataclass(frozen=True)
class SweepPoint:
    """One run: a method at a learning rate, with its ablation setting (only what differs from the experiment)."""

    method: str
    lr: float
    overrides: tuple[tuple[str, Any], ...] = ()
    label: str = ""  # "preserve_layers=4"; "" for the plain sweep
    scale: float = 1.0  # the multiple of the method's preset rate

    @property
    def key(self) -> str:
        parts = [
            self.method,
            *(f"{s.rsplit('.', 1)[-1]}={format_value(v)}" for s, v in self.overrides),
            f"lr={self.lr:.4g}",
        ]
        return "__".join(parts)


def current_value(cfg: Any, dotted: str) -> Any:
    node = cfg
    for name in dotted.split("."):
        if not is_dataclass(node) or name not in {f.name for f in fields(node)}:
            raise ValueError(f"unknown setting {dotted!r} for an ablation axis")
        node = getattr(node, name)
    return node


def typed_value(cfg: Any, dotted: str, text: str) -> Any:
    """``text`` converted to the type of the setting's current value."""
    current = current_value(cfg, dotted)
    try:
        if isinstance(current, bool):
            return {"true": True, "false": False}[text.lower()]
        if isinstance(current, tuple):
            return tuple(text.split("+"))
        return type(current)(text)
    except (KeyError, ValueError) as err:
        raise ValueError(f"axis {dotted}: {text!r} is not a valid {type(current).__name__}") from err


def plan(experiment: Any, settings: SweepSettings) -> list[SweepPoint]:
    """Every point of the sweep, without duplicates (an axis value equal to the experiment's is the plain point)."""
    cfg = experiment.cfg
    section = getattr(cfg, experiment.rates_section)
    points: dict[str, SweepPoint] = {}

    def add(method: str, overrides: tuple[tuple[str, Any], ...], label: str) -> None:
        for scale in settings.scales_of(method):
            point = SweepPoint(method, section.lr_of(method) * scale, overrides, label, scale)
            points.setdefault(point.key, point)

    for method in cfg.methods:
        add(method, (), "")
    for axis in settings.axes:
        for text in axis.values:
            overrides = axis.overrides(cfg, text)
            for method in axis.methods(cfg.methods):
                add(method, overrides, f"{axis.name}={text}")
    return list(points.values())


def point_config(experiment: Any, point: SweepPoint) -> Any:
    """The experiment's settings for one point: its method alone, its rate, its ablation setting."""
    from scale_cl.experiments.sweep.experiments import with_rate

    cfg = apply_overrides(experiment.cfg, nest(point.overrides))
    return replace(with_rate(cfg, experiment.rates_section, point.method, point.lr), methods=[point.method])


@dataclass
class SweepResult:
    base: dict[str, float]
    points: list[dict[str, Any]] = field(default_factory=list)  # point.json records: method, lr, scale, metrics...


def finished(experiment: Any, path: Path) -> dict[str, Any] | None:
    """A point's record if it is done (with every seed the experiment asks for), else None."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if "seeds" not in record:  # written before point.json kept each seed's metrics
        record["seeds"] = experiment.seed_metrics(record["method"], path.parent)
    return record if experiment.covers(record) else None


def run_sweep(experiment: Any, settings: SweepSettings, out: Path) -> SweepResult:
    """Run (or resume) every point of the sweep into ``out``; finished points are read, never recomputed."""
    out = Path(out)
    check_output_folder(out, CONFIG_FILE, experiment.cfg.to_dict())  # before any point is planned or run
    settings.validate(experiment.cfg.methods)
    experiment.check_target(settings.target)
    points = plan(experiment, settings)
    configs = {p.key: point_config(experiment, p) for p in points}
    for cfg in configs.values():  # every point's settings are checked before anything is written
        experiment.validate(cfg)
    settings_dict = experiment.cfg.to_dict()
    main = experiment.is_main_process
    claim_output_folder(out, CONFIG_FILE, settings_dict, write=main)
    done = {p.key: finished(experiment, out / "points" / p.key / POINT_FILE) for p in points}
    if main:
        finished_count = sum(record is not None for record in done.values())
        print(f"[sweep] {experiment.name}: {len(points)} runs, {finished_count} already done")
    base = experiment.prepare(out)
    result = SweepResult(base)
    for index, point in enumerate(points, 1):
        path = out / "points" / point.key / POINT_FILE
        if done[point.key] is not None:
            result.points.append(done[point.key])
            continue
        label = f" ({point.label})" if point.label else ""
        if main:
            print(f"[sweep] run {index}/{len(points)}: {point.method}{label}, lr {point.lr:.3g} (x{point.scale:g})")
        metrics = experiment.run(configs[point.key], point.method, path.parent)
        record = {
            "method": point.method,
            "lr": point.lr,
            "scale": point.scale,
            "label": point.label,
            "overrides": stored_overrides(point.overrides),
            "metrics": metrics,
            "seeds": experiment.seed_metrics(point.method, path.parent) if main else {},
        }
        if main:
            write_json(path, record)
            result.points.append(record)
    return result
