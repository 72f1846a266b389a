"""Every setting checked by its declared type: hand-written rows, a generated matrix of wrong-type and out-of-range
values for every option of every command (on the command line and in YAML, through the parser in process), tried by
one test per kind of annotation and a test that the matrix is complete, a property-based test of the conversion, and
two subprocess runs that prove the exit code and the empty disk."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import Field
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from scale_cl import ScaleConfig
from scale_cl.bounds import bounds
from scale_cl.cli import build_parser, commands, main
from scale_cl.experiments.overrides import apply_overrides, nest
from scale_cl.setting_types import conform, leaf_settings

# --------------------------------------------------------------------------------- the rows


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("task1: {lr: [1, 2]}\n", "task1.lr must be a number, e.g. 0.001, got [1, 2]"),
        ("seeds: 3\n", "seeds must be a list, e.g. [0, 1], got 3"),
        ("methods: scale_route\n", "methods must be a list, e.g. [a, b], got 'scale_route'"),
        ("options: {scale: {collab_modules: attn}}\n", "options.scale.collab_modules must be a list"),
        ("data: {distinct_templates: nope}\n", "data.distinct_templates must be true or false, got 'nope'"),
    ],
    ids=["list-for-a-number", "number-for-a-list", "string-for-a-list", "string-for-a-tuple", "string-for-a-bool"],
)
def test_bad_yaml_rows_are_refused_before_anything_is_written(yaml_text, message, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    out = tmp_path / "out"
    assert main(["bio", "--preset", "micro", "--config", str(config), "--out", str(out), "--cache", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # nothing written


def test_a_refusal_names_the_option_as_it_was_given(capsys):
    """ScaleConfig is used in several places and names itself; given as options.scale.*, the message says so."""
    assert main(["cpt", "--options.scale.router", "likelyhood", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    registered = "('cosine', 'likelihood', 'nested', 'confidence', 'hybrid', 'calibrated')"
    assert f"options.scale.router must be one of {registered}, got 'likelyhood'" in err
    assert "ScaleConfig" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["sweep", "bio", "--preset", "micro", "--target", "5"],
            "--target 5: bio compares methods at a Task-1 accuracy",
        ),
        (["sweep", "cpt", "--target", "0.5"], "--target 0.5: cpt compares methods at a new-domain perplexity, >= 1"),
        *(
            (["export", "src", "dst", f"--max_shard_size={size}"], "max_shard_size must be a size above 0 with a unit")
            for size in ("-5MB", "0MB", "lots", "5")
        ),
    ],
)
def test_impossible_values_are_refused(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, *(["--out", "out"] if argv[0] == "sweep" else [])]) == 2
    assert message in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_an_option_the_command_does_not_take_is_not_offered(capsys):
    """bio does not take cpt's auto_layers: not in its help, refused in YAML (cpt keeps it)."""
    from scale_cl.cli import parse_settings

    for command, offered in (("bio", False), ("cpt", True)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert ("--options.auto_layers" in capsys.readouterr().out) is offered
    with pytest.raises(ValueError, match=r"options\.auto_layers is not a setting of this command"):
        apply_overrides(parse_settings(["bio", "--preset", "micro"]), {"options": {"auto_layers": True}})


def test_python_configs_are_checked_alike():
    with pytest.raises(ValueError, match=r"ScaleConfig.collab_modules must be a list, e.g. \[a, b\], got 'attn'"):
        ScaleConfig(hidden_up=32, ffn_up=16, collab_modules="attn")
    assert ScaleConfig(hidden_up=32, ffn_up=16, collab_modules=["attn"]).collab_modules == ("attn",)  # a tuple
    with pytest.raises(ValueError, match=r"ScaleConfig\.route_exact must be true or false, got 1"):
        ScaleConfig(hidden_up=32, ffn_up=16, route_exact=1)


# --------------------------------------------------------------------------------- every option of every command


def _leaf_commands() -> Iterator[tuple[str, Any]]:
    """(the command line's words, the command) of every command that takes settings."""
    for command in commands():
        for sub in command.subcommands or (command,):
            words = [command.name, sub.name] if command.subcommands else [command.name]
            yield " ".join(words), sub


def _without_none(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) in (typing.Union, types.UnionType) else annotation


def _wrong_types(annotation: Any) -> list[Any]:
    """Values of a type the setting does not take (YAML's view: strings, numbers, lists, mappings)."""
    kind = _without_none(annotation)
    origin = typing.get_origin(kind)
    if kind is bool:
        return ["maybe", [True]]
    if kind in (int, float):
        return ["many", [1, 2], {"a": 1}]
    if kind is str:
        return [[1, 2], {"a": 1}]
    if origin in (list, tuple):
        return ["just-a-string", {"a": 1}]
    if origin is dict:
        return ["just-a-string", [1]]
    return []


def _out_of_range(f: Field, annotation: Any) -> list[Any]:
    """Values just outside the range the field declares (each one bound), as items for a list setting."""
    found, values = bounds(f.metadata), []
    step = 1
    for key, limit in found.items():
        values.append({"ge": limit - step, "gt": limit, "le": limit + step, "lt": limit}[key])
    origin = typing.get_origin(_without_none(annotation))
    return [[v] for v in values] if origin in (list, tuple) else values


def _kind(annotation: Any) -> str:
    """The annotation's kind, as the checks see it: bool, int, float, str, list, tuple, dict or other."""
    kind = _without_none(annotation)
    origin = typing.get_origin(kind)
    if origin in (list, tuple, dict):
        return origin.__name__
    return kind.__name__ if kind in (bool, int, float, str) else "other"


def _by_kind(cases: list[tuple[str, str, Any, str]]) -> dict[str, list[tuple[str, str, Any]]]:
    grouped: dict[str, list[tuple[str, str, Any]]] = {}
    for command_name, name, value, kind in cases:
        grouped.setdefault(kind, []).append((command_name, name, value))
    return grouped


# every setting of every command with each wrong value of its type, and each value just outside its declared range
MATRIX = [
    (command_name, name, value, kind)
    for command_name, command in _leaf_commands()
    for name, f, _, annotation in leaf_settings(command.settings())
    for values, kind in ((_wrong_types(annotation), _kind(annotation)), (_out_of_range(f, annotation), "range"))
    for value in values
]
YAML_CASES = _by_kind(MATRIX)


@pytest.mark.parametrize("kind", sorted(YAML_CASES))
def test_every_setting_of_a_kind_refuses_a_wrong_type_or_range_in_yaml(kind):
    """Each setting of this kind (of every command) given each wrong value in YAML: a ValueError naming it."""
    accepted = []
    for command_name, name, value in YAML_CASES[kind]:
        command = dict(_leaf_commands())[command_name]
        from_yaml = yaml.safe_load(yaml.safe_dump(nest([(name, value)])))  # as a YAML file would give it
        try:
            apply_overrides(command.settings(), from_yaml)
        except ValueError as err:
            if re.match(re.escape(name) + r"(\[|\s)", str(err)):
                continue
            accepted.append(f"{command_name}:{name}={value!r} refused as {err}")
            continue
        accepted.append(f"{command_name}:{name}={value!r} taken")
    assert not accepted, "\n".join(accepted)


def _wrong_words(f: Field, annotation: Any) -> list[str]:
    """Words the option does not take on the command line: a non-number for a number (or a list of numbers), a
    non-boolean for a boolean, a value outside the declared range (a list option's words are its items, so a
    string is a one-item list there)."""
    kind = _without_none(annotation)
    item = typing.get_args(kind)[0] if typing.get_origin(kind) in (list, tuple) else kind
    words = {bool: ["maybe"], int: ["many", "1.5"], float: ["many"]}.get(item, [])
    ranged = [v[0] if isinstance(v, list) else v for v in _out_of_range(f, annotation)]
    return [*words, *(str(v) for v in ranged)]


# an option shared by several commands (bio and sweep bio, cpt and base, ...) is parsed by the same code: once each
COMMAND_LINE = list(
    {
        (name, word): (command_name, name, word, _kind(annotation))
        for command_name, command in reversed(list(_leaf_commands()))
        for name, f, _, annotation in leaf_settings(command.settings())
        if not f.metadata.get("positional") and typing.get_origin(_without_none(annotation)) is not dict
        for word in _wrong_words(f, annotation)
    }.values()
)
COMMAND_LINE_CASES = _by_kind(COMMAND_LINE)
PARSERS: dict[str, Any] = {}


@pytest.mark.parametrize("kind", sorted(COMMAND_LINE_CASES))
def test_every_option_of_a_kind_refuses_a_wrong_type_or_range_on_the_command_line(kind, capsys):
    """Refused by argparse (exit 2, the option named) or by the settings' checks (a ValueError naming it, which
    the command prints with exit 2): never a traceback of another kind."""
    accepted = []
    for command_name, name, value in COMMAND_LINE_CASES[kind]:
        words = command_name.split()
        if command_name not in PARSERS:
            PARSERS[command_name] = build_parser(words)
        parser = PARSERS[command_name]
        try:
            args = parser.parse_args([*words, f"--{name}", str(value)])
        except SystemExit as exit_info:
            if not (exit_info.code == 2 and f"--{name}" in capsys.readouterr().err):
                accepted.append(f"{command_name} --{name} {value}: exit {exit_info.code}")
            continue
        try:
            args.func.settings(args)
        except ValueError as err:
            if name not in str(err):
                accepted.append(f"{command_name} --{name} {value}: refused as {err}")
            continue
        accepted.append(f"{command_name} --{name} {value}: taken")
    assert not accepted, "\n".join(accepted)


def test_the_matrix_covers_every_command_every_kind_and_hundreds_of_values():
    """Complete: every command's settings are tried; every setting is of a kind with wrong values (or a declared
    range); so a setting whose check is dropped fails its kind's test above."""
    assert {c for c, *_ in MATRIX} == {name for name, _ in _leaf_commands()}
    assert len(MATRIX) > 500 and len(COMMAND_LINE) > 150
    untried = [
        f"{command_name}:{name}"
        for command_name, command in _leaf_commands()
        for name, f, _, annotation in leaf_settings(command.settings())
        if not _wrong_types(annotation) and not _out_of_range(f, annotation) and _kind(annotation) != "other"
    ]
    assert not untried, untried
    assert set(YAML_CASES) >= {"bool", "int", "float", "str", "list", "tuple", "dict", "range"}


# --------------------------------------------------------------------------------- the conversion's properties

ANNOTATIONS = [int, float, bool, str, int | None, list[str], tuple[float, ...], dict[str, float], list[int]]
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=6,
)


def _has_type(annotation: Any, value: Any) -> bool:
    kind, origin = _without_none(annotation), typing.get_origin(_without_none(annotation))
    if value is None:
        return kind is not annotation  # optional
    if origin in (list, tuple):
        return isinstance(value, origin) and all(_has_type(typing.get_args(kind)[0], v) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_has_type(typing.get_args(kind)[1], v) for v in value.values())
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


@given(st.sampled_from(ANNOTATIONS), VALUES, st.booleans())
def test_a_value_is_converted_to_its_declared_type_or_refused_naming_the_setting(annotation, value, strings):
    try:
        result = conform("section.setting", annotation, value, strings)
    except ValueError as err:
        assert str(err).startswith("section.setting")  # named, with the type expected
        return
    assert _has_type(annotation, result)
    assert conform("section.setting", annotation, result, strings) == result  # converting again changes nothing
    if isinstance(value, str):
        assert typing.get_origin(_without_none(annotation)) not in (list, tuple)  # a string is never a sequence


# --------------------------------------------------------------------------------- the exit code and the disk


@pytest.mark.slow
def test_a_refused_setting_exits_2_with_one_line_and_writes_nothing(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("methods: fft\n")
    argv = ["cpt", "--config", str(config), "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "scale_cl.cli", *argv], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "scale-cl cpt: error: methods must be a list, e.g. [a, b], got 'fft'"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
