"""Exactness to rounding: an fp32 result checked against the same math in float64, with a bound derived on the spot.

Two computations equal in exact arithmetic differ in floating point by how their kernels round, and the kernels
differ by CPU: ATen's AVX512, AVX2 or scalar code, MKL's code path (another on AMD than on Intel). A fixed ``atol``
holds on the machine it was tuned on and fails on the next. So no bound here is a constant: the result under test may
lie at most ``margin`` times as far from the float64 reference as the stock fp32 computation of the same math does on
this machine, with these kernels, plus ``ulps`` epsilons of the reference's magnitude (a floor for a stock result
that happens to round exactly):

    max |got - exact|  <=  margin * max |stock - exact|  +  ulps * eps(dtype) * max |exact|

The defaults (``margin`` 2, ``ulps`` 8) are tests/tuner/test_streams.py's, where this rule started: another order of the
same sums rounds about as far from the exact value as the stock order does. A comparison that needs more says why
where it passes its own. Set ``SCALE_CL_EXACTNESS_LOG`` to a file to append every comparison's errors and the share
of its bound it used (the headroom, as a JSON line), e.g. under other kernels (`scripts/test_kernels.sh`).

Where no float64 computation exists (a training run: the commands train in fp32 or bf16), `assert_within_noise`
takes the stock run's own rounding noise instead: how far it moves with its sums in another valid order (one
micro-batch instead of two accumulated). transformers' RMSNorm (and ours, to stay bitwise with it) normalises in fp32
whatever the dtype, so a Llama's float64 copy rounds at fp32 there: its reference is exact to that, and the stock
computation's distance includes it (the bound loosens by about that much).
"""

from __future__ import annotations

import json
import os

import torch

MARGIN = 2.0
ULPS = 8.0


def eps(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating-point dtype (fp32's for anything else)."""
    return torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps


def max_error(result: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest elementwise distance of ``result`` from ``exact``, taken in float64."""
    if result.shape != exact.shape:
        raise AssertionError(f"shapes differ: {tuple(result.shape)} against the reference's {tuple(exact.shape)}")
    if result.numel() == 0:
        return 0.0
    return (result.detach().double() - exact.detach().double()).abs().max().item()


def rounding_bound(
    exact: torch.Tensor,
    stock: torch.Tensor | None,
    *,
    dtype: torch.dtype | None = None,
    margin: float = MARGIN,
    ulps: float = ULPS,
) -> float:
    """How far from ``exact`` a result in ``dtype`` may lie: ``margin`` times the stock computation's own distance
    plus ``ulps`` epsilons of ``exact``'s largest magnitude (``stock`` None: the floor alone, which the caller then
    derives)."""
    dtype = dtype or (stock.dtype if stock is not None else torch.float32)
    scale = exact.detach().abs().max().item() if exact.numel() else 0.0
    stock_error = 0.0 if stock is None else max_error(stock, exact)
    return margin * stock_error + ulps * eps(dtype) * scale


def assert_exact_to_rounding(
    got: torch.Tensor,
    exact: torch.Tensor,
    *,
    stock: torch.Tensor | None,
    margin: float = MARGIN,
    ulps: float = ULPS,
    what: str = "",
) -> None:
    """``got`` equals ``exact`` (the same math in float64) up to the rounding its dtype's kernels make: no farther
    than `rounding_bound` allows. ``stock`` is the stock fp32 computation of the same math on the same input (the
    in-library model for an export, the base model for a preserved one, a formula written out for a router)."""
    if exact.dtype != torch.float64:
        raise TypeError(f"the reference must be float64, got {exact.dtype}")
    dtype = got.dtype
    error = max_error(got, exact)
    stock_error = 0.0 if stock is None else max_error(stock, exact)
    bound = rounding_bound(exact, stock, dtype=dtype, margin=margin, ulps=ulps)
    _log(what, error, stock_error, bound, margin, ulps)
    assert error <= bound, (
        f"{what + ': ' if what else ''}{error:.3g} from the float64 reference, more than the bound {bound:.3g} "
        f"({margin:g} x the stock computation's {stock_error:.3g} + {ulps:g} eps of {exact.abs().max().item():.3g})"
    )


def assert_within_noise(
    got: torch.Tensor,
    reference: torch.Tensor,
    *,
    noise: float,
    margin: float = MARGIN,
    ulps: float = ULPS,
    what: str = "",
) -> None:
    """``got`` no farther from ``reference`` (the stock run's result) than ``margin`` times ``noise`` (that run's own
    rounding noise: its distance from itself with the same sums in another valid order, `max_error`) plus ``ulps``
    epsilons of ``reference``'s magnitude: for results no float64 computation exists for."""
    error = max_error(got, reference)
    scale = reference.detach().abs().max().item() if reference.numel() else 0.0
    bound = margin * noise + ulps * eps(got.dtype) * scale
    _log(what, error, noise, bound, margin, ulps)
    assert error <= bound, (
        f"{what + ': ' if what else ''}{error:.3g} from the stock run, more than the bound {bound:.3g} "
        f"({margin:g} x its rounding noise {noise:.3g} + {ulps:g} eps of {scale:.3g})"
    )


def weight_floor(
    exact_logits: torch.Tensor,
    ids: torch.Tensor,
    real: torch.Tensor,
    prior: float,
    decay: float,
    prefix: bool = True,
    confidence: float = 0.0,
    prefix_weight: float = 1.0,
) -> float:
    """The floor, in eps, of a mixing router's weights' rounding (`assert_exact_to_rounding`'s ``ulps``).

    A weight is a softmax of scores, each expert's prior plus (``prefix``) its running sum of the log-probabilities of
    the tokens read, decayed (times ``prefix_weight``, the calibrated router's), plus (the confidence routers) its
    confidence over the temperature, up to ``confidence``:
    s <= |prior| + max |log p| (1 - decay^T) / (1 - decay) + confidence in size (~56 for the nested experts of
    tests/tuner/routing/test_nested_router.py). The scores round at that size, not at the weight's (<= 1): a
    difference of two by up to ~2 eps s, of which w_j moves by w_j (1 - w_j) <= 1/4. So the floor is s / 2 eps, not 8
    eps of 1 (measured on the nested experts: the one pass's weights lay up to 6.8 eps from float64, the control's, a
    stock that happened to round luckily, 1.2 eps). ``exact_logits``: the mixture's float64 log-probabilities (each
    expert's are near them); ``ids`` the tokens, ``real`` the positions that are not padding (B, T)."""
    size = abs(prior) + confidence
    if prefix:
        read = real[:, :-1] & real[:, 1:]  # a real token read at a real position
        log_p = exact_logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)[read]
        length = ids.shape[1]
        decayed = length if decay == 1 else (1 - decay**length) / (1 - decay)  # sum of decay^k over the positions
        size += abs(prefix_weight) * log_p.abs().max().item() * decayed
    return max(ULPS, size / 2)


def _log(what: str, error: float, stock_error: float, bound: float, margin: float, ulps: float) -> None:
    path = os.environ.get("SCALE_CL_EXACTNESS_LOG")
    if not path:
        return
    record = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
        "what": what,
        "error": error,
        "stock_error": stock_error,
        "bound": bound,
        "used": error / bound if bound else (0.0 if error == 0 else float("inf")),
        "margin": margin,
        "ulps": ulps,
        "kernels": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR") if k in os.environ},
    }
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")
