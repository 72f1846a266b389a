#!/usr/bin/env bash
# Issue 16 on the biography benchmark (small preset, three seeds): every method at x0.5, x1 and x2 of its preset
# Task-1 rate, each with and without 25% of every Task-1 batch replayed from Task 0's training questions, and
# SCALE-Route with replay and tau calibrated to route 90% of Task-0 questions to the preserve path. Stages 1-2 are
# built once per seed (~11 minutes each on 2 cores) in outputs/sweep-bio-beyond/cache; every run is cached and
# resumable. The sweep's tables are read at FFT's Task-1 level (results-fft.md), then re-read, training nothing, at
# Task 1 = 90% and 50% (results-90.md, results-50.md); last, issue 16's target read off the runs. Extra arguments
# go to the sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
out=outputs/sweep-bio-beyond
sweep=(.venv/bin/scale-cl sweep bio --preset small --seeds 0 1 2 --task1.early_eval_every 10 --lr_scales 0.5 1 2
  --axis task1.replay_ratio 0.25 --axis task1.replay_ratio,options.route_share 0.25,0.9 --out "$out" "$@")
"${sweep[@]}" && cp "$out/results.md" "$out/results-fft.md"
"${sweep[@]}" --target 0.9 && cp "$out/results.md" "$out/results-90.md"
"${sweep[@]}" --target 0.5 && cp "$out/results.md" "$out/results-50.md"
.venv/bin/python measurements/target_table.py "$out"
