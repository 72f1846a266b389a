#!/usr/bin/env bash
# Issue 40, part 4: where a router of token likelihoods cannot see. On the clean base, each new domain is learnt by
# FFT, SCALE-Preserve and SCALE-Route at their preset rates, three seeds:
#   korean    Korean (another script: the router's easiest case);
#   fortunes  Debian's fortune cookies (English, the base's own language; benchmarks/cpt_corpus.py --corpora fortunes).
# Each run reads, after training: FFT's two-model control (--eval.likelihood_control), SCALE-Route trained with Eq. 5
# read with the likelihood router, SCALE-Preserve with it (--eval.up_logit_scales 1), each with the router's
# separation (per-token AUROC of old against new by the base's weight) and mixed documents (--eval.mixed_documents:
# a passage of `en` inside a held-out new-domain document and the reverse, read per segment). A second sweep per
# domain trains SCALE-Route with the likelihood router from the start. Needs the clean base and corpora of
# benchmarks/cpt_clean.sh. Resumable; extra arguments go to every sweep. Environment: ROUTER_DOMAINS (default
# "korean fortunes"). The tables:
#   python benchmarks/frontier_table.py outputs/sweep-router-DOMAIN outputs/sweep-router-DOMAIN-route-router
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a domains <<<"${ROUTER_DOMAINS:-korean fortunes}"
.venv/bin/python benchmarks/cpt_corpus.py --out outputs/corpora-fortunes --cache outputs/corpora/_cache \
  --corpora fortunes
for domain in "${domains[@]}"; do
  case $domain in
    korean) corpus=outputs/corpora/korean ;;
    fortunes) corpus=outputs/corpora-fortunes/fortunes ;;
    *) echo "unknown domain $domain (korean, fortunes)" >&2; exit 2 ;;
  esac
  common=(--preset clean-en --data.train "$corpus/train.jsonl" "$corpus/heldout.jsonl" --lr_scales 1 --seeds 0 1 2 --eval.mixed_documents 16)
  .venv/bin/scale-cl sweep cpt "${common[@]}" --methods fft scale_preserve scale_route --eval.up_logit_scales 1 \
    --eval.likelihood_control true --out "outputs/sweep-router-$domain" "$@"
  .venv/bin/scale-cl sweep cpt "${common[@]}" --methods scale_route --reference scale_route \
    --options.scale.router likelihood \
    --out "outputs/sweep-router-$domain-route-router" "$@"
done
