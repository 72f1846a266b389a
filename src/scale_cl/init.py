"""Initialisers of the expansion blocks W21 and W22 (paper Fig. 5, DESIGN.md §1).

`svd` is defined as follows (the paper only says "dimension-reduced SVD of W"). With the frozen
weight ``W = U S V^T`` (singular values descending):

* ``W21`` (``out_up x in``, reads the original stream ``x``): row ``i`` is ``s_i v_i^T``, i.e.
  ``W21 = S_k V_k^T`` with ``k = out_up``: the top-k principal directions of ``W`` in ``x``'s space,
  with ``W``'s own scale. When ``out_up`` exceeds ``min(out, in)`` (the most directions ``W`` has),
  the remaining rows are zero.
* ``W22`` (``out_up x in_up``, reads the new stream, whose basis carries no meaning yet): the
  rectangular diagonal ``diag(s_1 .. s_m)``, ``m = min(out_up, in_up, min(out, in))``: the same
  top singular values as ``W``, in the standard basis.

`random` is He/Kaiming uniform with the block's own fan-in (``torch.nn.Linear``'s default), and
`zero` is zeros. The SVD is randomised (``torch.svd_lowrank``) when few directions are needed
from a large matrix, which is much cheaper than a full SVD; all randomness comes from the global
RNG, which `upscale` seeds inside ``torch.random.fork_rng``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Use the randomised SVD when the directions needed are at most this share of the matrix's rank.
_LOWRANK_SHARE = 0.25
_LOWRANK_OVERSAMPLE = 10
_LOWRANK_ITERS = 4


def top_singular(weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k singular values ``S`` (k,) and right singular vectors ``Vh`` (k, in) of ``weight``.

    ``k`` is clipped to ``min(weight.shape)``. Computed in float32.
    """
    w = weight.detach().float()
    k = min(k, min(w.shape))
    if k == 0:
        return w.new_zeros(0), w.new_zeros(0, w.shape[1])
    if k + _LOWRANK_OVERSAMPLE <= _LOWRANK_SHARE * min(w.shape):
        _, s, v = torch.svd_lowrank(w, q=k + _LOWRANK_OVERSAMPLE, niter=_LOWRANK_ITERS)
        return s[:k], v[:, :k].T
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    return s[:k], vh[:k]


def _kaiming(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    block = torch.empty(rows, cols, device=device)
    if rows and cols:
        nn.init.kaiming_uniform_(block, a=math.sqrt(5))
    return block


def expansion_blocks(
    weight: torch.Tensor, out_up: int, in_up: int, w21_init: str, w22_init: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial W21 (``out_up x in``) and W22 (``out_up x in_up``) for the frozen ``weight``."""
    _out, in_features = weight.shape
    device = weight.device
    s = vh = None
    if "svd" in (w21_init, w22_init):
        s, vh = top_singular(weight, out_up)

    if w21_init == "zero":
        w21 = torch.zeros(out_up, in_features, device=device)
    elif w21_init == "random":
        w21 = _kaiming(out_up, in_features, device)
    else:
        w21 = torch.zeros(out_up, in_features, device=device)
        w21[: len(s)] = s[:, None] * vh

    if w22_init == "zero":
        w22 = torch.zeros(out_up, in_up, device=device)
    elif w22_init == "random":
        w22 = _kaiming(out_up, in_up, device)
    else:
        w22 = torch.zeros(out_up, in_up, device=device)
        m = min(len(s), in_up)
        w22[range(m), range(m)] = s[:m]
    return w21.to(weight.dtype), w22.to(weight.dtype)
