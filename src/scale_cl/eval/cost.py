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
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's counter knows the CUDA attention kernels but not the CPU flash kernel SDPA uses on CPU;
# its operands have the same layout, so the same formulas apply (dense q k^T and p v products).
_CPU_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs (2 per multiply-add) of the matmuls and attention products ``fn`` executes."""
    with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
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


__all__ = ["count_flops", "forward_flops_per_token", "train_flops_per_token"]
