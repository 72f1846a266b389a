"""The rule every exactness comparison uses (`tests/exactness.py`): the bound is the stock computation's own distance
from float64, times the margin, plus the floor; a result outside it fails, whatever the kernels."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.exactness import assert_exact_to_rounding, eps, rounding_bound

pytestmark = pytest.mark.exactness

EXACT = torch.tensor([1.0, -4.0, 0.5], dtype=torch.float64)
STOCK = EXACT.float() + torch.tensor([3e-7, 0.0, -1e-7])  # the stock fp32 computation: 3e-7 from exact at most


def test_the_bound_is_the_stock_error_times_the_margin_plus_the_floor():
    stock_error = (STOCK.double() - EXACT).abs().max().item()
    assert rounding_bound(EXACT, STOCK) == pytest.approx(2 * stock_error + 8 * eps(torch.float32) * 4.0, rel=1e-12)
    assert rounding_bound(EXACT, STOCK, margin=3, ulps=0) == pytest.approx(3 * stock_error, rel=1e-12)
    assert rounding_bound(EXACT, None, ulps=16) == pytest.approx(16 * eps(torch.float32) * 4.0, rel=1e-12)
    assert rounding_bound(EXACT, None, dtype=torch.bfloat16) == pytest.approx(8 * 2**-7 * 4.0, rel=1e-12)


def test_a_result_inside_the_bound_passes_and_one_just_outside_fails():
    bound = rounding_bound(EXACT, STOCK)
    inside = EXACT.float() + torch.tensor([0.0, 0.0, 0.9 * bound])
    assert_exact_to_rounding(inside, EXACT, stock=STOCK)
    outside = (EXACT + torch.tensor([0.0, 0.0, 1.1 * bound], dtype=torch.float64)).float()
    with pytest.raises(AssertionError, match="more than the bound"):
        assert_exact_to_rounding(outside, EXACT, stock=STOCK, what="the third value")


def test_a_stock_computation_that_rounds_worse_widens_the_bound_with_it():
    """The point of deriving it: kernels that round farther from exact move the stock result and the result under
    test alike, so both still pass; the same error against a tighter stock result fails."""
    sloppy = EXACT.float() + torch.tensor([0.0, 2e-5, 0.0])
    assert_exact_to_rounding(EXACT.float() + torch.tensor([0.0, -3e-5, 0.0]), EXACT, stock=sloppy)
    with pytest.raises(AssertionError):
        assert_exact_to_rounding(EXACT.float() + torch.tensor([0.0, -3e-5, 0.0]), EXACT, stock=STOCK)


def test_the_reference_must_be_float64_and_of_the_same_shape():
    with pytest.raises(TypeError, match="float64"):
        assert_exact_to_rounding(STOCK, STOCK, stock=STOCK)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_exact_to_rounding(STOCK[:2], EXACT, stock=STOCK)


def test_every_comparison_can_be_logged_with_the_share_of_its_bound(tmp_path, monkeypatch):
    log = tmp_path / "exactness.jsonl"
    monkeypatch.setenv("SCALE_CL_EXACTNESS_LOG", str(log))
    assert_exact_to_rounding(STOCK, EXACT, stock=STOCK, what="stock against itself")
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["what"] == "stock against itself" and record["error"] == record["stock_error"] > 0
    assert 0 < record["used"] < 0.5 and record["test"].endswith(
        "test_every_comparison_can_be_logged_with_the_share_of_its_bound"
    )


PROBE = """
import hashlib, torch
torch.manual_seed(0)
out = []
for m, k, n in ((7, 33, 129), (200, 256, 512)):
    a, b = torch.randn(m, k), torch.randn(k, n)
    out += [a @ b, torch.log_softmax(a @ b, -1)]
print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in out)).hexdigest())
"""


def kernel_settings() -> list[str]:
    """The settings scripts/test_kernels.sh runs the exactness tests under (its `for kernels in ...` line)."""
    script = (Path(__file__).parents[2] / "scripts" / "test_kernels.sh").read_text()
    (line,) = [line for line in script.splitlines() if line.startswith("for kernels in ")]
    return re.findall(r'"([^"]+)"', line)


def probe(setting: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    env.update(OMP_NUM_THREADS="1", **dict(word.split("=", 1) for word in setting.split()))
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512" or "GenuineIntel" not in Path("/proc/cpuinfo").read_text(),
    reason="the settings are chosen for an Intel AVX512 CPU (the project's machines); elsewhere some are the default",
)
def test_each_kernel_setting_of_the_script_rounds_differently_here():
    """The script's runs are not the default run again: on this kind of machine each setting changes the rounding of
    a matrix product or a log-softmax."""
    settings = kernel_settings()
    assert len(settings) == 3
    default = probe("")
    assert all(probe(setting) != default for setting in settings), settings
