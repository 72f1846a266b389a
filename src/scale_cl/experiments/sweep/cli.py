"""``scale-cl sweep bio|cpt``: the experiment's own options, plus the grid, the ablation axes and the target."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scale_cl.experiments.sweep.runner import DEFAULT_LR_SCALES, Axis, SweepSettings
from scale_cl.methods import REGISTRY


def _concerned() -> str:
    """Which methods each method setting concerns, from the method registry."""
    return "; ".join(f"{name}: {' '.join(spec.settings)}" for name, spec in REGISTRY.items() if spec.settings)


SWEEP_OPTIONS = ("lr_scales", "axis", "reference", "target", "save_models", "experiment")

DESCRIPTION = (
    "Run one experiment with every method over a grid of learning rates (multiples of each method's preset "
    "rate), and optionally ablation axes beside it, then compare the methods at matched learning: each "
    "method's forgetting where it reaches the learning level of --reference at its preset rate (or --target), "
    "read off its sweep by interpolation in log learning rate (paper Table 1 and Fig. 2). Data, tokenisation, "
    "bio's stage-1/2 models and the step-0 evaluation are computed once; re-running the same command resumes "
    "and never recomputes a finished run. Writes results.md/json, landscape.png and ablation-*.png."
)


def _sweep_settings(args: argparse.Namespace) -> SweepSettings:
    axes = tuple(Axis(values[0], tuple(values[1:])) for values in args.axis or [])
    for axis in axes:
        if not axis.values:
            raise ValueError(f"--axis {axis.setting} needs at least one value, e.g. --axis {axis.setting} 1 2 3")
    return SweepSettings(lr_scales=tuple(args.lr_scales), axes=axes, reference=args.reference, target=args.target)


def _run(args: argparse.Namespace) -> int:
    from scale_cl.cli.options import resolve_settings
    from scale_cl.experiments.sweep.experiments import BioExperiment, CptExperiment
    from scale_cl.experiments.sweep.report import write_report
    from scale_cl.experiments.sweep.runner import run_sweep
    from scale_cl.train.checkpointing import NonFiniteLossError

    name = args.experiment
    try:
        if name == "bio":
            from scale_cl.experiments.bio.config import preset

            cfg = resolve_settings(args, preset, "micro", skip=SWEEP_OPTIONS)
            experiment = BioExperiment(cfg)
        else:
            from scale_cl.experiments.cpt.config import preset

            cfg = resolve_settings(args, preset, "smollm2", skip=SWEEP_OPTIONS)
            experiment = CptExperiment(cfg, save_models=args.save_models)
        settings = _sweep_settings(args)
        out = Path(args.out or f"outputs/sweep-{name}-{cfg.preset}")
        result = run_sweep(experiment, settings, out)
        if not experiment.is_main_process:
            return 0
        write_report(experiment, settings, result, out)
    except (ValueError, FileNotFoundError, NonFiniteLossError) as err:
        print(f"scale-cl sweep {name}: error: {err}", file=sys.stderr)
        return 1 if isinstance(err, NonFiniteLossError) else 2
    print((out / "results.md").read_text())
    print(f"[sweep] wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'landscape.png'}")
    return 0


def _add_sweep_options(parser: argparse.ArgumentParser, cpt: bool) -> None:
    group = parser.add_argument_group("sweep settings")
    group.add_argument("--out", help="output folder (default: outputs/sweep-<experiment>-<preset>)")
    group.add_argument("--config", help="YAML file of experiment settings (as for the experiment's own command)")
    group.add_argument(
        "--lr-scales",
        type=float,
        nargs="+",
        default=list(DEFAULT_LR_SCALES),
        metavar="X",
        help="multiples of each method's preset learning rate to run (default: %(default)s)",
    )
    group.add_argument(
        "--axis",
        nargs="+",
        action="append",
        metavar=("SETTING", "VALUE"),
        help="an ablation beside the learning rate: a setting and its values, e.g. "
        "--axis options.scale.preserve_layers "
        "2 4 6; repeatable; settings that vary together are joined by commas, and so are their values "
        "(--axis options.scale.w21_init,options.scale.w22_init svd,zero random,random); a tuple setting's "
        "items are joined by + (attn+ffn). Each value is swept over the same rates, for the methods the setting "
        f"concerns ({_concerned()}; a setting outside options: every method)",
    )
    group.add_argument(
        "--reference",
        default="fft",
        help="the method whose learning at its preset rate is the matched-learning target (default: %(default)s)",
    )
    group.add_argument(
        "--target",
        type=float,
        help="the learning level to compare methods at, instead of --reference's (an accuracy in [0, 1] for bio, "
        "a perplexity for cpt)",
    )
    if cpt:
        group.add_argument(
            "--save-models",
            action="store_true",
            help="keep every run's trained model (default: only its metrics; a model per run is many GB)",
        )


def add_sweep_parser(commands: argparse._SubParsersAction) -> None:
    from scale_cl.cli.options import add_dataclass_options
    from scale_cl.experiments.bio.config import preset as bio_preset
    from scale_cl.experiments.cpt.config import preset as cpt_preset

    sweep = commands.add_parser(
        "sweep",
        help="learning-rate sweeps of bio or cpt: stability-plasticity landscape and matched-learning comparison",
        description=DESCRIPTION,
    )
    experiments = sweep.add_subparsers(dest="experiment", required=True)
    bio = experiments.add_parser(
        "bio",
        help="sweep the biography benchmark (default preset: micro)",
        description=DESCRIPTION + " Experiment options are `scale-cl bio`'s; defaults shown are the micro preset's.",
    )
    _add_sweep_options(bio, cpt=False)
    add_dataclass_options(bio, bio_preset("micro"), aliases={"seeds": ["--seed"]})
    bio.set_defaults(func=_run)
    cpt = experiments.add_parser(
        "cpt",
        help="sweep continual pre-training (default preset: smollm2)",
        description=DESCRIPTION + " Experiment options are `scale-cl cpt`'s; defaults shown are the smollm2 preset's.",
    )
    _add_sweep_options(cpt, cpt=True)
    add_dataclass_options(cpt, cpt_preset("smollm2"))
    cpt.set_defaults(func=_run)
