#!/usr/bin/env bash
# Issue 16 on the clean base (where FFT really forgets): FFT and SCALE-Route at their clean-en preset rates, three
# seeds, against what this library adds beyond the paper, one at a time and combined:
#   replay        25% of every batch from the base's own English pre-training text (english-base/train.jsonl;
#                 the "en" forgetting set is that corpus's held-out split, never replayed), for both methods;
#   w12_lr_ratio  SCALE-Route's W12 at a tenth of its rate;
#   route_share   SCALE-Route's tau calibrated so that 90% of an English sample goes to the preserve path;
#   auto_layers   SCALE-Route's L_fp and collaborative modules from probe runs (budget 0.1);
# then the paper's other methods (SCALE-Preserve, also at x1.5; SCALE-Adapt; LoRA; LLaMA Pro) with and without
# replay into the same folder; then, with replay in every run, FFT at x0.5 and SCALE-Route at x1.5 of their rates
# beside x1, to compare the two with replay at matched learning. Every run is cached and resumable. Extra arguments
# go to every sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python measurements/cpt_corpus.py --out outputs/corpora --corpora korean,english,english-base
.venv/bin/scale-cl base --preset clean-en --out outputs/clean-en
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft scale_route --lr_scales 1 --seeds 0 1 2 \
  --data.replay english=outputs/corpora/english-base/train.jsonl \
  --axis data.replay_ratio 0.25 --axis options.w12_lr_ratio 0.1 --axis options.route_share 0.9 \
  --axis data.replay_ratio,options.w12_lr_ratio,options.route_share 0.25,0.1,0.9 --axis options.auto_layers true \
  --out outputs/sweep-cpt-clean-beyond "$@"
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft scale_preserve scale_adapt lora llama_pro --lr_scales 1 \
  --method_lr_scales scale_preserve 1.5 --seeds 0 1 2 \
  --data.replay english=outputs/corpora/english-base/train.jsonl --axis data.replay_ratio 0.25 \
  --out outputs/sweep-cpt-clean-beyond "$@"
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft scale_route --lr_scales 1 \
  --method_lr_scales fft 0.5 --method_lr_scales scale_route 1.5 --seeds 0 1 2 \
  --data.replay english=outputs/corpora/english-base/train.jsonl --data.replay_ratio 0.25 \
  --out outputs/sweep-cpt-clean-replay "$@"
