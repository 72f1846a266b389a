"""Command-line options generated from nested dataclass configs (``--section.field value``).

Options default to "not given", so a preset can supply the defaults and a YAML file and the
command line override only what they name, in that order.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_dataclass_options(
    parser: argparse.ArgumentParser,
    instance: Any,
    prefix: str = "",
    aliases: dict[str, list[str]] | None = None,
    root: argparse.ArgumentParser | None = None,
) -> None:
    """One option per leaf field of ``instance``; help from ``field.metadata["help"]``, default shown.

    A nested dataclass becomes a group of options ``--<field>.<leaf>`` (groups are made on ``root``,
    the top-level parser, since argparse does not nest them).
    """
    aliases = aliases or {}
    root = root or parser
    for f in fields(instance):
        value = getattr(instance, f.name)
        name = f"{prefix}{f.name}"
        if f.metadata.get("cli") is False:  # set by the experiment itself (e.g. a run's seed)
            continue
        if is_dataclass(value):
            summary = (type(value).__doc__ or "").strip().split("\n\n")[0] or None
            group = root.add_argument_group(f"{name} settings", summary)
            add_dataclass_options(group, value, f"{name}.", aliases, root)
            continue
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": f"{f.metadata.get('help', '')} (default: {value})",
        }
        if isinstance(value, dict):
            _add_mapping_options(parser, name, f.metadata, kwargs)
            continue
        if isinstance(value, bool):
            kwargs["type"] = _bool
        elif isinstance(value, (list, tuple)):
            kwargs["nargs"] = "+"
            kwargs["type"] = type(value[0]) if value else str
        else:
            kwargs["type"] = type(value)
        kwargs["metavar"] = "BOOL" if isinstance(value, bool) else kwargs["type"].__name__.upper()
        parser.add_argument(f"--{name}", *aliases.get(name, []), **kwargs)


class _MappingItems(argparse.Action):
    """Collects ``KEY=VALUE`` items (or, for a per-key alias, one VALUE) into one dict setting."""

    def __init__(self, *args: Any, key: str | None = None, value_type: type = str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key, self.value_type = key, value_type

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        mapping = dict(getattr(namespace, self.dest, None) or {})
        for item in [values] if self.key else values:
            key, value = (self.key, item) if self.key else item.partition("=")[::2]
            if not key or not value:
                parser.error(f"{option}: expected KEY=VALUE items, got {item!r}")
            try:
                mapping[key] = self.value_type(value)
            except ValueError:
                parser.error(f"{option}: {value!r} is not a valid {self.value_type.__name__}")
        setattr(namespace, self.dest, mapping)


def _add_mapping_options(parser: Any, name: str, metadata: Any, kwargs: dict[str, Any]) -> None:
    """A dict setting: ``--a.b K=V ...``, and ``--a.<key><suffix> V`` per key named in its metadata."""
    value_type = metadata.get("value_type", str)
    metavar = f"KEY={value_type.__name__.upper()}"
    parser.add_argument(f"--{name}", nargs="+", action=_MappingItems, value_type=value_type, metavar=metavar, **kwargs)
    section = name.rpartition(".")[0]
    for key in metadata.get("keys", ()):
        alias = f"--{section + '.' if section else ''}{key}{metadata.get('key_suffix', '')}"
        parser.add_argument(
            alias,
            action=_MappingItems,
            key=key,
            value_type=value_type,
            dest=name,
            default=argparse.SUPPRESS,
            metavar=value_type.__name__.upper(),
            help=f"the same as --{name} {key}=VALUE",
        )


def nested_overrides(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{"a.b": 1}``-style parsed options as ``{"a": {"b": 1}}``."""
    return nest((k, v) for k, v in vars(args).items() if k not in skip and not k.startswith("_"))


def nest(dotted_values: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``[("a.b", 1)]`` as ``{"a": {"b": 1}}``."""
    nested: dict[str, Any] = {}
    for dotted, value in dotted_values:
        *sections, leaf = dotted.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return nested


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read the config file {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def apply_overrides(config: Any, overrides: dict[str, Any], where: str = "") -> Any:
    """A copy of the dataclass ``config`` with nested ``overrides`` applied; unknown keys are errors."""
    known = {f.name: f for f in fields(config)}
    changes = {}
    for key, value in overrides.items():
        if key not in known:
            raise ValueError(f"unknown setting '{where}{key}'; known here: {', '.join(sorted(known))}")
        current = getattr(config, key)
        if is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"setting {where}{key} is a section; give it a mapping, got {value!r}")
            changes[key] = apply_overrides(current, value, f"{where}{key}.")
        elif isinstance(current, dict):  # a mapping setting: the given keys replace those of the preset
            if not isinstance(value, dict):
                raise ValueError(f"setting {where}{key} is a mapping; give it KEY: VALUE pairs, got {value!r}")
            changes[key] = {**current, **value}
        else:
            changes[key] = value
    return replace(config, **changes)


def resolve_settings(
    args: argparse.Namespace, preset: Callable[[str], Any], default_preset: str, skip: tuple[str, ...] = ()
) -> Any:
    """An experiment's settings: the preset, then the YAML file (``--config``), then the command-line options.

    ``skip``: options of the command that are not experiment settings.
    """
    options = nested_overrides(args, skip=("command", "func", "config", "out", *skip))
    from_yaml = read_yaml(args.config) if args.config else {}
    config = preset(options.get("preset") or from_yaml.get("preset") or default_preset)
    return apply_overrides(apply_overrides(config, from_yaml), options)
