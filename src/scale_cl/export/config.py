"""``scale-cl export``'s settings (`ExportSettings`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from scale_cl.bounds import check_fields

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_SHARD_SIZE = "5GB"


@dataclass
class ExportSettings:
    """What ``scale-cl export`` writes (`export`); every field is an option of the same name."""

    source: str | None = field(
        default=None,
        metadata={
            "help": "a finished `scale-cl cpt` method folder (<out>/<method>), its model/ folder, or a SCALE "
            "checkpoint written by model.save_pretrained(dir)",
            "positional": True,
            "type": str,
            "metavar": "RUN_OR_CHECKPOINT",
        },
    )
    out: str | None = field(
        default=None,
        metadata={
            "help": "the folder to write (must not exist, or be empty)",
            "positional": True,
            "type": str,
            "metavar": "OUT",
        },
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "dtype of the exported weights (default: the model's)", "type": str, "choices": DTYPES},
    )
    max_shard_size: str = field(
        default=DEFAULT_SHARD_SIZE,
        metadata={"help": "largest weight file; a larger model is split into shards with an index (e.g. 500MB)"},
    )

    def __post_init__(self) -> None:
        check_fields(self)
        # the sizes huggingface_hub's sharding reads (its parser is private): a number and a unit KB, MB, GB or TB
        found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(KB|MB|GB|TB)\s*", self.max_shard_size, flags=re.IGNORECASE)
        if found is None or float(found[1]) <= 0:
            raise ValueError(
                f"max_shard_size must be a size above 0 with a unit KB, MB, GB or TB (e.g. 500MB, 5GB), got "
                f"{self.max_shard_size!r}"
            )
