"""The command line as a user types it: options reach the settings they name (preset, then YAML, then flags)."""

from __future__ import annotations

import pytest

from scale_cl.cli import build_parser
from scale_cl.cli.options import resolve_settings
from scale_cl.experiments.bio.config import preset


def bio_settings(argv: list[str]):
    args = build_parser().parse_args(["bio", *argv])
    return resolve_settings(args, preset, "small")


def test_scale_options_are_a_scale_config_and_rates_are_data():
    cfg = bio_settings(
        [
            "--preset", "micro",
            "--options.scale.hidden_up", "32",
            "--options.scale.collab_modules", "attn",
            "--options.scale.preserve_layers", "-2",
            "--task1.scale_route_lr", "3e-4",
            "--task1.method_lr", "lora=2e-3", "freeze=5e-4",
        ]
    )  # fmt: skip
    scale = cfg.options.scale
    assert (scale.hidden_up, scale.collab_modules, scale.preserve_layers) == (32, ("attn",), -2)
    assert cfg.task1.lr_of("scale_route") == 3e-4
    assert cfg.task1.lr_of("lora") == 2e-3 and cfg.task1.lr_of("freeze") == 5e-4
    assert cfg.task1.lr_of("fft") == preset("micro").task1.lr  # not named: the stage's lr
    # the run's SCALE method and seed are set per run, never from the settings
    assert cfg.options.scale_config("adapt", seed=2).method == "adapt"
    assert cfg.options.scale_config("adapt", seed=2).seed == 2


def test_yaml_rates_merge_with_the_preset_and_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("task1:\n  method_lr:\n    fft: 7.0e-5\n")
    cfg = bio_settings(["--config", str(path), "--task1.lora_lr", "9e-4"])
    small = preset("small").task1
    assert cfg.task1.lr_of("fft") == 7e-5  # from the YAML
    assert cfg.task1.lr_of("lora") == 9e-4  # from the command line
    assert cfg.task1.lr_of("scale_route") == small.lr_of("scale_route")  # from the preset


@pytest.mark.parametrize(
    "argv",
    [
        ["--options.scale.method", "adapt"],  # set per run from the method name
        ["--options.scale.seed", "3"],  # set per run from --seeds
        ["--task1.method_lr", "lora"],  # not METHOD=LR
        ["--task1.method_lr", "lora=fast"],  # not a number
        ["--options.scale.hidden_up", "wide"],
    ],
)
def test_malformed_options_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bio", *argv])
    assert "error" in capsys.readouterr().err


def test_invalid_values_are_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="collab_modules"):
        bio_settings(["--options.scale.collab_modules", "mlp"])
    with pytest.raises(ValueError, match="unknown method 'dreambooth'"):
        bio_settings(["--task1.method_lr", "dreambooth=1e-3"])
