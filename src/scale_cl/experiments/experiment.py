"""What every experiment's settings share (bio, cpt, base): a preset, the same checks, ``to_dict``; and its command's
``--out`` field (`output_folder`).

Each experiment's settings are a dataclass in its ``config.py`` that subclasses `ExperimentConfig`, names its
presets (``presets``) and calls `check_experiment` first in ``__post_init__``. Its fields stay its own (their
order is its ``--help``'s and its saved ``config.json``'s).
"""

from __future__ import annotations

from dataclasses import asdict, field
from typing import Any, ClassVar

from scale_cl.bounds import check_fields
from scale_cl.methods import check_methods


class ExperimentConfig:
    """The shared part of an experiment's settings (module doc)."""

    section: ClassVar[str] = ""  # where its settings are given (messages name them so)
    presets: ClassVar[tuple[str, ...]] = ()

    def check_experiment(self) -> None:
        """The preset is one of ``presets``; the methods, where the experiment compares them, known and at least
        one; every setting within its declared range (`bounds.check_fields`); the seeds, where it takes several,
        at least one."""
        preset = self.preset
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(self.presets)}")
        if hasattr(self, "methods"):
            check_methods(self.methods)
        check_fields(self)
        if hasattr(self, "seeds") and not self.seeds:
            raise ValueError("seeds must name at least one seed")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def output_folder(default: str) -> Any:
    """The ``--out`` field of an experiment's command; ``default``: the folder it writes to without one."""
    return field(default=None, metadata={"help": f"output folder (default: {default})", "type": str, "metavar": "DIR"})
