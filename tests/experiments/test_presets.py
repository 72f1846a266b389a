"""The commands' presets are YAML files read by one loader (`scale_cl.experiments.presets`): each file loads into
valid settings, every declared preset has a file and every file is declared, and a bad file is refused by name."""

from __future__ import annotations

import re

import pytest

from scale_cl.experiments.base import config as base_config
from scale_cl.experiments.bio import config as bio_config
from scale_cl.experiments.cpt import config as cpt_config
from scale_cl.experiments.presets import PRESET_DIR, load_preset, preset_file
from scale_cl.experiments.train import config as train_config

COMMANDS = {"base": base_config, "bio": bio_config, "cpt": cpt_config, "train": train_config}


def test_every_declared_preset_has_a_file_and_every_file_is_declared():
    on_disk = {(path.parent.name, path.stem) for path in PRESET_DIR.glob("*/*.yaml")}
    declared = {(command, name) for command, module in COMMANDS.items() for name in module.PRESETS}
    assert on_disk == declared


@pytest.mark.parametrize(("command", "name"), [(c, n) for c, m in COMMANDS.items() for n in m.PRESETS])
def test_each_preset_loads_as_its_own_settings(command, name):
    settings = COMMANDS[command].preset(name)
    assert settings.preset == name
    assert preset_file(command, name).read_text().startswith("#"), "a preset file says why its values are what they are"
    check = getattr(settings, "check", None)
    if check is not None and command != "base":  # base's check asks for the user's text, which micro leaves out
        check()


def test_an_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown preset 'tiny'; valid presets: smollm2, clean-en, paper"):
        cpt_config.preset("tiny")


def test_a_preset_file_with_an_unknown_setting_is_refused_by_its_name(tmp_path):
    (tmp_path / "cpt").mkdir()
    (tmp_path / "cpt" / "smollm2.yaml").write_text("train:\n  lr_typo: 1.0e-3\n")
    with pytest.raises(ValueError, match=re.escape("unknown setting 'train.lr_typo'")):
        load_preset(cpt_config.CptConfig(), "cpt", "smollm2", cpt_config.PRESETS, tmp_path)


def test_a_preset_value_outside_its_range_is_refused(tmp_path):
    (tmp_path / "bio").mkdir()
    (tmp_path / "bio" / "micro.yaml").write_text("task1:\n  batch_size: 0\n")
    with pytest.raises(ValueError, match=re.escape("task1.batch_size")):
        load_preset(bio_config.BioConfig(), "bio", "micro", bio_config.PRESETS, tmp_path)
