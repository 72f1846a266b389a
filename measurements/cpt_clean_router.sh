#!/usr/bin/env bash
# Issue 40 on the clean base (no old data): the likelihood router read on SCALE-Preserve (its Z is the base's logits
# exactly, one pass) and on SCALE-Route (trained with Eq. 5), against the two-model control (each trained model and
# the base mixed by the same router: --eval.likelihood_control), three seeds, every method at its preset rate, each
# SCALE model also read at alpha 0.5 and 0.75. Needs the clean base and corpora of measurements/cpt_clean.sh.
# Resumable; extra arguments go to the sweep. The table:
#   python measurements/frontier_table.py outputs/sweep-cpt-clean-router
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/scale-cl sweep cpt --preset clean-en --lr_scales 1 --seeds 0 1 2 --methods fft scale_preserve scale_route \
  --eval.up_logit_scales 0.5 0.75 1 --eval.likelihood_control true --out outputs/sweep-cpt-clean-router "$@"
