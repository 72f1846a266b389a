"""The commands' presets as YAML files (``scale_cl/configs/<command>/<preset>.yaml``), each read as a user's
``--config`` file is (`apply_overrides`) on top of the settings' defaults: a preset is data, checked like any
settings file, and its file says why each value is what it is."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from scale_cl.experiments.overrides import apply_overrides, read_yaml

PRESET_DIR = Path(__file__).resolve().parents[1] / "configs"
Settings = TypeVar("Settings")


def preset_file(command: str, name: str, folder: Path | None = None) -> Path:
    """Where preset ``name`` of ``command`` (``cpt``, ``train``, ``bio``, ``base``) is written (in ``folder``,
    default `PRESET_DIR`)."""
    return (PRESET_DIR if folder is None else folder) / command / f"{name}.yaml"


def load_preset(
    defaults: Settings, command: str, name: str, names: tuple[str, ...], folder: Path | None = None
) -> Settings:
    """``defaults`` (a settings dataclass) with preset ``name``'s file applied; ``names``: the command's presets;
    ``folder``: where its presets are (default `PRESET_DIR`, scale-cl's own)."""
    if name not in names:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(names)}")
    values = copy.deepcopy(_preset_values(preset_file(command, name, folder)))
    return apply_overrides(defaults, {**values, "preset": name})


@cache
def _preset_values(path: Path) -> dict[str, Any]:
    """A preset file's settings, read once a process (the command line builds every command's defaults each time)."""
    return read_yaml(path)
