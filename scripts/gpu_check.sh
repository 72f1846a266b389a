#!/usr/bin/env bash
# One prepared GPU check: the card and versions, the GPU-gated tests, a micro `scale-cl bio` run in bf16,
# `scale-cl bench` at Llama-3.2-1B's shape (eager, the likelihood readings' inference, then torch.compile'd for
# FFT and SCALE-Preserve), and `scale-cl train` at that shape (streamed, killed after a checkpoint and resumed at
# the stream's saved position), into
# one results folder whose summary.md says which of issues 38's, 40's and 49's targets are met or missed.
#
# Time budget: 10 minutes on one H100 or H200 (each step has its own limit, in the table below; a step that runs out
# is recorded as timed out and the next one starts). Where it runs: a machine whose Python already has torch,
# transformers, accelerate and peft, with no network; nothing is installed (the checkout's src/ goes on PYTHONPATH).
# What a missing optional package skips is said in the summary (pytest: the tests; matplotlib: bio's figure).
#
#   bash scripts/gpu_check.sh [--out DIR] [--python PYTHON]    # on the GPU machine (default out: outputs/gpu-check)
#   bash scripts/gpu_check.sh --skip tests,bio-micro,bench     # a second call: what the first had no time for
#   bash scripts/gpu_check.sh --dry-run [--out DIR]            # on a CPU: the same steps at toy sizes (CI runs it)
# Steps: versions, tests, bio-micro, bench, train, bench-memory, bench-memory-whole, bench-readings, bench-compiled (the
# last gets what is left of the budget).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
OUT="outputs/gpu-check"
PYTHON="${PYTHON:-python3}"
DRY_RUN=0
SKIP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --skip) SKIP=",$2,"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "gpu_check.sh: $OUT is not empty: give another --out (each check keeps its own folder)" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BUDGET=600
START=$(date +%s)
printf 'step\trc\tseconds\tlimit\n' > "$OUT/steps.tsv"

# step NAME LIMIT COMMAND...: run it under its time limit, its output in NAME.log, its exit code and time in steps.tsv
step() {
  local name=$1 limit=$2 begin rc
  shift 2
  if [[ "$SKIP" == *",$name,"* ]]; then
    echo "[gpu-check] $name: skipped (--skip)"
    return
  fi
  # a dry run checks the commands, not the GPU's time: on a shared CPU (CI runs it beside other tests) it gets 4x
  [ "$DRY_RUN" -eq 1 ] && limit=$(( limit * 4 ))
  begin=$(date +%s)
  echo "[gpu-check] $name (limit ${limit} s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - begin ))" "$limit" >> "$OUT/steps.tsv"
  [ "$rc" -eq 0 ] || echo "[gpu-check] $name: exit code $rc (124: timed out); see $OUT/$name.log"
}

has() { "$PYTHON" -c "import $1" > /dev/null 2>&1; }

if [ "$DRY_RUN" -eq 1 ]; then
  # one torch thread a process: the toy models gain nothing from two, and on a shared CPU (CI runs the check beside
  # another test worker) two threads spin against each other (bio-micro took 3x the CPU time)
  export OMP_NUM_THREADS=1
  DEVICE=(--device cpu)
  TESTS=(--collect-only)
  BENCH_SHAPE=(--shapes tiny --batch 2 --seq 16 --warmup 1 --rounds 1 --threads 1 --skip-memory)
  # every stage still runs: pre-training one epoch of the micro corpus, not two; Task 1 two steps, not four
  BIO_METHODS=(--methods fft --pretrain.epochs 1 --task1.max_steps 2)
else
  DEVICE=(--device cuda)
  TESTS=()
  BENCH_SHAPE=(--shapes llama-1b --warmup 2 --rounds 3)
  BIO_METHODS=()
fi

step versions 60 "$PYTHON" -m scale_cl.bench.gpu_check versions "$OUT/versions.json"

if has pytest; then
  # one process (-o addopts=: not pyproject's two workers; the GPU machine may lack pytest-xdist)
  step tests 180 "$PYTHON" -m pytest tests/e2e/test_gpu.py tests/e2e/test_sharded_commands.py -k "cuda or gpus" -q -rs \
    -o addopts= -p no:cacheprovider --junitxml="$OUT/tests.xml" "${TESTS[@]}"
fi

precision=(--pretrain.precision bf16 --task0.precision bf16 --task1.precision bf16)
step bio-micro 45 "$PYTHON" -m scale_cl.cli bio --preset micro --out "$OUT/bio-micro" "${precision[@]}" "${BIO_METHODS[@]}"

BENCH=(-m scale_cl.cli bench "${BENCH_SHAPE[@]}" "${DEVICE[@]}" --skip-upscale --skip-inference --no-progress)
# Timing and FLOPs first (about a minute on an H200), then memory apart: each memory figure is a fresh process that
# imports torch and builds the 1B model again (the first H200 check ran out of time with both in one step).
step bench 150 "$PYTHON" "${BENCH[@]}" --methods fft lora scale_preserve scale_adapt scale_route --skip-memory \
  --out "$OUT/bench"
# `scale-cl train` at the bench's shape and batch, SCALE-Preserve, bf16, streamed from a corpus made here
# (synthetic biographies, 8 files, two loader workers), killed with SIGKILL once its first checkpoint is written and
# run again to the end: its tokens/s against the bench's step, the loss, the checkpoint resumed. A dry run: the tiny
# shape, batches of 8 x 64 tokens, so that the first checkpoint (30 steps, 240 blocks) is past the first corpus file's
# blocks (about 210: the stream's saved position is a bookmark in a later file) and the kill lands with 60 steps and
# two checkpoints still to go.
if [ "$DRY_RUN" -eq 1 ]; then
  TRAIN=(--shape tiny --people 200 --first-checkpoint 30 -- --data.seq_len 64 --train.batch_size 8
    --train.micro_batch_size 8 --train.max_steps 90 --train.save_every 30 --eval.every 30
    --options.scale.hidden_up 32 --options.scale.ffn_up 128 --options.scale.preserve_layers 1 --train.device cpu)
else
  TRAIN=(--shape llama-1b --people 2000 --first-checkpoint 20 -- --data.seq_len 1024 --train.batch_size 16
    --train.micro_batch_size 16 --train.max_steps 60 --train.save_every 20 --eval.every 20
    --options.scale.hidden_up 256 --options.scale.ffn_up 1024 --options.scale.preserve_layers 3
    --train.precision bf16 --train.device cuda)
fi
step train 150 "$PYTHON" -m scale_cl.bench.gpu_check train "$OUT" "${TRAIN[@]}"

if [ "$DRY_RUN" -eq 1 ]; then
  echo "[gpu-check] bench-memory: not run in a dry run (test_gpu_check reads a memory result; the bench's tests time it)"
else
  step bench-memory 120 "$PYTHON" "${BENCH[@]}" --methods fft scale_preserve --skip-training --skip-flops \
    --out "$OUT/bench-memory"
fi
# the same peaks with transformers' whole-logit loss (the bench and training slice it by default), at the
# shape's 128k vocabulary: the sliced loss's memory against it.
if [ "$DRY_RUN" -eq 1 ]; then
  echo "[gpu-check] bench-memory-whole: not run in a dry run (as bench-memory)"
else
  step bench-memory-whole 90 "$PYTHON" "${BENCH[@]}" --methods fft scale_preserve --skip-training --skip-flops \
    --loss whole --out "$OUT/bench-memory-whole"
fi

# the one-pass likelihood readings' inference (forward and generate()) against FFT's, and the control.
step bench-readings 120 "$PYTHON" -m scale_cl.cli bench "${BENCH_SHAPE[@]}" "${DEVICE[@]}" --skip-upscale \
  --skip-training --skip-memory --no-progress --methods fft scale_preserve \
  --readings preserve-likelihood control preserve-nested --out "$OUT/bench-readings"

LEFT=$(( BUDGET - ($(date +%s) - START) - 10 ))
if [ "$DRY_RUN" -eq 1 ]; then
  echo "[gpu-check] bench-compiled: not run in a dry run (compiling takes minutes on a CPU)"
elif [ "$LEFT" -gt 60 ]; then
  step bench-compiled "$LEFT" "$PYTHON" "${BENCH[@]}" --methods fft scale_preserve --skip-memory --compile default \
    --out "$OUT/bench-compiled"
else
  echo "[gpu-check] bench-compiled: skipped, ${LEFT} s of the budget left"
fi

dry=()
[ "$DRY_RUN" -eq 1 ] && dry=(--dry-run)
"$PYTHON" -m scale_cl.bench.gpu_check summary "$OUT" --budget "$BUDGET" --seconds "$(( $(date +%s) - START ))" "${dry[@]}"
