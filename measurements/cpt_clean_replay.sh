#!/usr/bin/env bash
# The clean base with 25% replay of its own English pre-training text (english-base/train.jsonl; the "en" forgetting
# set is that corpus's held-out split, never replayed): FFT, SCALE-Route and SCALE-Preserve at their clean-en preset
# rates and one more multiple each (FFT x0.5, SCALE-Route and SCALE-Preserve x1.5), three seeds, read at FFT + replay's
# Korean level. Builds the corpora and the base first if they are not there (measurements/cpt_clean.sh); every run is
# cached and resumable. Extra arguments go to the sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora --corpora korean,english,english-base
.venv/bin/scale-cl base --preset clean-en --out outputs/clean-en
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft scale_route scale_preserve --lr_scales 1 \
  --method_lr_scales fft 0.5 --method_lr_scales scale_route 1.5 --method_lr_scales scale_preserve 1.5 --seeds 0 1 2 \
  --data.replay english=outputs/corpora/english-base/train.jsonl --data.replay_ratio 0.25 \
  --out outputs/sweep-cpt-clean-replay "$@"
