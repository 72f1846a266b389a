#!/usr/bin/env bash
# Continual pre-training of SmolLM2-135M on Korean for a fixed CPU budget with all seven methods at
# matched trainable parameters (LoRA rank and LLaMA Pro blocks matched to SCALE-Route), English
# forgetting and Korean learning perplexity side by side. Corpora: measurements/cpt_corpus.py (Debian
# documentation packages and KoNLPy's copy of the Korean Constitution; see outputs/corpora/SOURCES.md).
# Takes about 28 min on the project's 2-core CPU machine; extra arguments go to `scale-cl cpt`.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora
.venv/bin/scale-cl cpt --preset smollm2 \
  --data.train outputs/corpora/korean/train.jsonl outputs/corpora/korean/heldout.jsonl \
  --data.old_eval english=outputs/corpora/english/eval.jsonl \
  --data.heldout_fraction 0.05 --data.max_eval_sequences 8 --data.max_train_tokens 200000 \
  --train.max_steps 30 --train.batch_size 4 --train.micro_batch_size 4 --train.save_every 10 \
  --eval.every 10 \
  --out outputs/cpt-smollm2-korean "$@"
