#!/usr/bin/env bash
# Issue 28 on the biography benchmark (small preset, three seeds, every method at its preset Task-1 rate, each run
# read at Task 1 = 90% along its own curve: matched learning without a rate sweep). Without Task-0 data: the
# Task-0 model as a teacher (distillation, confidence-weighted on Task-1 answers), its own text (pseudo-replay,
# 25% of every batch), both, FFT + LwF (every position at weight 1), SCALE-Route trained with the likelihood
# router (alone and with pseudo-replay + distillation; every Eq.-5 Route run is also read with it and with
# route_exact, and a likelihood-routed run records the router's AUROC of Task-0 against Task-1 questions); the
# quiet-stream options; FFT and Freeze read with WiSE-FT. With Task-0 replay (25%): FFT and Route, with and without
# distillation. Issue 40: FFT read with its two-model control (its model and the Task-0 model mixed by the likelihood
# router) beside SCALE-Route's and SCALE-Preserve's router readings (`router`), and Route trained with the router
# (`router-trained`), every router reading with its AUROC.
# Stages 1-2 are built once per seed (each seed in its own folder, then gathered into <root>/cache) and shared,
# read only, by every sweep. Resumable.
# Environment: SCALE_CL (the command, default .venv/bin/scale-cl), BIO_TEACHER_OUT (default outputs/bio-teacher),
# BIO_PRESET (default small), BIO_LR_SCALES (default 1: the preset rates; each other scale s runs every sweep again
# in <name>-x<s>, for the settings that learn Task 1 too slowly to reach 90% at the preset rate), BIO_SWEEPS (the
# sweeps to run, default all), PARALLEL=1 runs the sweeps side by side (a GPU: the small preset leaves it idle);
# extra arguments go to every sweep. The tables: python measurements/bio_teacher_table.py <root>
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a cli <<<"${SCALE_CL:-.venv/bin/scale-cl}"
root=${BIO_TEACHER_OUT:-outputs/bio-teacher}
preset=${BIO_PRESET:-small}
seeds=(0 1 2)
read -r -a scales <<<"${BIO_LR_SCALES:-1}"
read -r -a chosen <<<"${BIO_SWEEPS:-no-old-data pseudo lwf route-likelihood quiet replay wise router router-trained}"
pids=()
sweep() {
  local name=$1 scale folder
  shift
  [[ " ${chosen[*]} " == *" $name "* ]] || return 0
  for scale in "${scales[@]}"; do
    folder=$name
    [[ $scale == 1 ]] || folder=$name-x$scale
    mkdir -p "$root/$folder"
    ln -sfn ../cache "$root/$folder/cache"
    local run=("${cli[@]}" sweep bio --preset "$preset" --seeds "${seeds[@]}" --task1.early_eval_every 10
      --lr_scales "$scale" --target 0.9 --out "$root/$folder" "$@" "${extra[@]}")
    echo "[bio_teacher] $(date -u +%T) $folder"
    if [[ ${PARALLEL:-0} == 1 ]]; then
      "${run[@]}" >"$root/$folder.log" 2>&1 &
      pids+=($!)
    else
      "${run[@]}"
    fi
  done
}
wait_all() {
  for pid in "${pids[@]}"; do wait "$pid"; done
  pids=()
}
extra=("$@")
echo "[bio_teacher] $(date -u +%T) stages 1-2"
for seed in "${seeds[@]}"; do
  stage=("${cli[@]}" bio --preset "$preset" --seeds "$seed" --methods fft --task1.max_steps 1
    --out "$root/stages-$seed" --cache "$root/cache-$seed" "${extra[@]}")
  if [[ ${PARALLEL:-0} == 1 ]]; then
    mkdir -p "$root"
    "${stage[@]}" >"$root/stages-$seed.log" 2>&1 &
    pids+=($!)
  else
    "${stage[@]}"
  fi
done
wait_all
mkdir -p "$root/cache"
for seed in "${seeds[@]}"; do
  for item in "$root/cache-$seed"/*; do [[ -e $root/cache/${item##*/} ]] || cp -a "$item" "$root/cache/"; done
done
echo "[bio_teacher] $(date -u +%T) stages 1-2 ready"

sweep no-old-data --methods fft freeze scale_preserve scale_route --axis options.distill_weight 1
sweep pseudo --methods fft freeze scale_preserve scale_route --task1.pseudo_replay_ratio 0.25 \
  --axis options.distill_weight 1
sweep lwf --methods fft --options.distill_weight 1 --options.distill_new_tokens all
sweep route-likelihood --methods scale_route --reference scale_route --options.scale.router likelihood \
  --axis task1.pseudo_replay_ratio,options.distill_weight 0.25,1
sweep quiet --methods scale_preserve scale_route --reference scale_preserve --axis options.scale.up_norm joint \
  --axis options.scale.embed_up_init zero
sweep replay --methods fft scale_route --task1.replay_ratio 0.25 --axis options.distill_weight 1
sweep wise --methods fft freeze --task1.wise_ft_alphas 0.25 0.5 0.75
# issue 40 (4c): each reading by the likelihood router beside its control (FFT's model and the Task-0 model mixed)
sweep router --methods fft scale_preserve scale_route --task1.likelihood_control true
sweep router-trained --methods scale_route --reference scale_route --options.scale.router likelihood
wait_all
