#!/usr/bin/env bash
# The method bench (docs/results/methods.md, "Methods compared"): every step in order, each resumable (rerun the same
# line to continue). Costs are for a 2-core CPU (AMD EPYC, AVX512-BF16) at the rates of docs/results/methods.md.
#
#   jobs/methods.sh data       # regen (llama.cpp, ~90k answer tokens, ~15 min) and the bf16 dump (~3 min)
#   jobs/methods.sh heads      # EAGLE-3, EAGLE-3 + 3.1, EAGLE-1, Medusa-1: one budget (~25 min)
#   jobs/methods.sh ablation   # EAGLE-3 against 3.1, decoded with the deep default tree (~5 min; CELLS=1: each option alone)
#   jobs/methods.sh table      # python -m bench.bench_methods: every method on 40 MT-bench questions (~70 min)
#   jobs/methods.sh analyses   # python -m bench.analyses: chain and tree sweeps, the template experiment, a tree picture
# Extra Hydra overrides go to every stage: jobs/methods.sh data data.root=/data/eaglet
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?"step: data | heads | ablation | table | analyses"}; shift
EXP=(experiment=smollm2_methods "$@")
run() { python -m pipeline.run "$@"; }

case $STEP in
data)
  run stage=regen "${EXP[@]}"
  run stage=dump "${EXP[@]}"
  ;;
heads)
  # One budget for every trained method: the experiment's epochs, lr, schedule and micro-batch.
  run stage=train head=eagle3 "${EXP[@]}"
  run stage=train head=eagle3 head.name=eagle3-31 head.fc_norm=true head.norm_output=true "${EXP[@]}"
  run stage=train head=eagle1 "${EXP[@]}"
  run stage=train head=medusa "${EXP[@]}"
  ;;
ablation)
  # The 3.1 ablation (docs/results/methods.md, "EAGLE-3.1 options"): decoded tau with the default deep tree, where the
  # later draft rounds count (the table's CPU trees are one level deep). CELLS=1 adds each option alone.
  heads=(eagle3 eagle3-31)
  if [[ -n "${CELLS:-}" ]]; then
    run stage=train head=eagle3 head.name=eagle3-fcnorm head.fc_norm=true "${EXP[@]}"
    run stage=train head=eagle3 head.name=eagle3-normout head.norm_output=true "${EXP[@]}"
    heads+=(eagle3-fcnorm eagle3-normout)
  fi
  for h in "${heads[@]}"; do
    run stage=eval head=eagle3 head.name="$h" eval.limit=6 eval.baseline=false tree.top_k=10 tree.depth=6 \
      tree.total_tokens=60 "${EXP[@]}"
  done
  ;;
table)
  python -m bench.bench_methods
  ;;
analyses)
  python -m bench.analyses
  ;;
*)
  echo "unknown step $STEP: data | heads | ablation | table | analyses" >&2; exit 2
  ;;
esac
