"""``scale-cl sweep bio|cpt``: a `Command` over the sweep's settings (`scale_cl.experiments.sweep.config`): the grid,
the ablation axes and the target beside the experiment's own settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scale_cl.cli.command import Command
from scale_cl.experiments.sweep.config import BioSweep, CptSweep, SweepOptions, bio_sweep_settings, cpt_sweep_settings


def _run(name: str, experiment: Any, options: SweepOptions) -> int:
    from scale_cl.experiments.sweep.report import write_report
    from scale_cl.experiments.sweep.runner import run_sweep

    settings = options.sweep_settings()
    out = Path(options.out or f"outputs/sweep-{name}-{experiment.cfg.preset}")
    result = run_sweep(experiment, settings, out)
    if not experiment.is_main_process:
        return 0
    write_report(experiment, settings, result, out)
    print((out / "results.md").read_text())
    print(f"[sweep] wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'landscape.png'}")
    return 0


def run_bio_sweep(settings: BioSweep) -> int:
    from scale_cl.experiments.sweep.experiments import BioExperiment

    return _run("bio", BioExperiment(settings.bio), settings.sweep)


def run_cpt_sweep(settings: CptSweep) -> int:
    from scale_cl.experiments.sweep.experiments import CptExperiment

    experiment = CptExperiment(settings.cpt, save_models=settings.sweep.save_models, seeds=settings.sweep.seeds)
    return _run("cpt", experiment, settings.sweep)


DESCRIPTION = (
    "Run one experiment with every method over a grid of learning rates (multiples of each method's preset "
    "rate), and optionally ablation axes beside it, then compare the methods at matched learning: each "
    "method's forgetting where it reaches the learning level of --reference at its preset rate (or --target), "
    "read off its sweep by interpolation in log learning rate (paper Table 1 and Fig. 2). Data, tokenisation, "
    "bio's stage-1/2 models and the step-0 evaluation are computed once; re-running the same command resumes "
    "and never recomputes a finished run. Writes results.md/json, landscape.png, ablation-*.png and (cpt) drift.png."
)

COMMAND = Command(
    name="sweep",
    help="learning-rate sweeps of bio or cpt: stability-plasticity landscape and matched-learning comparison",
    description=DESCRIPTION,
    epilog="scale-cl sweep bio --help and scale-cl sweep cpt --help list every option.",
    subcommands=(
        Command(
            name="bio",
            help="sweep the biography benchmark (default preset: micro)",
            description=DESCRIPTION + "\n\nExperiment options are `scale-cl bio`'s; defaults shown are the preset's "
            "given with --help, else the micro preset's. --config's YAML may hold both the sweep's settings and the "
            "experiment's.",
            epilog=(
                "examples:\n"
                "  scale-cl sweep bio                                     # micro preset, all methods, 5 rates each\n"
                "  scale-cl sweep bio --preset small --axis options.scale.preserve_layers 1 2 "
                "--out outputs/sweep-bio-small\n"
                "  scale-cl sweep bio --preset small --target 0.9 --out outputs/sweep-bio-small   # re-read"
            ),
            settings=bio_sweep_settings,
            presets=True,
            run=run_bio_sweep,
            config_example="{lr_scales: [0.5, 1, 2], task1: {max_steps: 100}}",
        ),
        Command(
            name="cpt",
            help="sweep continual pre-training (default preset: smollm2)",
            description=DESCRIPTION + "\n\nExperiment options are `scale-cl cpt`'s; defaults shown are the preset's "
            "given with --help, else the smollm2 preset's. --config's YAML may hold both the sweep's settings and the "
            "experiment's.",
            epilog=(
                "examples:\n"
                "  scale-cl sweep cpt --data.train 'ko/*.jsonl' --data.old_eval en=en.jsonl "
                "--methods fft lora scale_route \\\n"
                "                     --lr_scales 0.5 1 2 --train.max_steps 100"
            ),
            settings=cpt_sweep_settings,
            presets=True,
            run=run_cpt_sweep,
            config_example="{lr_scales: [0.3, 1, 3], data: {train: [ko/*.jsonl]}}",
        ),
    ),
)
