"""The valid range of every numeric setting, declared on its dataclass field and checked in one place.

A field declares its range in its metadata with ``ge`` / ``gt`` / ``le`` / ``lt`` (greater or equal, greater
than, ...: annotated-types' names), e.g. ``field(default=1e-3, metadata={"help": ..., "gt": 0})``. For a list,
tuple or dict field the range holds for every item (value). `checked` tests a value given for a setting
(from the command line, a YAML file or a sweep point: `scale_cl.experiments.overrides.apply_overrides`) and
names the setting as the user spells it; `check_fields` tests a dataclass's own values (its
``__post_init__``, for settings built in Python). Both raise a ValueError such as
``task1.lr must be > 0, got -1.0``, before anything is written.

A range that depends on the model (``preserve_layers`` against its layers) is checked where the model's
config is known, by `scale_cl.tuner.widths.check_fits`. The type is checked first (`scale_cl.setting_types`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, fields, is_dataclass
from typing import Any

from scale_cl.setting_types import conform, field_types, number

BOUND_KEYS = ("ge", "gt", "le", "lt")


def bounds(metadata: Mapping[str, Any]) -> dict[str, float]:
    """The declared range of a field (``{"ge": 0, "lt": 1}``), empty when it declares none."""
    return {key: metadata[key] for key in BOUND_KEYS if key in metadata}


def describe(metadata: Mapping[str, Any]) -> str:
    """The range in words: ``> 0``, ``>= 1``, ``in [0, 1)``, ``in [-1, 1]``."""
    found = bounds(metadata)
    low = next(((key, found[key]) for key in ("ge", "gt") if key in found), None)
    high = next(((key, found[key]) for key in ("le", "lt") if key in found), None)
    if low and high:
        return (
            f"in {'[' if low[0] == 'ge' else '('}{_shown(low[1])}, {_shown(high[1])}{']' if high[0] == 'le' else ')'}"
        )
    sign = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    key, value = low or high  # type: ignore[misc]
    return f"{sign[key]} {_shown(value)}"


def _shown(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _inside(value: float, found: dict[str, float]) -> bool:
    return (
        ("ge" not in found or value >= found["ge"])
        and ("gt" not in found or value > found["gt"])
        and ("le" not in found or value <= found["le"])
        and ("lt" not in found or value < found["lt"])
    )


def _kind(f: Field) -> type:
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return float if "float" in annotation else int


def checked(name: str, f: Field, value: Any, strings: bool = True, annotation: Any = None) -> Any:
    """``value`` given for the setting ``name`` (dotted, as the user spells it), first as the type ``annotation``
    declares (`scale_cl.setting_types.conform`: a number, a list, ...), then against the range ``f`` declares
    (each item of a list or tuple, each value of a dict); with ``strings``, numeric strings are converted (a YAML
    file's), else refused. Returns the value as checked (a list for a tuple field made a tuple)."""
    if annotation is not None:
        value = conform(name, annotation, value, strings)
    found = bounds(f.metadata)
    if not found or value is None:
        return value
    kind = _kind(f)

    def one(item: Any) -> Any:
        value = number(name, item, kind, strings)
        if not _inside(value, found):
            raise ValueError(f"{name} must be {describe(f.metadata)}, got {value!r}")
        return value

    if isinstance(value, Mapping):
        return {key: checked(f"{name}[{key!r}]", f, item, strings) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(one(item) for item in value)
    return one(value)


def check_fields(instance: Any) -> None:
    """Check every field of the dataclass ``instance`` (not nested dataclasses) as it was built: its declared type
    (a string is no number or list here; a list for a tuple field is made a tuple) and range. The message names
    ``<section><field>``: the class's ``section`` (``"task1."``: where the command line and YAML put it) or, for a
    class used in several places, its name."""
    section = getattr(instance, "section", f"{type(instance).__name__}.")
    annotations = field_types(type(instance))
    for f in fields(instance):
        value = getattr(instance, f.name)
        if is_dataclass(value):
            continue
        kept = checked(f"{section}{f.name}", f, value, strings=False, annotation=annotations[f.name])
        if type(kept) is not type(value):  # a list given for a tuple field, a number for a string
            object.__setattr__(instance, f.name, kept)
