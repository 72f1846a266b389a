"""The ``scale-cl`` command: every subcommand is a `Command` (a settings dataclass and a run function).

Subcommands, one module each: ``demo`` (`scale_cl.cli.demo`), ``bio``, ``cpt``, ``base`` and ``train``
(`scale_cl.cli.experiments`), ``calibrate`` (`scale_cl.cli.calibrate`), ``eval`` (`scale_cl.cli.eval`), ``export``
(`scale_cl.cli.export`), ``bench`` (`scale_cl.cli.bench`), ``sweep bio|cpt`` (`scale_cl.cli.sweep`). Their options
are built from the settings dataclasses by `scale_cl.cli.options`, and registered and run by `scale_cl.cli.command`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from scale_cl.cli.command import SPELLING, Command, add_command, preset_named, terminate_as_interrupt
from scale_cl.cli.options import HelpFormatter


def commands() -> tuple[Command, ...]:
    """Every subcommand, in the order ``scale-cl --help`` lists them."""
    from scale_cl.cli import bench, calibrate, demo, eval, experiments, export, sweep

    return (
        demo.COMMAND,
        experiments.BIO,
        experiments.CPT,
        experiments.BASE,
        experiments.TRAIN,
        calibrate.COMMAND,
        eval.COMMAND,
        export.COMMAND,
        bench.COMMAND,
        sweep.COMMAND,
    )


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The ``scale-cl`` parser; given the command line ``argv``, its ``--help`` shows the defaults of the preset it
    names (``scale-cl bio --preset micro --help``)."""
    preset = preset_named(list(argv))
    parser = argparse.ArgumentParser(
        prog="scale-cl",
        description="SCALE: width-upscaled continual learning of LLMs (arXiv 2511.03270).",
        epilog="Every command takes --config FILE.yaml (its settings, applied before the options given with it) "
        f"and --help. {SPELLING}",
        formatter_class=HelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in commands():
        add_command(subparsers, command, preset)
    return parser


def parse_settings(argv: list[str]) -> Any:
    """The settings object that ``scale-cl *argv`` would run with (its preset, YAML and options applied, and checked:
    a ValueError for settings the command would refuse before loading anything)."""
    args = build_parser(argv).parse_args(argv)
    return args.func.settings(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    with terminate_as_interrupt():  # SIGTERM stops a run as Ctrl-C does (exit 143; 130 for Ctrl-C)
        return args.func(args, command_line=f"{program()} {shlex.join(argv)}")


def program() -> str:
    """How ``scale-cl`` was started: the entry point, or ``python -m scale_cl.cli``."""
    return "python -m scale_cl.cli" if sys.argv and sys.argv[0].endswith("scale_cl/cli/__main__.py") else "scale-cl"


if __name__ == "__main__":
    sys.exit(main())
