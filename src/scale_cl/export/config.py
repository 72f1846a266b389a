"""``scale-cl export``'s settings (`ExportSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
