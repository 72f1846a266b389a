#!/usr/bin/env bash
# The mixing routers on continual pre-training (issues 50 and 63). On the clean base, each new domain is learnt by
# FFT and SCALE-Preserve at their preset rates, three seeds (korean: Korean documents; fortunes: English fortune
# cookies, the base's own language), then read with every mixing router: FFT's two-model control and SCALE-Preserve
# in one pass, with the router's separation and mixed documents read per segment (--eval.mixed_documents).
# ROUTER_SET picks the readings and the folder, outputs/sweep-SET-DOMAIN:
#   calibrated (default, issue 63): the likelihood, confidence, hybrid and calibrated routers, the calibrated one's
#     gate fitted on each trained model by the one recipe (scale_cl.experiments.method_run.GATE_RECIPE: the training
#     text against the base's own samples), by both objectives;
#   confidence (issue 50): the likelihood, confidence and hybrid routers.
# Needs the clean base and corpora of measurements/cpt_clean.sh. Resumable; extra arguments go to every sweep.
# Environment: ROUTER_SET, ROUTER_DOMAINS (default "korean fortunes"). The tables:
#   python measurements/router_domains_table.py outputs/sweep-SET-DOMAIN
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a domains <<<"${ROUTER_DOMAINS:-korean fortunes}"
set_name=${ROUTER_SET:-calibrated}
case $set_name in
  calibrated) readings=(--eval.routers likelihood confidence hybrid calibrated
    --eval.gate_objectives likelihood classification --save_models true) ;;
  confidence) readings=(--eval.routers likelihood confidence hybrid) ;;
  *) echo "unknown ROUTER_SET $set_name (calibrated, confidence)" >&2; exit 2 ;;
esac
for domain in "${domains[@]}"; do
  case $domain in
    korean) corpus=outputs/corpora/korean ;;
    fortunes)
      .venv/bin/python measurements/cpt_corpus.py --out outputs/corpora-fortunes --cache outputs/corpora/_cache \
        --corpora fortunes
      corpus=outputs/corpora-fortunes/fortunes ;;
    *) echo "unknown domain $domain (korean, fortunes)" >&2; exit 2 ;;
  esac
  .venv/bin/scale-cl sweep cpt --preset clean-en --data.train "$corpus/train.jsonl" "$corpus/heldout.jsonl" \
    --lr_scales 1 --seeds 0 1 2 --eval.mixed_documents 16 --methods fft scale_preserve --eval.up_logit_scales 1 \
    --eval.likelihood_control true "${readings[@]}" --out "outputs/sweep-$set_name-$domain" "$@"
done
