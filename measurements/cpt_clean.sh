#!/usr/bin/env bash
# Continual pre-training where forgetting is real (issue 14): the clean English base built here learns Korean.
#  1. corpora from Debian/PyPI packages (measurements/cpt_corpus.py): Korean (new domain), English pre-training text
#     (english-base: Python, LibreOffice, GIMP, Debian docs; its held-out split is the "en" forgetting set) and the
#     Debian handbook ("handbook", English the base never saw);
#  2. the base: `scale-cl base` (a 4.0M-parameter Llama, ~25 min on 2 CPU cores, built once into outputs/clean-en);
#  3. the matched-learning sweep over three seeds: every method at x0.3, x1 and x3 of its clean-en preset rate,
#     SCALE-Preserve also at x1.5 and x2 (its learning flattens out near FFT's level).
# Every step is cached and resumable: re-running skips what is done. Extra arguments go to `scale-cl sweep cpt`
# (e.g. --methods fft scale_route, --seeds 0, --target 20).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora --corpora korean,english,english-base
.venv/bin/scale-cl base --preset clean-en --out outputs/clean-en
.venv/bin/scale-cl sweep cpt --preset clean-en --lr_scales 0.3 1 3 --method_lr_scales scale_preserve 1.5 2 \
  --seeds 0 1 2 --out outputs/sweep-cpt-clean-en "$@"
