"""``scale-cl calibrate``: the calibrated router's gate fitted on a finished `scale-cl train` run."""

from __future__ import annotations

from dataclasses import dataclass, field

from scale_cl.cli.command import Command


@dataclass
class CalibrateSettings:
    """What ``scale-cl calibrate`` fits; every field is an option of the same name."""

    run: str | None = field(
        default=None,
        metadata={
            "help": "the --out folder of a finished `scale-cl train` run of SCALE-Preserve or SCALE-Route",
            "positional": True,
            "type": str,
            "metavar": "RUN",
        },
    )


def run(settings: CalibrateSettings) -> int:
    from scale_cl.experiments.train.calibrate import calibrate_run

    if settings.run is None:
        raise ValueError("scale-cl calibrate needs RUN: the --out folder of a finished `scale-cl train` run")
    fit = calibrate_run(settings.run)
    gate = ", ".join(f"{name.removeprefix('router_')} {value:.3g}" for name, value in fit.fit.gate.settings().items())
    print(
        f"[calibrate] fitted in {fit.seconds:.1f} s on {fit.new_sequences} training and {fit.old_sequences} base "
        f"sequences of {fit.length} tokens: {gate}"
    )
    print(
        f"[calibrate] the base's weight: {fit.fit.old_base_weight:.3f} on the base's text, "
        f"{fit.fit.new_base_weight:.3f} on the training text; {settings.run}/model now reads with it"
    )
    return 0


COMMAND = Command(
    name="calibrate",
    help="fit the calibrated router of a trained SCALE model on its own training text (no old data)",
    description=(
        "Fit the calibrated router's gate on a finished `scale-cl train` run of SCALE-Preserve or SCALE-Route, as "
        "`scale-cl train --reading calibrated` does at its end, and save the run's model read by it. The gate "
        "weighs the prefix's evidence (the likelihood router's) against each expert's confidence at the position "
        "(the confidence router's), fitted to tell apart the run's own training text and text the base model "
        "writes itself (sampled from a document start): no old data and no evaluation text are read. The run's "
        "corpus is read from the cache the run wrote. The model folder is replaced only once the new one is "
        "written; result.json records the fit. Fitting takes one forward pass over 64 training sequences and "
        "64 sampled ones: seconds to minutes."
    ),
    epilog="examples:\n  scale-cl calibrate outputs/train-clean-en-scale_preserve",
    usage="scale-cl calibrate RUN [--config FILE.yaml]",
    settings=CalibrateSettings,
    run=run,
    config_example="{run: outputs/train-clean-en-scale_preserve}",
)
