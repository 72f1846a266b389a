#!/usr/bin/env bash
# Issue 28 on the clean base, without replay (three seeds, every run at its preset rate): FFT, SCALE-Preserve and
# SCALE-Route as the paper has them, then with each quiet-stream option on its own (x_up normalised by the whole
# width's statistic, E_up at zero, route_exact); every trained SCALE model re-evaluated with its new stream's
# logits weighted by alpha in {0, 0.25, 0.5, 0.75, 1} (one trained model, a learning-forgetting frontier).
# Then FFT at x0.3, x0.5, x0.7 and x1 of its rate, each also with its weights interpolated towards the base's
# (WiSE-FT): FFT's own learning-forgetting frontiers, to compare at matched learning.
# Needs the clean base and corpora of measurements/cpt_clean.sh. Resumable; extra arguments go to the sweeps; the
# tables: python measurements/frontier_table.py outputs/sweep-cpt-clean-quiet outputs/sweep-cpt-clean-fft-frontier.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft scale_preserve scale_route --lr_scales 1 \
  --seeds 0 1 2 --eval.up_logit_scales 0 0.25 0.5 0.75 1 --axis options.scale.up_norm joint \
  --axis options.scale.embed_up_init zero --axis options.scale.route_exact true \
  --out outputs/sweep-cpt-clean-quiet "$@"
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft --lr_scales 0.3 0.5 0.7 1 --seeds 0 1 2 \
  --eval.wise_ft_alphas 0.25 0.5 0.75 0.9 --out outputs/sweep-cpt-clean-fft-frontier "$@"
# SCALE-Route trained as the paper has it (and with up_norm joint), read with route_exact at every alpha too (an
# evaluation option: trained with route_exact from the start, Route learns nothing, as the first sweep shows).
.venv/bin/scale-cl sweep cpt --preset clean-en --methods fft scale_route --lr_scales 1 --seeds 0 1 2 \
  --eval.up_logit_scales 0 0.25 0.5 0.75 1 --axis options.scale.up_norm joint \
  --out outputs/sweep-cpt-clean-route-exact "$@"
