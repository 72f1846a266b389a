"""What a model costs per token, counted rather than timed: forward and training FLOPs of a real pass.

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` on a real pass of the model as
run: every matmul actually executed (route's doubled collaborative layers and its head, LoRA's
A/B products; preserve never computes W12), so it is exact op counting rather than a formula. Used by
`scale-cl bench` and by the biography task sequence (cost after each task).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


def attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of one attention call, dense as torch counts it: ``q k^T`` and ``p v`` for every query head.

    Shapes are (batch, heads, tokens, head size). With grouped key/value heads (GQA: fewer key/value heads than
    query heads, ``enable_gqa``) every query head still takes its own products; the key/value heads are read, not
    multiplied. Our own formula rather than torch's: before 2.13 torch's ``sdpa_flop_count`` refused grouped heads
    (an AssertionError on every CUDA run of a GQA model, where transformers calls SDPA with ``enable_gqa``)."""
    batch, heads, queries, query_size = query_shape
    keys, value_size = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * queries * keys * (query_size + value_size)


def attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    """Backward FLOPs of one attention call, as torch counts them: the scores recomputed, then the gradients of
    ``p v`` (two products) and of ``q k^T`` (two): 2.5x the forward's when query and value heads have one size."""
    batch, heads, queries, query_size = query_shape
    keys, value_size = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * queries * keys * (3 * query_size + 2 * value_size)


def _attention_ops() -> dict:
    """Every fused attention kernel SDPA may pick (CPU, CUDA's flash / efficient / cuDNN, other accelerators'), the
    ones this torch has, mapped to our formulas. The math fallback is made of matmuls the counter sees itself."""
    kernels = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention")
    kernels += ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    kernels += ("_scaled_dot_product_fused_attention_overrideable",)
    ops = {}
    for name in kernels:
        for suffix, formula in (("", attention_flops), ("_backward", attention_backward_flops)):
            op = getattr(aten, name + suffix, None)
            if op is not None:
                ops[op] = formula
    return ops


def in_place_product_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``addmm_``'s FLOPs, ``addmm``'s: the product accumulated into ``self`` (the SCALE head's ``Z + alpha Z_up``
    written into ``Z``, `scale_cl.tuner.layers.ScaleHead`), which torch's counter registers only out of place."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


ATTENTION_OPS = _attention_ops()


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs (2 per multiply-add) of the matmuls and attention products ``fn`` executes."""
    counted = {**ATTENTION_OPS, aten.addmm_: in_place_product_flops}
    with FlopCounterMode(display=False, custom_mapping=counted) as counter:
        fn()
    return int(counter.get_total_flops())


def forward_flops_per_token(model: nn.Module, ids: torch.Tensor) -> float:
    """Forward FLOPs per token of ``model`` on ``ids`` (eval mode, no gradient)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        flops = count_flops(lambda: model(input_ids=ids))
    model.train(was_training)
    return flops / ids.numel()


def train_flops_per_token(model: nn.Module, ids: torch.Tensor) -> float:
    """Forward + backward FLOPs per token of one training step on ``ids`` (the optimizer excluded).

    Counts only what autograd runs: frozen products whose input needs no gradient cost nothing
    backward, which is where the frozen methods save.
    """
    model.train()
    flops = count_flops(lambda: model(input_ids=ids, labels=ids).loss.backward())
    model.zero_grad(set_to_none=True)
    return flops / ids.numel()


__all__ = [
    "ATTENTION_OPS",
    "attention_backward_flops",
    "attention_flops",
    "count_flops",
    "forward_flops_per_token",
    "in_place_product_flops",
    "train_flops_per_token",
]
