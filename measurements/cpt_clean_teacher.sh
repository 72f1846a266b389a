#!/usr/bin/env bash
# Issue 28 on the clean base: the base as a teacher and the anchors a user would try first (three seeds, every run
# at its preset rate, each trained model also read along its own frontier: SCALE with Z + alpha Z_up, FFT with
# WiSE-FT). Without old data: the base's own text (pseudo-replay, 25% of the sequences) with the distillation term,
# distillation alone (confidence-weighted on Korean), pseudo-replay alone, FFT + LwF as usually written (every
# position at weight 1). With English replay: 1% and 5% (not whole per batch of 8: the global schedule), and 25%
# with distillation (FFT + replay + distillation, the with-replay target's reference). SCALE-Route read with the
# likelihood router after training with Eq. 5, and trained with it.
# Needs the clean base and corpora of measurements/cpt_clean.sh. Resumable; extra arguments go to every sweep; the
# tables: python measurements/frontier_table.py outputs/sweep-cpt-clean-fft-frontier outputs/sweep-cpt-clean-quiet \
#   outputs/sweep-cpt-clean-pseudo-distill outputs/sweep-cpt-clean-distill outputs/sweep-cpt-clean-pseudo ...
set -euo pipefail
cd "$(dirname "$0")/.."
sweep() { .venv/bin/scale-cl sweep cpt --preset clean-en --lr_scales 1 --seeds 0 1 2 \
  --eval.up_logit_scales 0 0.5 0.75 1 --eval.wise_ft_alphas 0.5 0.75 0.9 "$@"; }
replay=(--data.replay english=outputs/corpora/english-base/train.jsonl)
sweep --methods fft scale_preserve scale_route --data.pseudo_replay_ratio 0.25 --options.distill_weight 1 \
  --out outputs/sweep-cpt-clean-pseudo-distill "$@"
# (from here on each old-domain loss is also split into mass on Korean tokens and ranking: --eval.nll_split)
sweep --methods fft scale_preserve scale_route --data.pseudo_replay_ratio 0.25 --eval.nll_split true \
  --out outputs/sweep-cpt-clean-pseudo "$@"
sweep --methods fft --options.distill_weight 1 --options.distill_new_tokens all --eval.nll_split true \
  --out outputs/sweep-cpt-clean-lwf "$@"
# SCALE-Route as the paper trains it, read with route_exact and with the likelihood router at every alpha; and
# trained with the likelihood router
sweep --methods scale_route --reference scale_route --eval.nll_split true \
  --out outputs/sweep-cpt-clean-route-readings "$@"
sweep --methods scale_route --reference scale_route --options.scale.router likelihood --eval.nll_split true \
  --out outputs/sweep-cpt-clean-route-likelihood "$@"
sweep --methods fft scale_preserve scale_route --options.distill_weight 1 --eval.nll_split true \
  --out outputs/sweep-cpt-clean-distill "$@"
sweep --methods fft scale_route "${replay[@]}" --data.replay_ratio 0.01 --eval.nll_split true \
  --out outputs/sweep-cpt-clean-replay-1pc "$@"
sweep --methods fft scale_route "${replay[@]}" --data.replay_ratio 0.05 --eval.nll_split true \
  --out outputs/sweep-cpt-clean-replay-5pc "$@"
sweep --methods fft scale_route "${replay[@]}" --data.replay_ratio 0.25 --options.distill_weight 1 \
  --eval.nll_split true --out outputs/sweep-cpt-clean-replay-distill "$@"
