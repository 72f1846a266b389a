"""An experiment's output folder: one folder per configuration."""

from __future__ import annotations

import json
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


def claim_output_folder(out: Path, config_file: str, settings: dict[str, Any], write: bool = True) -> None:
    """Refuse ``out`` when it holds results of other ``settings`` (the method list may differ); else record them.

    Settings that change no result (``report_to``: where metrics are sent) are neither recorded nor compared.
    ``write=False`` only checks (a process other than the main one under ``torchrun``).
    """
    path = out / config_file
    settings = result_settings(json.loads(json.dumps(settings)))  # as stored: tuples become lists
    mine = {k: v for k, v in settings.items() if k != "methods"}
    if path.is_file():
        theirs = {k: v for k, v in result_settings(json.loads(path.read_text())).items() if k != "methods"}
        if theirs != mine:
            diffs = sorted(_diff(theirs, mine))
            raise ValueError(
                f"{out} holds results of another configuration (differs in: {', '.join(diffs[:8])}); "
                "choose another --out or delete that folder"
            )
    elif write:
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, settings)
