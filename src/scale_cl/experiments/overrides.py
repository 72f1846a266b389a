"""Settings as nested dataclasses: apply nested overrides (a YAML file's, a command line's, a sweep point's).

Used by the command line (`scale_cl.cli.options`) and by the sweep, which re-applies a point's
settings to the experiment's; an unknown key is an error naming the known ones, and a value outside the
setting's declared range (`scale_cl.bounds`) an error naming the setting and its range, before any
dataclass (or anything else) is built from it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import Field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from scale_cl.bounds import checked
from scale_cl.setting_types import field_types


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


def check_choices(name: str, f: Field, value: Any) -> None:
    """Refuse ``value`` (each item of a list or tuple) for the setting ``name`` unless it is one of the field's
    declared ``choices`` (``None`` stands for "not given" where the field defaults to None); the error names the
    valid values and the nearest one."""
    choices = f.metadata.get("choices")
    if not choices or value is None:
        return
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if item in choices:
            continue
        near = difflib.get_close_matches(str(item), [str(c) for c in choices], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        each = " (each item)" if isinstance(value, (list, tuple)) else ""
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}{each}, got {item!r}{hint}")


def _names(config: Any) -> set[str]:
    """The setting names known at this level of ``config``: its fields and, through inline fields, theirs."""
    names = set()
    for f in fields(config):
        names |= _names(getattr(config, f.name)) if f.metadata.get("inline") else {f.name}
    return names


def apply_overrides(config: Any, overrides: dict[str, Any], where: str = "", leave_out: tuple[str, ...] = ()) -> Any:
    """A copy of the dataclass ``config`` with nested ``overrides`` applied; unknown keys are errors.

    A key that is not a field of ``config`` goes to the inline field (see the module docstring) that knows it.
    """
    known = {f.name: f for f in fields(config)}
    annotations = field_types(type(config))
    inline = [f.name for f in fields(config) if f.metadata.get("inline")]
    changes: dict[str, Any] = {}
    routed: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if key in leave_out:  # a shared settings class's setting this command does not take
            taken = ", ".join(sorted(_names(config) - set(leave_out)))
            raise ValueError(f"{where}{key} is not a setting of this command; known here: {taken}")
        if key not in known or key in inline:
            owner = next((n for n in inline if key in _names(getattr(config, n))), None)
            if owner is None:
                raise ValueError(f"unknown setting '{where}{key}'; known here: {', '.join(sorted(_names(config)))}")
            routed.setdefault(owner, {})[key] = value
            continue
        current = getattr(config, key)
        if is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"{where}{key} is a section: give it a mapping of its settings, got {value!r}")
            changes[key] = apply_overrides(current, value, f"{where}{key}.", known[key].metadata.get("leave_out", ()))
        elif isinstance(current, dict):  # a mapping setting: the given keys replace those of the preset
            if not isinstance(value, dict):
                raise ValueError(f"{where}{key} must be a mapping of KEY: VALUE pairs, got {value!r}")
            changes[key] = {**current, **checked(f"{where}{key}", known[key], value, annotation=annotations[key])}
        else:
            # its declared type and range (`scale_cl.bounds`)
            changes[key] = checked(f"{where}{key}", known[key], value, annotation=annotations[key])
    for owner, values in routed.items():
        changes[owner] = apply_overrides(changes.get(owner, getattr(config, owner)), values, where)
    try:
        result = replace(config, **changes)
    except ValueError as err:  # a class used in several places names itself (ScaleConfig.router): say it as given
        own = f"{type(config).__name__}."
        if not where or own not in str(err):
            raise
        raise ValueError(str(err).replace(own, where)) from err
    for key in changes:  # the dataclass's own checks passed: its declared choices too (an inline section's: its own)
        if key not in routed and not is_dataclass(getattr(result, key)):
            check_choices(f"{where}{key}", known[key], getattr(result, key))
    return result
