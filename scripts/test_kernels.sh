#!/usr/bin/env bash
# The exactness tests (marked `exactness`, not `slow`) once more under other CPU kernels of torch, so that a bound that
# holds on this machine's kernels only fails here, not on the next machine (issue 62; tests/exactness.py).
#
#   MKL_CBWR=AVX2                                     ATen's AVX512 code with MKL's AVX2 path: an AMD EPYC with AVX512
#   ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2            a CPU without AVX512
#   ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE   ATen's scalar code, MKL's most conservative path
#
# On an Intel AVX512 machine (the project's) each changes the rounding of matrix products or a log-softmax
# (tests/project/test_exactness.py checks it). Extra arguments go to pytest, e.g. `bash scripts/test_kernels.sh -n 0 -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
for kernels in "MKL_CBWR=AVX2" "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2" "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE"; do
  echo "== the exactness tests under $kernels"
  # shellcheck disable=SC2086  # the settings are words on purpose
  env $kernels .venv/bin/python -m pytest -m "exactness and not slow" -q "$@"
done
