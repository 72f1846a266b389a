"""Whose modeling code scale-cl runs when it loads a folder: its own only.

An exported SCALE model (``scale-cl export``) is a transformers folder whose ``config.json`` names
``modeling_scale.py`` in ``auto_map``, so loading it needs ``trust_remote_code=True``. scale-cl passes it only where
that file is, byte for byte, the ``modeling_scale.py`` of the scale-cl installed here: the code it runs is then code
already installed, whoever wrote or uploaded the folder, and a local folder and a hub id are judged alike. Any other
custom code (an arbitrary hub model, an export of another scale-cl version, an edited file) is refused before
anything runs, with what to do; scale-cl never trusts remote code on a name alone.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from transformers.utils import cached_file

MODELING_FILE = "modeling_scale.py"
MODELING_MODULE = "scale_cl.export.modeling_scale"


def _file(name_or_path: str, filename: str, **hub: Any) -> Path | None:
    """``filename`` of a local folder or hub repository (through the hub cache), or None where it has none."""
    found = cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub)
    return Path(found) if found else None


def custom_code_modules(name_or_path: str, **hub: Any) -> set[str]:
    """The Python modules a model's ``config.json`` names in ``auto_map`` (empty: a stock transformers model)."""
    config = _file(name_or_path, "config.json", **hub)
    if config is None:
        return set()
    auto_map = json.loads(config.read_text()).get("auto_map") or {}
    names = [n for value in auto_map.values() for n in (value if isinstance(value, list) else [value]) if n]
    return {name.split("--")[-1].rsplit(".", 1)[0] for name in names}


def trust_own_code(name_or_path: str, **hub: Any) -> bool:
    """True where the model's custom code is this scale-cl's own ``modeling_scale.py``, False where it has none;
    a ValueError where it has other code (see the module doc)."""
    modules = custom_code_modules(name_or_path, **hub)
    if not modules:
        return False
    own = Path(find_spec(MODELING_MODULE).origin).read_bytes()
    code = _file(name_or_path, MODELING_FILE, **hub) if modules == {MODELING_FILE.removesuffix(".py")} else None
    if code is not None and code.read_bytes() == own:
        return True
    why = (
        f"its {MODELING_FILE} differs from this scale-cl's (an export of another scale-cl version, or an edited file)"
        if code is not None
        else f"it names custom modeling code ({', '.join(sorted(modules))}) that scale-cl did not write"
    )
    raise ValueError(
        f"{name_or_path}: {why}, and scale-cl runs no custom code but its own. Export the model again with this "
        "scale-cl (`scale-cl export RUN OUT`), or load it yourself with "
        "AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True) if you trust that code."
    )


def own_code_kwargs(name_or_path: str, **hub: Any) -> dict[str, bool]:
    """``{"trust_remote_code": True}`` for a transformers ``from_pretrained`` of a folder holding this scale-cl's own
    modeling code, ``{}`` for a stock model; a ValueError for other custom code (`trust_own_code`)."""
    return {"trust_remote_code": True} if trust_own_code(name_or_path, **hub) else {}
