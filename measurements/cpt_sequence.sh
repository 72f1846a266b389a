#!/usr/bin/env bash
# Issue 29's language sequence on the clean English base: Korean, then Chinese, Russian, Greek and German (four new
# scripts, and one language that shares English's), each task at the clean-en preset's steps and per-method rates,
# three seeds. Growth "once" for every method; "per_task" for SCALE-Preserve, SCALE-Adapt and LoRA (stacked; merged
# in its own folder). SCALE-Route cannot be grown again (refused): it runs once. Each folder's results.md holds the
# perplexity matrices (English included) and ACC/BWT/FWT/forgetting on -ln(perplexity). Every task is measured at its
# end only (`--eval.every 100`, the preset's steps): seven sets every 20 steps would cost about as much as training.
# Needs the clean base and corpora of measurements/cpt_clean.sh; builds the four later corpora here. Resumable (per
# task). Environment: SCALE_CL (default .venv/bin/scale-cl), CPT_SEQ_OUT (default outputs/cpt-seq), CPT_SEEDS
# (default "0 1 2"), CPT_SEQ_RUNS (default "once per-task lora-merged nested confidence calibrated"); extra arguments
# go to every run.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a cli <<<"${SCALE_CL:-.venv/bin/scale-cl}"
root=${CPT_SEQ_OUT:-outputs/cpt-seq}
read -r -a seeds <<<"${CPT_SEEDS:-0 1 2}"
read -r -a chosen <<<"${CPT_SEQ_RUNS:-once per-task lora-merged nested confidence calibrated}"
corpora=outputs/corpora-seq
.venv/bin/python measurements/cpt_corpus.py --out "$corpora" --cache outputs/corpora/_cache \
  --corpora chinese,russian,greek,german
languages=()
for language in chinese russian greek german; do languages+=("$language=$corpora/$language/train.jsonl"); done
run() {
  local name=$1 seed
  shift
  [[ " ${chosen[*]} " == *" $name "* ]] || return 0
  for seed in "${seeds[@]}"; do
    "${cli[@]}" cpt --preset clean-en --seed "$seed" --sequence.first korean --sequence.then "${languages[@]}" \
      --eval.every 100 --out "$root/$name/seed-$seed" "$@"
  done
}
run once --methods fft freeze lora llama_pro scale_preserve scale_adapt scale_route "${@}"
run per-task --sequence.growth per_task --methods scale_preserve scale_adapt lora "${@}"
run lora-merged --sequence.growth per_task --sequence.lora_per_task merged --methods lora "${@}"
# issue 40: SCALE-Preserve grown per task read (and trained) with the nested router, against FFT's control (the base
# and FFT's model after each task, kept apart and mixed the same way)
run nested --sequence.growth per_task --options.scale.router nested --eval.likelihood_control true \
  --methods fft scale_preserve "${@}"
# issue 50: the same read (and SCALE-Preserve trained) with the confidence router, each expert weighed by its own
# confidence at every position
run confidence --sequence.growth per_task --options.scale.router confidence --eval.likelihood_control true \
  --methods fft scale_preserve "${@}"
# issue 63: SCALE-Preserve grown per task, each task trained unrouted and read with the calibrated router's gate
# fitted after it (the task's training blocks against the base's own samples); FFT's control fitted alike
run calibrated --sequence.growth per_task --options.scale.router calibrated --eval.likelihood_control true \
  --methods fft scale_preserve "${@}"
