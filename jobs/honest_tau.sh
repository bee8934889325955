#!/usr/bin/env bash
# The headline figures of the committed head, re-measured as shipped (docs/results/quality.md, the model card):
# heads/smollm2-135m-instruct-eagle3 evaluated from its export folder (eval.head_dir) in fp32, where the greedy check
# is exact, with the baseline (= the check) on every question, so every T=0 turn is proved to be the target's greedy
# output. Each finished eval goes into the results store, and a rerun (a fresh machine too) skips what the store holds;
# an unfinished eval resumes from its answers.partial.jsonl where outputs/ kept it.
#
#   nohup jobs/honest_tau.sh > honest_tau.log 2>&1 &       # ~45 min for MT-bench, ~5 min per 20-question set
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" WANDB_MODE=disabled
HEAD=heads/smollm2-135m-instruct-eagle3
STORE=results/smollm2_quality_v2
common=(stage=eval experiment=smollm2_quality_v2 "eval.head_dir=$HEAD" target.dtype=float32 eval.baseline=true
        eval.greedy_check=null)
evals=(
  ""                                                                   # MT-bench, all 80 questions, both turns
)
for set in alpaca gsm8k humaneval qa sum; do
  evals+=("eval.questions=\${data.root}/eagle_bench/$set/question.jsonl eval.limit=20")
done
evals+=("eval.limit=20 eval.temperature=1 eval.baseline=false")       # sampling: no greedy path to check
for e in "${evals[@]}"; do
  # shellcheck disable=SC2086
  if python -m pipeline.results has "$STORE" "${common[@]}" $e; then continue; fi  # the store holds it
  # shellcheck disable=SC2086
  python -m pipeline.run "${common[@]}" $e
  python -m pipeline.results save outputs/smollm2_quality_v2 "$STORE"
done
