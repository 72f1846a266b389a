"""Merged inference: Eq. 1 as one dense product with the block matrix (docs/design.md §1.4).

With gradients off, a `ScaleLinear` that uses W12 multiplies ``[x; x_up]`` by ``[[W, W12], [W21, W22]]`` at once, one
product instead of four and their sums, the matrix built once and cached until a block changes. It equals
`ScaleLinear.blocks` to floating-point rounding, not bitwise. `ScaleLinear.form` decides when it is taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def merged_product(linear: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``linear`` (a `ScaleLinear`) on ``hidden`` as one dense product with its block matrix; route's stacked batch
    multiplies its preserve half (W12 taken as zero) by the original rows and ``[W21 W22]`` instead (no zero block
    read)."""
    full, bias, bottom = merged_weights(linear)
    if linear.route is None or not linear.route.active:
        return F.linear(hidden, full, bias)
    half = hidden.shape[0] // 2
    preserve = hidden[:half]
    preserve = torch.cat(
        (
            linear.original_product(linear._as_base_input(preserve[..., : linear.in_features])),
            F.linear(preserve, bottom, linear.bias_up),
        ),
        dim=-1,
    )
    return torch.cat((preserve, F.linear(hidden[half:], full, bias)))


def merged_weights(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The whole block matrix, its bias and ``[W21 W22]`` (a view), cached on ``linear``.

    Rebuilt when any block changes: every in-place write (an optimizer step, ``load_state_dict``, ``copy_``) bumps a
    tensor's version counter, and moving or casting the model gives new storage. (A write through ``.data`` bypasses
    the counter: call `ScaleLinear.clear_merged` after one.)
    """
    blocks = (linear.weight, linear.bias, linear.w12, linear.w21, linear.w22, linear.bias_up)
    key = tuple((t.data_ptr(), t._version, t.dtype) for t in blocks if t is not None)
    if linear._merged is None or linear._merged[0] != key:
        full, bias = linear.merged_weight(with_w12=True)
        linear._merged = (key, full, bias, full[linear.out_features :])
    return linear._merged[1:]


def _mergeable(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(type(m), "merge_for_inference")]


def set_merged_inference(model: nn.Module, enabled: bool) -> None:
    """From now on every `ScaleLinear` of ``model`` does (or, False, does not) take the merged inference form; off,
    its cache is dropped too (a sharded model gathers its weights per forward: a merged copy would hold them whole)."""
    for linear in _mergeable(model):
        linear.merge_for_inference = enabled
        if not enabled:
            linear.clear_merged()


@contextmanager
def merged_inference(model: nn.Module, enabled: bool) -> Iterator[nn.Module]:
    """Within the block, every `ScaleLinear` of ``model`` does (or, False, does not) take the merged
    inference form with gradients off; restored afterwards."""
    linears = _mergeable(model)
    saved = [m.__dict__.get("merge_for_inference") for m in linears]
    for linear in linears:
        linear.merge_for_inference = enabled
    try:
        yield model
    finally:
        for linear, value in zip(linears, saved, strict=True):
            if value is None:
                del linear.merge_for_inference  # back to the class's setting
            else:
                linear.merge_for_inference = value
