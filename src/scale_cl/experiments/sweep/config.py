"""``scale-cl sweep bio|cpt``'s settings: what the sweep varies and the level the methods are compared at
(`SweepOptions`, turned into the runner's `SweepSettings`), beside the experiment's own settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scale_cl.experiments.bio.config import BioConfig
from scale_cl.experiments.bio.config import preset as bio_preset
from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.cpt.config import preset as cpt_preset
from scale_cl.experiments.sweep.runner import DEFAULT_LR_SCALES, Axis, SweepSettings
from scale_cl.methods import REGISTRY


def _concerned() -> str:
    """Which method settings each method reads (its declaration's `MethodSpec.reads`)."""
    return "; ".join(f"{name}: {' '.join(spec.reads)}" for name, spec in REGISTRY.items() if spec.reads)


@dataclass
class SweepOptions:
    """What the sweep varies and the level the methods are compared at (the experiment's own settings follow)."""

    out: str | None = field(
        default=None,
        metadata={
            "help": "output folder (default: outputs/sweep-<experiment>-<preset>)",
            "type": str,
            "metavar": "DIR",
        },
    )
    lr_scales: tuple[float, ...] = field(
        default=DEFAULT_LR_SCALES,
        metadata={"gt": 0, "help": "multiples of each method's preset learning rate to run", "metavar": "X"},
    )
    method_lr_scales: list[list[str]] = field(
        default_factory=list,
        metadata={
            "help": "more multiples for one method only, beside --lr_scales: e.g. --method_lr_scales scale_preserve "
            "1.5 2 where that method's frontier stops short of the target; repeatable, one method each; a method "
            "not in --methods is ignored",
            "action": "append",
            "nargs": "+",
            "metavar": ("METHOD", "X"),
            "show_default": False,
        },
    )
    axis: list[list[str]] = field(
        default_factory=list,
        metadata={
            "help": "an ablation beside the learning rate: a setting and its values, e.g. --axis "
            "options.scale.preserve_layers 2 4 6; repeatable; settings that vary together are joined by commas, "
            "and so are their values (--axis options.scale.w21_init,options.scale.w22_init svd,zero random,random); "
            "a tuple setting's items are joined by + (attn+ffn). Each value is swept over the same rates, for the "
            f"methods the setting concerns ({_concerned()}; a setting outside options: every method)",
            "action": "append",
            "nargs": "+",
            "metavar": ("SETTING", "VALUE"),
            "show_default": False,
        },
    )
    reference: str = field(
        default="fft",
        metadata={"help": "the method whose learning at its preset rate is the matched-learning target"},
    )
    target: float | None = field(
        default=None,
        metadata={
            "gt": 0,
            "help": "the learning level to compare methods at, instead of --reference's (an accuracy in [0, 1] for "
            "bio, a perplexity for cpt)",
            "type": float,
        },
    )

    def sweep_settings(self) -> SweepSettings:
        axes = tuple(Axis(str(values[0]), tuple(map(str, values[1:]))) for values in self.axis)  # YAML: numbers too
        for axis in axes:
            if not axis.values:
                raise ValueError(f"--axis {axis.setting} needs at least one value, e.g. --axis {axis.setting} 1 2 3")
        extra: dict[str, tuple[float, ...]] = {}
        for method, *values in self.method_lr_scales:
            if not values or method in extra:
                raise ValueError(
                    f"--method_lr_scales {method}: give its multiples once, e.g. --method_lr_scales {method} 1.5 2"
                )
            try:
                extra[str(method)] = tuple(float(v) for v in values)
            except ValueError as err:
                raise ValueError(f"--method_lr_scales {method}: multiples must be numbers, got {values}") from err
            if not all(0 < x < float("inf") for x in extra[str(method)]):
                raise ValueError(f"--method_lr_scales {method}: multiples must be > 0, got {values}")
        return SweepSettings(
            lr_scales=tuple(self.lr_scales),
            axes=axes,
            reference=self.reference,
            target=self.target,
            method_lr_scales=extra,
        )


@dataclass
class CptSweepOptions(SweepOptions):
    """What the sweep varies and the level the methods are compared at (the experiment's own settings follow)."""

    save_models: bool = field(
        default=False,
        metadata={"help": "keep every run's trained model (false: only its metrics; a model per run is many GB)"},
    )
    seeds: list[int] = field(
        default_factory=list,
        metadata={
            "ge": 0,
            "le": 4294967295,
            "help": "run every point once per seed (initialisation and data order; default: --seed alone); the "
            "tables give the spread over seeds and the landscape error bars; re-run with more seeds to add them",
            "metavar": "S",
            "type": int,
        },
    )


@dataclass
class BioSweep:
    """``scale-cl sweep bio``: the sweep's options and the biography benchmark's settings."""

    sweep: SweepOptions = field(default_factory=SweepOptions, metadata={"inline": True, "group": "sweep settings"})
    bio: BioConfig = field(default_factory=lambda: bio_preset("micro"), metadata={"inline": True})

    def check(self) -> None:
        """The checks of the final settings, before anything is built (the command line runs them; the runner
        repeats them, with every point's settings): the experiment's, the grid's and the target's."""
        from scale_cl.experiments.sweep.experiments import BioExperiment

        _check_sweep(BioExperiment, self.bio, self.sweep)


@dataclass
class CptSweep:
    """``scale-cl sweep cpt``: the sweep's options and continual pre-training's settings."""

    sweep: CptSweepOptions = field(
        default_factory=CptSweepOptions, metadata={"inline": True, "group": "sweep settings"}
    )
    cpt: CptConfig = field(default_factory=lambda: cpt_preset("smollm2"), metadata={"inline": True})

    def check(self) -> None:
        """The checks of the final settings, before any model or data loads (the command line runs them; the runner
        repeats them, with every point's settings): the experiment's, the grid's and the target's."""
        from scale_cl.experiments.sweep.experiments import CptExperiment

        _check_sweep(CptExperiment, self.cpt, self.sweep)


def _check_sweep(experiment: Any, cfg: Any, sweep: SweepOptions) -> None:
    """One experiment's sweep checks: no task sequence, the experiment's own, the grid's and the target's."""
    experiment.refuse_sequence(cfg)
    cfg.check()
    settings = sweep.sweep_settings()
    settings.validate(cfg.methods)
    experiment.check_target(settings.target)


def bio_sweep_settings(name: str = "micro") -> BioSweep:
    """The sweep's settings with bio preset ``name``'s experiment settings."""
    return BioSweep(bio=bio_preset(name))


def cpt_sweep_settings(name: str = "smollm2") -> CptSweep:
    """The sweep's settings with cpt preset ``name``'s experiment settings."""
    return CptSweep(cpt=cpt_preset(name))
