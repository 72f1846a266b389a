"""An experiment's output folder: one folder per configuration."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from scale_cl.files import write_json
from scale_cl.train.reporting import result_settings


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    found = []
    for key in set(a) | set(b):
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            found += _diff(a[key], b[key], f"{prefix}{key}.")
        elif a.get(key) != b.get(key):
            found.append(f"{prefix}{key}")
    return found


# each kind of run's settings file (bio's is a model folder's name too), to tell a folder of another kind of run
RUN_FILES = {
    "config.json": "bio",
    "cpt_config.json": "cpt",
    "sweep_config.json": "sweep",
    "base_config.json": "base",
    "train_config.json": "train",
    "bench_config.json": "bench",
}


def check_output_folder(out: Path, config_file: str, settings: dict[str, Any] | None) -> None:
    """Refuse ``out`` before any data or model is loaded: a file; a folder that cannot be written; a
    folder holding another kind of run (or a model) and not this one; this kind's results of other ``settings``
    (the method list may differ; None: not yet known, not compared). Nothing is written; `claim_output_folder` then
    records the settings."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder (it is created if missing), or delete the file")
    existing = next(folder for folder in (out, *out.absolute().parents) if folder.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot write into {existing} (permission denied); choose another --out")
    path = out / config_file
    if out.is_dir() and not path.is_file():
        others = [name for name in RUN_FILES if name != config_file and (out / name).is_file()]
        if others:
            raise ValueError(
                f"--out {out} holds {others[0]} (a scale-cl {RUN_FILES[others[0]]} run, or a model), not a run of "
                f"this command: choose another --out"
            )
    if path.is_file() and settings is not None:
        mine = _recorded(settings)
        theirs = {k: v for k, v in result_settings(json.loads(path.read_text())).items() if k != "methods"}
        mine = {k: v for k, v in mine.items() if k != "methods"}
        if theirs != mine:
            diffs = sorted(_diff(theirs, mine))
            raise ValueError(
                f"{out} holds results of another configuration (differs in: {', '.join(diffs[:8])}); "
                "choose another --out or delete that folder"
            )


def _recorded(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as stored (tuples become lists), without those that change no result."""
    return result_settings(json.loads(json.dumps(settings)))


def claim_output_folder(out: Path, config_file: str, settings: dict[str, Any], write: bool = True) -> None:
    """Refuse ``out`` as `check_output_folder` does, else record ``settings`` there (once).

    Settings that change no result (``report_to``: where metrics are sent) are neither recorded nor compared.
    ``write=False`` only checks (a process other than the main one under ``torchrun``).
    """
    check_output_folder(out, config_file, settings)
    path = out / config_file
    if write and not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, _recorded(settings))
