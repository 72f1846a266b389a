#!/usr/bin/env bash
# Issue 50: the confidence routers on continual pre-training, beside the likelihood router. On the clean base, each
# new domain is learnt by FFT and SCALE-Preserve at their preset rates, three seeds (korean: another script;
# fortunes: English fortune cookies, the base's own language), then read with every mixing router: FFT's two-model
# control and SCALE-Preserve in one pass, each with the likelihood, confidence and hybrid routers
# (--eval.routers), with the router's separation and mixed documents read per segment (--eval.mixed_documents).
# Needs the clean base and corpora of benchmarks/cpt_clean.sh. Resumable; extra arguments go to every sweep.
# Environment: ROUTER_DOMAINS (default "korean fortunes"). The tables:
#   python benchmarks/router_domains_table.py outputs/sweep-confidence-DOMAIN
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a domains <<<"${ROUTER_DOMAINS:-korean fortunes}"
for domain in "${domains[@]}"; do
  case $domain in
    korean) corpus=outputs/corpora/korean ;;
    fortunes)
      .venv/bin/python benchmarks/cpt_corpus.py --out outputs/corpora-fortunes --cache outputs/corpora/_cache \
        --corpora fortunes
      corpus=outputs/corpora-fortunes/fortunes ;;
    *) echo "unknown domain $domain (korean, fortunes)" >&2; exit 2 ;;
  esac
  .venv/bin/scale-cl sweep cpt --preset clean-en --data.train "$corpus/train.jsonl" "$corpus/heldout.jsonl" \
    --lr_scales 1 --seeds 0 1 2 --eval.mixed_documents 16 --methods fft scale_preserve --eval.up_logit_scales 1 \
    --eval.likelihood_control true --eval.routers likelihood confidence hybrid \
    --out "outputs/sweep-confidence-$domain" "$@"
done
