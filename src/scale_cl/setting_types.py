"""Every setting's value against the type its dataclass field declares, before anything is built from it.

The annotation is the contract: ``int``, ``float``, ``bool``, ``str``, ``X | None``, ``list[X]``, ``tuple[X, ...]``,
``dict[str, X]`` and ``Literal[...]``. A value from the command line, a YAML file or a sweep point (``strings``: YAML
1.1 reads ``1e-3`` as a string, and ``"true"`` may be quoted) is converted where the conversion is unambiguous and
refused otherwise; a value built in Python is refused unless it already has the type (a list for a tuple is made a
tuple). A string is never a sequence here: ``methods: scale_route`` is refused, not split into letters. The refusal
is a ValueError naming the setting as the user spelt it, the type expected and an example, such as
``methods must be a list, e.g. [a, b], got 'scale_route'``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import Field, fields, is_dataclass
from typing import Any, NamedTuple

TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
EXAMPLES: dict[Any, str] = {int: "8", float: "0.001", str: "fft", bool: "true"}
LIST_EXAMPLES: dict[Any, str] = {int: "[0, 1]", float: "[0.5, 1]", str: "[a, b]", bool: "[true, false]"}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (``from __future__ import annotations`` keeps strings)."""
    return typing.get_type_hints(cls)


class Leaf(NamedTuple):
    """One setting a command takes: its option name (dotted), its dataclass field, its value and its annotation."""

    name: str
    field: Field
    value: Any
    annotation: Any


def leaf_settings(settings: Any, prefix: str = "", leave_out: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every leaf setting of a command's settings dataclass, as its command line and YAML name them: an inline
    section's settings unprefixed, a nested section's as ``section.name``; a field marked ``cli: False`` and a
    section's settings its command does not take (``leave_out``) skipped."""
    annotations = field_types(type(settings))
    for f in fields(settings):
        if f.metadata.get("cli") is False or f.name in leave_out:
            continue
        value = getattr(settings, f.name)
        if f.metadata.get("inline"):
            yield from leaf_settings(value, prefix)
        elif is_dataclass(value):
            yield from leaf_settings(value, f"{prefix}{f.name}.", f.metadata.get("leave_out", ()))
        else:
            yield Leaf(f"{prefix}{f.name}", f, value, annotations[f.name])


def described(annotation: Any) -> str:
    """The type in words, with an example: ``a whole number, e.g. 8``, ``a list, e.g. [a, b]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(described(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"a list, e.g. {LIST_EXAMPLES.get(args[0] if args else str, '[a, b]')}"
    if origin is dict:
        return f"a mapping, e.g. {{name: {EXAMPLES.get(args[1] if len(args) > 1 else str, 'x')}}}"
    words = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}
    if annotation in words:
        return words[annotation] if annotation is bool else f"{words[annotation]}, e.g. {EXAMPLES[annotation]}"
    return getattr(annotation, "__name__", str(annotation))


def conform(name: str, annotation: Any, value: Any, strings: bool = True) -> Any:
    """``value`` given for the setting ``name`` as the type ``annotation`` declares (module doc); raises a
    ValueError that names the setting, the type and an example."""

    def refuse() -> typing.NoReturn:
        raise ValueError(f"{name} must be {described(annotation)}, got {value!r}")

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or isinstance(annotation, typing.TypeVar):
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            with contextlib.suppress(ValueError):
                return conform(name, option, value, strings)
        refuse()
    if value is None:
        refuse()
    if origin is typing.Literal:
        return value if value in args else refuse()
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if strings and isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
            return value.strip().lower() in TRUE
        refuse()
    if annotation in (int, float):
        return number(name, value, annotation, strings)
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # YAML reads `batch_size: 8` or `model: 1.5` as numbers
        refuse()
    if origin in (list, tuple):
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, list | tuple):
            refuse()
        item = args[0] if args else Any
        items = [conform(f"{name}[{i}]", item, v, strings) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            refuse()
        item = args[1] if len(args) > 1 else Any
        return {key: conform(f"{name}[{key!r}]", item, v, strings) for key, v in value.items()}
    return value  # another type (a nested dataclass, a path): its own checks


def number(name: str, value: Any, kind: type, strings: bool) -> int | float:
    """``value`` itself, or with ``strings`` a numeric string (YAML 1.1 reads ``1e-3`` as one) as a number of the
    field's kind; finite."""
    if strings and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = kind(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and isinstance(value, float)):
        raise ValueError(f"{name} must be {described(kind)}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


__all__ = ["conform", "described", "field_types", "number"]
