#!/usr/bin/env bash
# The de-quantisation control for SmolLM2 (issue 14, part 4). The only offline SmolLM2 is the Instruct model
# quantised to Q4_1 and de-quantised on load, so any update of its original weights partly repairs quantisation
# error and lowers perplexity on any text. Here FFT trains twice from the same start, with the same steps, rate
# and seeds as measurements/cpt_smollm2.sh (30 steps of 4 x 256 tokens at 1e-5): on Korean (the experiment) and on
# English documentation the forgetting sets never saw (the control: Python documentation from the english-base
# corpus). Forgetting on the Debian handbook ("handbook") and on held-out english-base documents ("en") is then
# read against the control's end point, not against the quantised start. Three seeds each, ~20 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora --corpora korean,english,english-base
common=(--preset smollm2 --methods fft --lr_scales 1 --seeds 0 1 2
  --data.old_eval handbook=outputs/corpora/english/eval.jsonl en=outputs/corpora/english-base/heldout.jsonl
  --data.heldout_fraction 0.05 --data.max_eval_sequences 8 --data.max_train_tokens 200000
  --train.max_steps 30 --train.batch_size 4 --train.micro_batch_size 4 --train.save_every 10 --eval.every 10)
.venv/bin/scale-cl sweep cpt "${common[@]}" \
  --data.train outputs/corpora/korean/train.jsonl outputs/corpora/korean/heldout.jsonl \
  --out outputs/smollm2-control/korean "$@"
.venv/bin/scale-cl sweep cpt "${common[@]}" \
  --data.train outputs/corpora/english-base/train.jsonl \
  --out outputs/smollm2-control/english "$@"
