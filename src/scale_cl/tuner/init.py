"""Initialisers of the expansion blocks W21 and W22 (paper Fig. 5): ``svd``, ``random`` and ``zero``.

``svd``: with ``W = U S V^T``, ``W21 = S_k V_k^T`` (``k = out_up``) and ``W22 = diag(s_1 .. s_m)``, the singular
pairs from a randomised SVD or the Gram matrix's eigendecomposition, never a full SVD; `top_singular_all` computes
those of every matrix in parallel. The definition, its accuracy and its cost: docs/design.md §1.1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

# Use the randomised SVD when the directions needed are at most this share of the matrix's rank.
_LOWRANK_SHARE = 0.25
_LOWRANK_OVERSAMPLE = 10
_LOWRANK_ITERS = 4


SingularPairs = tuple[torch.Tensor, torch.Tensor]


def top_singular(weight: torch.Tensor, k: int, generator: torch.Generator | None = None) -> SingularPairs:
    """The top-k singular values ``S`` (k,) and right singular vectors ``Vh`` (k, in) of ``weight``.

    ``k`` is clipped to ``min(weight.shape)``. Computed in float32. The randomised path draws from
    ``generator`` (the global RNG when None).
    """
    w = weight.detach().float()
    k = min(k, min(w.shape))
    if k == 0:
        return w.new_zeros(0), w.new_zeros(0, w.shape[1])
    if k + _LOWRANK_OVERSAMPLE <= _LOWRANK_SHARE * min(w.shape):
        return _top_singular_randomized(w, k, generator)
    return _top_singular_by_gram(w, k)


def top_singular_all(items: list[tuple[torch.Tensor, int]], seeds: list[int]) -> Iterator[SingularPairs]:
    """`top_singular` of every ``(weight, k)``, yielded in order; matrix ``i`` draws from ``seeds[i]``.

    On a CPU the matrices are shared among single-threaded workers (one per torch thread), which
    run ahead of the consumer; torch's thread count is restored when the iteration ends.
    """
    if len(seeds) != len(items):
        raise ValueError(f"top_singular_all needs one seed per matrix: {len(items)} matrices, {len(seeds)} seeds")

    def one(index: int) -> SingularPairs:
        weight, k = items[index]
        generator = torch.Generator(device=weight.device).manual_seed(seeds[index])
        return top_singular(weight, k, generator)

    threads = torch.get_num_threads()
    if threads <= 1 or len(items) <= 1 or any(weight.device.type != "cpu" for weight, _ in items):
        yield from map(one, range(len(items)))
        return

    def single_threaded(index: int) -> SingularPairs:
        torch.set_num_threads(1)
        return one(index)

    try:
        with ThreadPoolExecutor(threads) as pool:
            yield from pool.map(single_threaded, range(len(items)))
    finally:
        torch.set_num_threads(threads)  # the workers' setting must not stay with the process


def _top_singular_randomized(w: torch.Tensor, k: int, generator: torch.Generator | None) -> SingularPairs:
    """Halko, Martinsson & Tropp (2011), Alg. 4.4: an orthonormal basis of W's top range, refined by
    power iterations (re-orthonormalised each half step), then the SVD of the small projection."""
    sketch = torch.randn(w.shape[1], k + _LOWRANK_OVERSAMPLE, generator=generator, device=w.device, dtype=w.dtype)
    basis = torch.linalg.qr(w @ sketch).Q
    for _ in range(_LOWRANK_ITERS):
        basis = torch.linalg.qr(w @ torch.linalg.qr(w.T @ basis).Q).Q
    _, s, vh = torch.linalg.svd(basis.T @ w, full_matrices=False)
    return s[:k], vh[:k]


def _top_singular_by_gram(w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k singular pairs from ``eigh`` of the smaller Gram matrix (eigenvalues ascending -> flipped)."""
    out, inp = w.shape
    if inp <= out:  # W^T W = V S^2 V^T
        eigenvalues, vectors = torch.linalg.eigh(w.T @ w)
        s = eigenvalues.flip(0)[:k].clamp_min(0).sqrt()
        return s, vectors.flip(1)[:, :k].T.contiguous()
    # W W^T = U S^2 U^T, and the rows of U_k^T W are s_i v_i^T: read them off W itself.
    eigenvalues, vectors = torch.linalg.eigh(w @ w.T)
    s = eigenvalues.flip(0)[:k].clamp_min(0).sqrt()
    scaled_rows = vectors.flip(1)[:, :k].T @ w
    return s, scaled_rows / s.clamp_min(torch.finfo(w.dtype).tiny)[:, None]


def _kaiming(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    block = torch.empty(rows, cols, device=device)
    if rows and cols:
        nn.init.kaiming_uniform_(block, a=math.sqrt(5))
    return block


def expansion_blocks(
    weight: torch.Tensor,
    out_up: int,
    in_up: int,
    w21_init: str,
    w22_init: str,
    singular: SingularPairs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial W21 (``out_up x in``) and W22 (``out_up x in_up``) for the frozen ``weight``.

    ``singular`` is ``top_singular(weight, out_up)`` when already computed (`top_singular_all`).
    """
    _out, in_features = weight.shape
    device = weight.device
    s = vh = None
    if "svd" in (w21_init, w22_init):
        s, vh = singular if singular is not None else top_singular(weight, out_up)

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
