"""`ScaleLinear` on route's stacked batch ``[preserve path; adapt path]``: Eq. 1 with W12 on the adapt half only.

Route runs both paths of Eq. 5 in one pass, their rows stacked (`stack_paths_hook`). `ScaleLinear.form` takes these
forms there; each is `ScaleLinear.blocks` row by row, the preserve half's with W12 taken as zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def routed_rows(linear: Any, x: torch.Tensor, x_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ScaleLinear.blocks` on the stacked rows: W12 is added to the adapt half only."""
    out = linear.original_product(x)
    half = out.shape[0] // 2
    out = torch.cat((out[:half], out[half:] + F.linear(x_up[half:], linear.w12)))
    return out, F.linear(x, linear.w21, linear.bias_up) + F.linear(x_up, linear.w22)


def constant_half_rows(linear: Any, x: torch.Tensor, x_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`routed_rows` on a training batch whose preserve half's ``x`` is taken as the constant it is (the constant
    half), so autograd runs no backward through its frozen product with W (nor into it from W21), and saves nothing
    for it. The arithmetic is `ScaleLinear.blocks`', one half at a time."""
    half = x.shape[0] // 2
    x_p, x_a = x[:half].detach(), x[half:]
    out_a = linear.original_product(x_a)
    if linear.use_w12:
        out_a = out_a + F.linear(x_up[half:], linear.w12)
    out = torch.cat((linear.original_product(x_p), out_a))
    w21 = torch.cat((F.linear(x_p, linear.w21, linear.bias_up), F.linear(x_a, linear.w21, linear.bias_up)))
    return out, w21 + F.linear(x_up, linear.w22)
