"""Every place scale-cl reads transformers' private code, in one module (tests/tuner/test_hf_compat.py checks each).

The streams-apart layer (`scale_cl.tuner.streams`) and the split-heads attention (`scale_cl.tuner.attention`) call
what a decoder layer's own forward calls, and must know when transformers records the attention weights. None of
it is public API: a transformers release can move it. Each access below is checked by a test on the transformers the
project installs, which fails with the name that moved; at run time a moved name raises `TransformersChanged`
rather than falling back in silence (the stock layer forward would be slower, not wrong, but unnoticed).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import transformers
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "RECORDING_HOOK",
    "TransformersChanged",
    "family_function",
    "recording_attentions",
]

# The name of transformers' forward hook on every attention module, idle unless a forward records outputs
# (`output_attentions`): `transformers.utils.output_capturing.install_output_capuring_hook`.
RECORDING_HOOK = "output_capturing_hook"


class TransformersChanged(RuntimeError):
    """transformers no longer has a private name scale-cl reads (this module's doc): a release scale-cl does not
    support yet."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"transformers {transformers.__version__} has no {what}, which scale-cl reads (scale_cl.tuner.hf_compat); "
            "install a transformers version pyproject.toml declares, or report it"
        )


def _active_collector() -> Any:
    """transformers' record of what the running forward pass collects (a context variable of a dict, or None)."""
    try:
        from transformers.utils.output_capturing import _active_collector as collector
    except ImportError as error:
        raise TransformersChanged("transformers.utils.output_capturing._active_collector") from error
    return collector


def recording_attentions() -> bool:
    """Whether the forward pass under way records the attention weights (``output_attentions``)."""
    collected = _active_collector().get()
    return collected is not None and "attentions" in collected


def family_function(module: nn.Module, name: str) -> Callable[..., Any]:
    """The function ``name`` of the file that defines ``module``'s class (``apply_rotary_pos_emb``,
    ``eager_attention_forward``): the one its own forward calls."""
    function = getattr(sys.modules[type(module).__module__], name, None)
    if function is None:
        raise TransformersChanged(f"{name} beside {type(module).__qualname__} ({type(module).__module__})")
    return function
