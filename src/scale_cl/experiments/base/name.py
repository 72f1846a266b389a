"""The model name ``clean-en``: the clean English base that `scale-cl base` builds, wherever a base model is named.

The experiments resolve it (`resolve_model_name`) before handing a model name to `scale_cl.models`, which knows
hub ids, folders, GGUF files and ``smollm2``, and nothing of what the experiments build.
"""

from __future__ import annotations

from pathlib import Path

CLEAN_EN = "clean-en"  # a model name meaning the clean English base built by `scale-cl base` (outputs/clean-en)
CLEAN_EN_DIR = Path("outputs/clean-en/model")


def resolve_model_name(name: str) -> str:
    """``name`` itself, or for ``clean-en`` the built base's folder (under the current folder), or a
    FileNotFoundError that says how to build it."""
    if name != CLEAN_EN:
        return name
    from scale_cl.experiments.base.build import is_built

    if not is_built(CLEAN_EN_DIR):
        raise FileNotFoundError(
            f"model {CLEAN_EN!r} is the clean English base that `scale-cl base` builds into {CLEAN_EN_DIR.parent} "
            f"(relative to {Path.cwd()}), and it is not built there: run `python measurements/cpt_corpus.py --corpora "
            "english-base` then `scale-cl base` (~25 min on 2 CPU cores), or pass --model with the model folder"
        )
    return str(CLEAN_EN_DIR.resolve())
