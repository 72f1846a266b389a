"""A ``scale-cl`` subcommand: a settings dataclass and the function that runs it, registered one way.

Every subcommand is declared as a `Command`; its options come from its settings dataclass
(`scale_cl.cli.options.add_dataclass_options`), and every one takes ``--config FILE.yaml``. The
settings are resolved in one order for all: the defaults (a preset's, where the command has
presets), then the YAML file, then the command-line options; then the settings' own ``check()``, where
their dataclass has one: what needs several settings at once but no model, data or device (a batch and
its micro-batches, a sequence's options), so that every command refuses it before anything loads, its
``--dry_run`` and `scale_cl.cli.parse_settings` included. Bad input exits with status 2: the
parser's own errors, and a ``ValueError`` / ``FileNotFoundError`` raised while the settings are
resolved or the command runs, printed as ``<prog>: error: <message>``. A training run whose loss
becomes NaN/inf (`NonFiniteLossError`, naming the last good checkpoint) exits with status 1.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

from scale_cl.cli.options import HelpFormatter, add_dataclass_options
from scale_cl.experiments.overrides import apply_overrides, nest, read_yaml

SPELLING = (
    "Options are spelt as their settings are named (--lr_scales, --section.field); the same names with dashes "
    "(--lr-scales) are accepted too."
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, as Ctrl-C raises KeyboardInterrupt: a run stops the same way (its
    checkpoints and finished parts kept) and the command ends with exit status 143 instead of 130."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While open, SIGTERM raises `Terminated` in the main thread (the previous handler restored after)."""

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def close_progress_bars() -> None:
    """Close the progress bars an interrupted run left open, so the line after them starts on its own and no bar is
    redrawn below it when the interpreter exits (tqdm keeps its open bars in ``tqdm._instances``; no public list)."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


@dataclass(frozen=True)
class Command:
    """One subcommand.

    ``settings()`` gives the default settings (the dataclass whose fields are the options); with
    ``presets``, ``settings(name)`` gives preset ``name``'s, chosen by the settings' ``preset``
    option or YAML key. ``run(settings)`` runs the command and returns its exit status. A command
    with ``subcommands`` only groups them (``scale-cl sweep bio``).
    """

    name: str
    help: str
    description: str
    settings: Callable[..., Any] | None = None
    run: Callable[[Any], int] | None = None
    presets: bool = False
    epilog: str | None = None
    usage: str | None = None
    config_example: str = ""
    subcommands: tuple[Command, ...] = ()


def dotted_names(nested: dict[str, Any], prefix: str = "") -> set[str]:
    """The settings named in nested overrides, dotted: ``{"a": {"b": 1}}`` names ``a.b``."""
    names: set[str] = set()
    for key, value in nested.items():
        names |= dotted_names(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return names


class Runner:
    """What a parsed command line calls (``args.func(args)``): resolve the settings, then run the command."""

    def __init__(self, command: Command, prog: str, dests: list[str]) -> None:
        self.command, self.prog, self.dests = command, prog, tuple(dests)

    def settings(self, args: argparse.Namespace) -> Any:
        """The command's settings: the defaults (or the preset's), then ``--config``'s YAML, then the options,
        then their ``check()`` (a ValueError for settings that cannot work, whatever the model)."""
        options = nest((d, getattr(args, d)) for d in self.dests if hasattr(args, d))
        from_yaml = read_yaml(args.config) if getattr(args, "config", None) else {}
        preset = (options.get("preset") or from_yaml.get("preset")) if self.command.presets else None
        assert self.command.settings is not None
        defaults = self.command.settings(preset) if preset else self.command.settings()
        settings = apply_overrides(apply_overrides(defaults, from_yaml), options)
        if "given" in {f.name for f in fields(settings) if f.metadata.get("cli") is False}:  # what the user chose
            settings = replace(settings, given=tuple(sorted(dotted_names(from_yaml) | dotted_names(options))))
        check = getattr(settings, "check", None)
        if callable(check):  # the checks of the final settings, before any model or data (module doc)
            check()
        return settings

    def __call__(self, args: argparse.Namespace, command_line: str | None = None) -> int:
        """Run the command. ``command_line``: how it was started, for a command whose settings record it (a
        ``command`` field that is no option: the bench's results say which command made them)."""
        assert self.command.run is not None
        from scale_cl.train.trainer import NonFiniteLossError

        settings = None
        try:
            settings = self.settings(args)
            if command_line and "command" in {f.name for f in fields(settings) if f.metadata.get("cli") is False}:
                settings = replace(settings, command=command_line)
            return self.command.run(settings)
        except (ValueError, FileNotFoundError) as err:
            print(f"{self.prog}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (`Terminated`, from `terminate_as_interrupt`)
            close_progress_bars()
            out = getattr(settings, "out", None)
            kept = f"what finished (and the last checkpoint) is kept in {out}" if out else "nothing was being written"
            again = f": {command_line}" if command_line else ""
            print(f"{self.prog}: interrupted; {kept}; run the same command again to resume{again}", file=sys.stderr)
            return 143 if isinstance(err, Terminated) else 130
        except NonFiniteLossError as err:  # training diverged: the settings were valid, the run failed
            print(f"{self.prog}: error: {err}", file=sys.stderr)
            return 1


def configure(parser: argparse.ArgumentParser, command: Command, preset: str | None = None) -> argparse.ArgumentParser:
    """Give ``parser`` the options of ``command`` (or its subcommands) and what runs it; their defaults (shown by
    ``--help``) are preset ``preset``'s where the command has it."""
    if command.subcommands:
        choices = parser.add_subparsers(dest=command.name, required=True)
        for sub in command.subcommands:
            add_command(choices, sub, preset)
        return parser
    assert command.settings is not None and command.run is not None, command.name
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of settings, applied before the options given here (the same names; a section "
        f"is a mapping){', e.g. ' + command.config_example if command.config_example else ''}",
    )
    dests = add_dataclass_options(parser, _defaults(command, preset))
    parser.set_defaults(func=Runner(command, parser.prog, dests))
    return parser


def _defaults(command: Command, preset: str | None) -> Any:
    """The settings ``--help`` shows: preset ``preset``'s when the command has one of that name, else the default."""
    if command.presets and preset:
        try:
            return command.settings(preset)
        except ValueError:  # another command's preset name, or a typo: refused when the settings are resolved
            pass
    return command.settings()


def preset_named(argv: list[str]) -> str | None:
    """The value of ``--preset`` on a command line, if there is one (``--preset micro`` or ``--preset=micro``)."""
    for index, word in enumerate(argv):
        if word == "--preset" and index + 1 < len(argv):
            return argv[index + 1]
        if word.startswith("--preset="):
            return word.partition("=")[2]
    return None


def add_command(
    commands: argparse._SubParsersAction, command: Command, preset: str | None = None
) -> argparse.ArgumentParser:
    """Register ``command`` on the ``add_subparsers()`` object of a parser (defaults: see `configure`)."""
    parser = commands.add_parser(
        command.name,
        help=command.help,
        description=command.description,
        epilog=_epilog(command),
        usage=command.usage,
        formatter_class=HelpFormatter,
    )
    return configure(parser, command, preset)


def _epilog(command: Command) -> str | None:
    """The command's epilog (examples), and for a command with options, how they are spelt."""
    if command.subcommands:
        return command.epilog
    return f"{command.epilog}\n\n{SPELLING}" if command.epilog else SPELLING
