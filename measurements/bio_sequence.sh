#!/usr/bin/env bash
# Issue 29 on the biography benchmark: five cohorts of new people after Task 0 (`--sequence.tasks 5`), every method
# at its preset Task-1 rate, three seeds. Growth "once" for every method (SCALE keeps the blocks it added before
# Task 1, LoRA its adapter); "per_task" for SCALE-Preserve, SCALE-Adapt (grown again before every task) and LoRA (a
# new adapter per task, stacked; and merged in its own folder). SCALE-Route cannot be grown again (refused): it runs
# once. No early evaluation schedule (every --task1.eval_every steps): the sequence's cost is its evaluations of
# seven splits. Stages 1-2 are the small preset's, shared through one cache. Resumable (per task).
# Environment: SCALE_CL (the command, default .venv/bin/scale-cl), BIO_SEQ_OUT (default outputs/bio-seq), BIO_CACHE
# (stages 1-2, default <out>/cache), BIO_SEEDS (default "0 1 2"), BIO_SEQ_RUNS (default "once per-task lora-merged
# nested confidence calibrated": issue 40's nested router on SCALE-Preserve grown per task, against FFT's control, the Task-0
# model and FFT's model after each task kept apart and mixed alike; "confidence" the same read by each expert's
# confidence where the answer is predicted; "calibrated" issue 63's calibrated router, its gate fitted after every task
# on that task's training questions and the base's own samples, FFT's control fitted alike);
# extra arguments go to every run. Each folder's results.md holds its matrices and metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a cli <<<"${SCALE_CL:-.venv/bin/scale-cl}"
root=${BIO_SEQ_OUT:-outputs/bio-seq}
cache=${BIO_CACHE:-$root/cache}
read -r -a seeds <<<"${BIO_SEEDS:-0 1 2}"
read -r -a chosen <<<"${BIO_SEQ_RUNS:-once per-task lora-merged nested confidence calibrated}"
run() {
  local name=$1
  shift
  [[ " ${chosen[*]} " == *" $name "* ]] || return 0
  "${cli[@]}" bio --preset small --sequence.tasks 5 --task1.early_eval_every 0 --seeds "${seeds[@]}" \
    --cache "$cache" --out "$root/$name" "$@"
}
run once --methods fft freeze lora llama_pro scale_preserve scale_adapt scale_route "${@}"
run per-task --sequence.growth per_task --methods scale_preserve scale_adapt lora "${@}"
run lora-merged --sequence.growth per_task --sequence.lora_per_task merged --methods lora "${@}"
run nested --sequence.growth per_task --options.scale.router nested --task1.likelihood_control true \
  --methods fft scale_preserve "${@}"
run confidence --sequence.growth per_task --options.scale.router confidence --task1.likelihood_control true \
  --methods fft scale_preserve "${@}"
run calibrated --sequence.growth per_task --options.scale.router calibrated --task1.likelihood_control true \
  --methods fft scale_preserve "${@}"
