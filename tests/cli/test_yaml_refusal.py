"""Bad settings in a YAML file are refused before any model loads, for every command, the demo included.

Three parts: every command's own ``--config`` example (its ``--help``) is valid settings; a generated matrix of a
value outside a setting's declared ``choices`` for every such setting of every command, in YAML (the type and range
matrix of ``tests/cli/test_setting_types.py`` covers the rest), each refused naming the setting and its valid values;
and the settings that are checked together (`check()` of the settings, run by every command once its preset, YAML
and options are applied), each refused through the command line with exit status 2, its message, nothing written and
no model built, loaded or even configured (every way to do so fails the test here).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import pytest
import yaml

from scale_cl.cli import commands, main, parse_settings
from scale_cl.experiments.overrides import apply_overrides, nest
from scale_cl.setting_types import leaf_settings


def _leaf_commands() -> Iterator[tuple[str, Any]]:
    for command in commands():
        for sub in command.subcommands or (command,):
            yield " ".join([command.name, sub.name] if command.subcommands else [command.name]), sub


# the arguments a command needs beside its YAML file (its valid minimum)
NEEDS = {"base": ["--data.train", "en.jsonl"]}


# --------------------------------------------------------------------------------- the example


def test_the_demo_s_help_example_was_refused_only_after_smollm2_loaded_and_is_now_refused_before(no_model, capsys):
    (no_model / "demo.yaml").write_text("{hidden_up: 384, methods: [route]}\n")  # the example --help gave
    assert main(["demo", "--config", "demo.yaml"]) == 2
    err = capsys.readouterr().err
    assert "scale-cl demo: error: methods: the demo checks the SCALE methods, one or more of scale_preserve, " in err
    assert "'route' is spelt 'scale_route'" in err and "Traceback" not in err
    assert sorted(p.name for p in no_model.iterdir()) == ["demo.yaml"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("methods: [lora]\n", "methods: the demo checks the SCALE methods, one or more of scale_preserve, scale_adapt"),
        ("methods: []\n", "methods: the demo checks the SCALE methods"),
        ("hidden_up: 100\n", "hidden_up=100 must add whole attention heads to SmolLM2-135M: a multiple of head_dim"),
        ("preserve_layers: 31\n", "preserve_layers must be in [-30, 30], got 31"),
    ],
)
def test_the_demo_refuses_what_smollm2_would_refuse_before_loading_it(text, message, no_model, capsys):
    (no_model / "demo.yaml").write_text(text)
    assert main(["demo", "--config", "demo.yaml"]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in no_model.iterdir()) == ["demo.yaml"]


@pytest.mark.parametrize(("name", "command"), list(_leaf_commands()), ids=[n for n, _ in _leaf_commands()])
def test_every_command_s_config_example_is_valid_settings(name, command, no_model):
    """The example ``--help`` shows for --config (the demo's named a method that does not exist)."""
    assert command.config_example, f"{name} shows no --config example"
    (no_model / "example.yaml").write_text(command.config_example + "\n")
    settings = parse_settings([*name.split(), "--config", "example.yaml", *NEEDS.get(name, [])])
    for key, value in yaml.safe_load(command.config_example).items():
        if not isinstance(value, dict):  # a section's values are checked by their own commands' tests
            held = _setting(settings, key)
            assert list(held) == value if isinstance(held, (list, tuple)) else held == value, (key, held)


def _setting(settings: Any, key: str) -> Any:
    """The value of the top-level setting ``key``: a field of ``settings`` or of one of its inline sections."""
    for f in fields(settings):
        if f.name == key:
            return getattr(settings, key)
        if f.metadata.get("inline"):
            try:
                return _setting(getattr(settings, f.name), key)
            except KeyError:
                continue
    raise KeyError(key)


# --------------------------------------------------------------------------------- every declared choice, in YAML


CHOICES = [
    (command_name, name, [f"{first}x"] if isinstance(value, (list, tuple)) else f"{first}x")
    for command_name, command in _leaf_commands()
    for name, f, value, _ in leaf_settings(command.settings())
    if f.metadata.get("choices") and name != "preset"  # an unknown preset: tests/cli/test_cli.py
    for first in [str(next(iter(f.metadata["choices"])))]
]


@pytest.mark.parametrize(("command_name", "name", "value"), CHOICES, ids=[f"{c}:{n}" for c, n, _ in CHOICES])
def test_a_value_outside_a_setting_s_choices_is_refused_in_yaml(command_name, name, value):
    """Each such setting, given a near miss of its first valid value: refused naming the setting, with the valid
    values (argparse refuses it on the command line; YAML went around argparse)."""
    command = dict(_leaf_commands())[command_name]
    f = next(f for n, f, *_ in leaf_settings(command.settings()) if n == name)
    from_yaml = yaml.safe_load(yaml.safe_dump(nest([(name, value)])))
    with pytest.raises(ValueError) as refused:
        apply_overrides(command.settings(), from_yaml)
    message = str(refused.value)
    leaf = name.rpartition(".")[2]
    assert leaf in message, message
    valid = [str(c) for c in f.metadata["choices"] if not str(c).startswith(("METHOD",))]
    assert any(v in message for v in valid), message


def test_the_choices_matrix_covers_the_commands_whose_yaml_took_any_value():
    """The settings a YAML file could set to anything before (their choices were the command line's alone)."""
    covered = {(c, n) for c, n, _ in CHOICES}
    before = [("demo", "methods"), ("eval", "dtype"), ("export", "dtype"), ("bench", "w21_init"), ("bench", "w22_init")]
    for row in before:
        assert row in covered, row
    assert len(CHOICES) > 60


@pytest.mark.parametrize(
    ("argv", "text", "message"),
    [
        (["eval", "model"], "dtype: float64\n", "dtype must be one of float32, bfloat16, float16, got 'float64'"),
        (["export", "src", "dst"], "dtype: fp16\n", "dtype must be one of float32, bfloat16, float16, got 'fp16'"),
        (["bench"], "w21_init: svd2\n", "w21_init must be one of zero, random, svd, got 'svd2'; did you mean 'svd'?"),
    ],
)
def test_a_bad_choice_in_yaml_exits_2_before_anything_loads(argv, text, message, no_model, capsys):
    (no_model / "bad.yaml").write_text(text)
    assert main([*argv, "--config", "bad.yaml"]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert sorted(p.name for p in no_model.iterdir()) == ["bad.yaml"]


# --------------------------------------------------------------------------------- settings checked together

CPT = ["cpt", "--data.train", "ko.jsonl", "--data.old_eval", "en=en.jsonl"]
TRAIN = ["train", "--data.train", "ko.jsonl", "--data.old_eval", "en=en.jsonl"]
MICRO = ["bio", "--preset", "micro"]

TOGETHER = [
    # continual pre-training (cpt, sweep cpt and train share these)
    (CPT, "train: {batch_size: 10, micro_batch_size: 4}", "train.batch_size=10 must be a multiple of train.micro"),
    (
        ["cpt", "--data.train", "ko.jsonl"],
        "data: {heldout_fraction: 0}",
        "nothing to measure: set data.heldout_fraction > 0 and/or data.old_eval",
    ),
    (TRAIN, "data: {streaming: true}", "data.streaming needs train.max_steps > 0 or train.tokens"),
    (
        [*CPT, "--methods", "scale_route"],
        "options: {route_share: 0.5}",
        "scale_route: options.route_share calibrates its tau on old-domain text, and none is given",
    ),
    (
        [*CPT, "--methods", "scale_adapt"],
        "options: {auto_layers: true}",
        "scale_adapt: options.auto_layers measures forgetting on old-domain text, and none is given",
    ),
    (
        [*CPT, "--methods", "scale_adapt", "--data.replay", "en.jsonl", "--data.max_train_tokens", "4096"],
        "options: {auto_layers: true}\ndata: {streaming: true}",
        "options.auto_layers needs a packed training split: drop data.streaming",
    ),
    (
        CPT,
        "sequence: {then: [law=law.jsonl]}\neval: {nll_split: true}",
        "a sequence of domains (sequence.then) does not take eval.nll_split yet",
    ),
    (
        ["cpt", "--data.train", "ko.jsonl"],
        "sequence: {then: [law=law.jsonl]}",
        "a sequence of domains measures the old domain and every new one: give data.old_eval",
    ),
    (CPT, "sequence: {first: en, then: [law=law.jsonl]}", "sequence names ['en'] are also old-domain set names"),
    (
        [*CPT, "--methods", "scale_route"],
        "sequence: {then: [law=law.jsonl], growth: per_task}",
        "sequence.growth per_task cannot grow scale_route",
    ),
    (TRAIN, "train: {tokens: '1000'}", "train.tokens=1000 is less than one optimizer step (train.batch_size=8"),
    ([*TRAIN, "--dry_run"], "train: {batch_size: 6}", "train.batch_size=6 must be a multiple of train.micro_batch"),
    (
        ["sweep", "cpt", "--data.train", "ko.jsonl", "--data.old_eval", "en=en.jsonl"],
        "sequence: {then: [law=law.jsonl]}",
        "sweep cpt does not run a sequence of domains yet",
    ),
    (["sweep", "cpt", "--methods", "scale_route"], "lr_scales: [1]", "the reference method 'fft' is not swept"),
    (["sweep", "cpt"], "target: 0.5", "--target 0.5: cpt compares methods at a new-domain perplexity, >= 1"),
    # the biography benchmark
    (MICRO, "data: {attributes: [major, shoe_size]}", "data.attributes: unknown attributes ['shoe_size']"),
    (MICRO, "data: {pools: tiny}", "data.pools: unknown biography preset 'tiny'; valid presets"),
    (MICRO, "model: {hidden_size: 30, heads: 4}", "model.hidden_size=30 must be a multiple of model.heads=4"),
    (MICRO, "options: {scale: {hidden_up: 20}}", "options.scale.hidden_up=20 must add whole attention heads"),
    (MICRO, "options: {freeze_layers: 5}", "options.freeze_layers=5 exceeds the model's 2 decoder layers"),
    (MICRO, "sequence: {tasks: 61}", "61 tasks of new people do not fit 120 people"),
    (MICRO, "sequence: {tasks: 3}\ntask1: {replay_ratio: 0.25}", "sequence.tasks=3 does not take task1.replay_ratio"),
    (["sweep", "bio"], "sequence: {tasks: 3}", "sweep bio does not run a sequence of tasks yet"),
    (["sweep", "bio", "--methods", "scale_adapt"], "lr_scales: [1]", "the reference method 'fft' is not swept"),
    (["sweep", "bio"], "target: 5", "--target 5: bio compares methods at a Task-1 accuracy in (0, 1]"),
    # the clean base
    (["base", "--preset", "micro"], "seed: 1", "no English text given: pass --data.train FILE..."),
]


@pytest.mark.parametrize(("argv", "text", "message"), TOGETHER, ids=[m[:48] for _, _, m in TOGETHER])
def test_settings_that_cannot_work_together_are_refused_before_anything_loads(argv, text, message, no_model, capsys):
    (no_model / "bad.yaml").write_text(text + "\n")
    command = [*argv, "--config", "bad.yaml"]
    with pytest.raises(ValueError) as refused:
        parse_settings(command)  # refused by the settings alone: a dry run and a Python caller of the CLI too
    assert message in str(refused.value)
    assert main([*command, "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert sorted(p.name for p in no_model.iterdir()) == ["bad.yaml"], "something was written"


def test_the_same_settings_given_together_pass(no_model):
    """The check runs on the final settings: a YAML file's value that the options complete is not refused."""
    path = no_model / "ok.yaml"
    path.write_text("train: {batch_size: 6}\n")  # no multiple of the preset's micro-batch, 4, but of the option's
    cfg = parse_settings([*CPT, "--config", str(path), "--train.micro_batch_size", "3"]).cpt
    assert (cfg.train.batch_size, cfg.train.micro_batch_size) == (6, 3)
    path.write_text("data: {streaming: true}\n")  # no token budget in the preset: the option gives it
    cfg = parse_settings([*TRAIN, "--config", str(path), "--train.tokens", "10M"]).train
    assert cfg.data.streaming and cfg.train.token_budget == 10**7
