#!/usr/bin/env bash
# Submit the pipeline as a chain of Slurm jobs, regen -> dump -> train -> eval -> export: each job starts
# only when the previous one succeeded (--dependency=afterok), and a failure cancels the rest of the chain.
#
#   jobs/submit_chain.sh experiment=<name> [key=value ...]            Hydra overrides: every stage gets them
#   jobs/submit_chain.sh --partition=gpu --account=proj -- experiment=<name> head=eagle1
#                        \____ sbatch options for every job ____/
#   STAGES="train eval export" jobs/submit_chain.sh experiment=<name>     start from an existing dump
#   jobs/submit_chain.sh experiment=<name> train.source=online            no dump job: train computes the states
#   TRAIN_SBATCH="--nodes=4 --time=48:00:00" jobs/submit_chain.sh ...     sbatch options for one stage
#                                                                        (REGEN_SBATCH, DUMP_SBATCH, ...)
#   GRACE=900 jobs/submit_chain.sh experiment=<name>     train's checkpoint gets 900 s when stopped (jobs/common.sh)
# Prints "<stage> <job id>" per job. Logs: jobs/logs/<job name>-<job id>.out.
set -euo pipefail
cd "$(dirname "$0")/.."

sbatch_options=()
if [[ " $* " == *" -- "* ]]; then
  while [[ $1 != -- ]]; do sbatch_options+=("$1"); shift; done
  shift
fi

dependency=()
default_stages="regen dump train eval export"
[[ " $* " == *" train.source=online "* ]] && default_stages="regen train eval export"
for stage in ${STAGES:-$default_stages}; do
  [[ -f jobs/$stage.sbatch ]] || { echo "submit_chain: no job script jobs/$stage.sbatch" >&2; exit 2; }
  per_stage="${stage^^}_SBATCH"
  grace=()
  [[ $stage == train && -n ${GRACE:-} ]] && grace=(--signal="B:USR1@$GRACE")
  # shellcheck disable=SC2086  # per-stage options are a word list on purpose
  id=$(sbatch --parsable "${dependency[@]}" "${grace[@]}" "${sbatch_options[@]}" ${!per_stage:-} "jobs/$stage.sbatch" \
    "$@")
  id=${id%%;*}  # --parsable prints "id" or "id;cluster"
  echo "$stage $id"
  dependency=(--dependency="afterok:$id" --kill-on-invalid-dep=yes)
done
