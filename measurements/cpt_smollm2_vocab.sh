#!/usr/bin/env bash
# Vocabulary extension on SmolLM2-135M learning Korean (issue 15): the same short continual pre-training as
# measurements/cpt_smollm2_control.sh (30 steps of 4 x 256 tokens, seed 0), FFT and SCALE-Route at the smollm2
# preset's rates, once with SmolLM2's English-centric tokenizer and once with N Korean tokens added
# (`--data.extend_vocab`, default 2000). Perplexities per token are not comparable across tokenizers, so
# measurements/vocab_chars.py restates learning and forgetting per character (nats/char = ln(ppl) x tokens/char
# of the same held-out text under each run's tokenizer). ~15 min on the project's 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
count="${VOCAB:-2000}"
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora --corpora korean,english
common=(--preset smollm2 --methods fft scale_route --seed 0
  --data.train outputs/corpora/korean/train.jsonl outputs/corpora/korean/heldout.jsonl
  --data.old_eval handbook=outputs/corpora/english/eval.jsonl
  --data.heldout_fraction 0.05 --data.max_eval_sequences 8 --data.max_train_tokens 200000
  --train.max_steps 30 --train.batch_size 4 --train.micro_batch_size 4 --train.save_every 10 --eval.every 10)
.venv/bin/scale-cl cpt "${common[@]}" --out outputs/smollm2-vocab/base-tokenizer "$@"
.venv/bin/scale-cl cpt "${common[@]}" --data.extend_vocab "$count" --out "outputs/smollm2-vocab/extended-$count" "$@"
.venv/bin/python measurements/vocab_chars.py outputs/smollm2-vocab/base-tokenizer "outputs/smollm2-vocab/extended-$count"
