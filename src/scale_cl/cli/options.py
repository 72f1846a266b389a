"""Command-line options generated from (nested) settings dataclasses, and the YAML / override merge.

Every leaf field is an option ``--<section>.<field>`` whose help is ``field.metadata["help"]``; a preset's defaults
come first, then ``--config`` YAML, then the options given. The field metadata keys it reads: docs/design.md §5.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import Field, fields, is_dataclass
from typing import Any


class HelpFormatter(argparse.HelpFormatter):
    """Wraps the unindented lines of descriptions and epilogs; keeps line breaks and indented lines (examples)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if not line.strip() or line[0].isspace():
                lines.append(indent + line if line.strip() else "")
            else:
                lines.append(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent))
        return "\n".join(lines)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (or nothing: the option alone means true), got {text!r}")


def _shown(value: Any) -> str:
    """A default as it is typed on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(_shown, value)) if value else "none"
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) if value else "none"
    return str(value)


def _help(f: Field, value: Any) -> str:
    text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %: a share is "50%"
    if value is None or f.metadata.get("show_default") is False:
        return text
    return f"{text} (default: {_shown(value).replace('%', '%%')})"


def dashed(option: str) -> str:
    """``--lr_scales`` -> ``--lr-scales`` (the hidden alias of an option)."""
    return "--" + option.removeprefix("--").replace("_", "-")


def _add(parser: Any, names: list[str], **kwargs: Any) -> None:
    """An option under ``names``, and each name's dashed spelling as a hidden alias (same dest)."""
    parser.add_argument(*names, **kwargs)
    hidden = [dashed(n) for n in names if dashed(n) != n]
    if hidden:
        parser.add_argument(*hidden, **{**kwargs, "help": argparse.SUPPRESS})


def add_dataclass_options(
    parser: argparse.ArgumentParser,
    instance: Any,
    prefix: str = "",
    aliases: dict[str, list[str]] | None = None,
    root: argparse.ArgumentParser | None = None,
    leave_out: tuple[str, ...] = (),
) -> list[str]:
    """One option per leaf field of ``instance`` (docs/design.md §5); returns their dests.

    A nested dataclass becomes a group of options ``--<field>.<leaf>`` (groups are made on ``root``,
    the top-level parser, since argparse does not nest them). ``aliases``: more option strings per
    dest, beside those in the fields' metadata.
    """
    aliases = aliases or {}
    root = root or parser
    dests: list[str] = []
    for f in fields(instance):
        value = getattr(instance, f.name)
        name = f"{prefix}{f.name}"
        if f.metadata.get("cli") is False or f.name in leave_out:  # set by the program itself; not this command's
            continue
        if f.metadata.get("inline"):
            title = f.metadata.get("group")
            group = root.add_argument_group(title, _summary(value)) if title else parser
            dests += add_dataclass_options(group, value, prefix, aliases, root)
            continue
        if is_dataclass(value):
            group = root.add_argument_group(f"{name} settings", _summary(value))
            dests += add_dataclass_options(group, value, f"{name}.", aliases, root, f.metadata.get("leave_out", ()))
            continue
        dests.append(name)
        names = [f"--{name}", *(f"--{prefix}{a}" for a in f.metadata.get("aliases", ())), *aliases.get(name, [])]
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": _help(f, value)}
        if isinstance(value, dict):
            _add_mapping_options(parser, name, f.metadata, kwargs)
            continue
        kwargs.update(_value_options(f, value, name))
        if f.metadata.get("positional"):
            del kwargs["dest"]
            if value is None:
                kwargs["nargs"] = "?"
            parser.add_argument(name, **kwargs)
            continue
        _add(parser, names, **kwargs)
        if f.metadata.get("negative"):
            _add(
                parser,
                [f"--{prefix}{f.metadata['negative']}"],
                dest=name,
                action="store_const",
                const=False,
                default=argparse.SUPPRESS,
                help=f"the same as --{name} false",
            )
    return dests


def _summary(instance: Any) -> str | None:
    """The first paragraph of a settings dataclass's docstring: its group's description in the help."""
    return (type(instance).__doc__ or "").strip().split("\n\n")[0] or None


_SCALARS = {"int": int, "float": float, "str": str}  # field annotations (strings, with postponed evaluation)


def _value_options(f: Field, value: Any, name: str) -> dict[str, Any]:
    """``type``, ``nargs``, ``choices``, ``metavar`` and ``action`` of a non-mapping field's option."""
    meta = f.metadata
    kwargs: dict[str, Any] = {}
    if isinstance(value, bool) or meta.get("type") is bool:
        kwargs.update(type=_bool, nargs="?", const=True, metavar="BOOL")
        return kwargs
    if isinstance(value, (list, tuple)):
        kwargs["nargs"] = "+"
        value_type = meta.get("type") or (type(value[0]) if value else str)
    elif value is None:
        if "type" not in meta:
            raise TypeError(f"setting {name} defaults to None: give its type in the field's metadata")
        value_type = meta["type"]
    else:
        annotation = f.type.__name__ if isinstance(f.type, type) else str(f.type)
        value_type = meta.get("type") or _SCALARS.get(annotation) or type(value)  # a float field may default to 1
    kwargs["type"] = value_type
    for key in ("nargs", "choices", "action"):
        if key in meta:
            kwargs[key] = meta[key]
    if kwargs.get("action") == "append" and "nargs" not in meta:
        del kwargs["nargs"]  # one value per occurrence
    kwargs["metavar"] = meta.get("metavar", None if "choices" in kwargs else value_type.__name__.upper())
    return kwargs


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
    _add(parser, [f"--{name}"], nargs="+", action=_MappingItems, value_type=value_type, metavar=metavar, **kwargs)
    section = name.rpartition(".")[0]
    for key in metadata.get("keys", ()):
        alias = f"--{section + '.' if section else ''}{key}{metadata.get('key_suffix', '')}"
        _add(
            parser,
            [alias],
            action=_MappingItems,
            key=key,
            value_type=value_type,
            dest=name,
            default=argparse.SUPPRESS,
            metavar=value_type.__name__.upper(),
            help=f"the same as --{name} {key}=VALUE",
        )
