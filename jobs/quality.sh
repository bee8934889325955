#!/usr/bin/env bash
# The SmolLM2 quality experiment (docs/results/quality.md): every command behind the results table, in
# order. Every step is resumable: kill it (or give eval a time budget) and rerun the same line to continue,
# so the experiment can be finished in pieces on a small machine.
#
#   jobs/quality.sh                          # everything (hours on 2 CPU cores; minutes on a GPU)
#   EVAL_BUDGET_S=600 jobs/quality.sh        # each eval run stops after ~10 minutes; rerun to continue
#   jobs/quality.sh data.root=/data/eaglet   # overrides go to every stage
set -euo pipefail
cd "$(dirname "$0")/.."
EXP=(experiment=smollm2_quality "$@")
BUDGET=()
[[ -n "${EVAL_BUDGET_S:-}" ]] && BUDGET=("eval.time_budget_s=${EVAL_BUDGET_S}")
run() { python -m pipeline.run "$@"; }

run stage=regen "${EXP[@]}"
run stage=dump "${EXP[@]}"
for head in eagle3 eagle1; do
  run stage=train head=$head "${EXP[@]}"
done

# Evaluation. Speedup is measured against vanilla decoding on the first 10 questions of each set (the
# baseline doubles a CPU eval); tau covers every question.
evals=(
  "eval.baseline_limit=10"                                                     # MT-bench, 80 x 2 turns, T=0
  "eval.questions=\${data.root}/mt_bench/question.jsonl eval.limit=20 eval.temperature=1 eval.baseline_limit=10"
)
for set in alpaca gsm8k humaneval qa sum; do
  evals+=("eval.questions=\${data.root}/eagle_bench/$set/question.jsonl eval.limit=20 eval.baseline_limit=10")
done
for head in eagle3 eagle1; do
  for e in "${evals[@]}"; do
    # shellcheck disable=SC2086  # each entry is a list of overrides
    run stage=eval head=$head $e "${BUDGET[@]}" "${EXP[@]}"
  done
  run stage=export head=$head "${EXP[@]}"
done
python -m pipeline.eval.table outputs/smollm2_quality
