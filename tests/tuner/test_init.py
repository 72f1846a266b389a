"""The W21/W22 initialisers (scale_cl.tuner.init): the svd definition, its randomised path, determinism."""

from __future__ import annotations

import pytest
import torch

from scale_cl.tuner.init import expansion_blocks, top_singular, top_singular_all
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def _decaying(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(out, min(out, inp), generator=g))
    v, _ = torch.linalg.qr(torch.randn(inp, min(out, inp), generator=g))
    s = 0.8 ** torch.arange(min(out, inp), dtype=torch.float32) * 5
    return (u * s) @ v.T


def test_svd_w21_rows_are_top_singular_directions_scaled():
    """W21 = S_k V_k^T and W22 = diag(s), as exact as torch's fp32 SVD of W is (to W's float64 SVD)."""
    w = _decaying(24, 20)
    w21, w22 = expansion_blocks(w, out_up=6, in_up=4, w21_init="svd", w22_init="svd")
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    _, s64, vh64 = torch.linalg.svd(w.double(), full_matrices=False)
    exact = s64[:6, None] * vh64[:6]

    def signed(rows: torch.Tensor) -> torch.Tensor:  # singular vectors are defined up to sign: the exact rows'
        return rows * torch.sign((rows.double() * exact).sum(-1, keepdim=True)).to(rows.dtype)

    assert_exact_to_rounding(signed(w21), exact, stock=signed(s[:6, None] * vh[:6]), what="W21")
    expected22, exact22 = torch.zeros(6, 4), torch.zeros(6, 4, dtype=torch.float64)
    expected22[range(4), range(4)], exact22[range(4), range(4)] = s[:4], s64[:4]
    assert_exact_to_rounding(w22, exact22, stock=expected22, what="W22")


@pytest.mark.parametrize("shape", [(300, 120), (120, 300)])  # W^T W and W W^T
def test_gram_path_matches_the_full_svd_on_many_directions(shape):
    w = _decaying(*shape)
    k = 60  # far above the randomised path's share: the Gram eigendecomposition
    s_gram, vh_gram = top_singular(w, k)
    _, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    # float32 Gram: s_i is exact to ~eps * s_1^2 / s_i, so the strong directions are as exact as the SVD's
    # and the weak ones (s_i down to 1e-5 s_1 here) are only right to ~sqrt(eps) * s_1 in absolute terms.
    # (Accuracy of another algorithm, not rounding of the same one: fixed bounds from that estimate, the strong
    # directions' eps * (s_1 / s_i)^2 <= 100 eps ~ 1e-5 relative; the float64 SVD is the reference.)
    strong = s[:k] > 0.1 * s[0]
    torch.testing.assert_close(s_gram.double()[strong], s[:k][strong], rtol=1e-5, atol=0)
    torch.testing.assert_close(s_gram.double(), s[:k], rtol=0, atol=1e-3 * s[0].item())
    assert (vh_gram.double()[strong] * vh[:k][strong]).sum(-1).abs().min() > 0.9999
    # W21's rows s_i v_i, up to sign.
    rows, expected = s_gram[:, None].double() * vh_gram.double(), s[:k, None] * vh[:k]
    signs = torch.sign((rows * expected).sum(-1, keepdim=True))
    torch.testing.assert_close(rows * signs, expected, rtol=0, atol=1e-3 * s[0].item())


def test_gram_path_keeps_rank_deficient_rows_small():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 3, generator=g) @ torch.randn(3, 40, generator=g)  # rank 3, wide
    w21, _ = expansion_blocks(w, out_up=12, in_up=4, w21_init="svd", w22_init="zero")
    assert w21[:3].norm(dim=-1).min() > 1.0
    assert w21[3:].abs().max() < 1e-3 * w21[0].norm()


def test_svd_rows_beyond_the_rank_are_zero():
    w = _decaying(4, 8)  # at most 4 directions
    w21, w22 = expansion_blocks(w, out_up=7, in_up=7, w21_init="svd", w22_init="svd")
    assert w21[:4].abs().sum() > 0 and torch.equal(w21[4:], torch.zeros(3, 8))
    assert torch.count_nonzero(w22) == 4 and torch.equal(w22[4:], torch.zeros(3, 7))


def test_randomised_svd_matches_full_svd_on_a_large_matrix():
    w = _decaying(256, 200)
    torch.manual_seed(0)
    s_low, vh_low = top_singular(w, 8)  # 8 + oversampling << 200: the randomised path
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    # An approximation (a random subspace refined by power iterations), exact only in the limit, not the same
    # arithmetic as the SVD: with this spectrum (0.8 per direction) it converges to ~1e-6 relative (measured 7e-7;
    # the fp32 full SVD's own error 4e-7 to 8e-7), so rtol 1e-4 bounds the approximation, far below a wrong or
    # swapped pair (20% apart).
    torch.testing.assert_close(s_low, s[:8], rtol=1e-4, atol=1e-5)
    overlap = (vh_low * vh[:8]).sum(-1).abs()
    assert overlap.min() > 0.999


def test_randomised_svd_is_deterministic_under_a_seed():
    w = torch.randn(300, 300)
    torch.manual_seed(3)
    first = expansion_blocks(w, 16, 16, "svd", "svd")
    torch.manual_seed(3)
    second = expansion_blocks(w, 16, 16, "svd", "svd")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_random_is_kaiming_uniform_with_the_blocks_fan_in():
    torch.manual_seed(0)
    w21, w22 = expansion_blocks(torch.randn(64, 100), 32, 16, "random", "random")
    assert w21.abs().max() <= 1 / 100**0.5 and w21.std() > 0.3 / 100**0.5
    assert w22.abs().max() <= 1 / 16**0.5 and w22.std() > 0.3 / 16**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_take_the_weights_dtype_and_zero_is_zero(dtype):
    w = torch.randn(8, 8).to(dtype)
    w21, w22 = expansion_blocks(w, 4, 4, "svd", "zero")
    assert w21.dtype == dtype and w22.dtype == dtype
    assert torch.count_nonzero(w22) == 0


def test_parallel_singular_pairs_do_not_depend_on_threads_or_scheduling():
    """`top_singular_all` runs single-threaded workers on a CPU; each matrix has its own generator,
    so the pairs equal the sequential single-threaded computation bitwise, and torch's thread count
    is restored afterwards."""
    items = [(_decaying(160, 120, seed), k) for seed, k in enumerate((4, 60, 8, 100, 3))]  # both paths
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        sequential = list(top_singular_all(items, seeds=list(range(7, 12))))
        torch.set_num_threads(2)
        parallel = list(top_singular_all(items, seeds=list(range(7, 12))))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for (s_a, vh_a), (s_b, vh_b), (w, k) in zip(sequential, parallel, items, strict=True):
        assert torch.equal(s_a, s_b) and torch.equal(vh_a, vh_b)
        _, s, _ = torch.linalg.svd(w)
        torch.testing.assert_close(s_a, s[:k], rtol=1e-4, atol=1e-3 * s[0].item())  # weak directions: see the Gram test
    assert not torch.equal(next(top_singular_all(items[:1], seeds=[8]))[1], sequential[0][1])  # the seed matters
