#!/usr/bin/env bash
# Start here. The whole pipeline on this machine, one stage after another: exactly the commands the Slurm
# jobs (jobs/*.sbatch, chained by jobs/submit_chain.sh) run on a cluster, minus srun. Every stage reads the
# previous stage's output under outputs/<experiment>/, checks its manifest.json, and resumes if rerun.
#
#   jobs/run_all.sh experiment=demo                  # what `make demo` does, stage by stage
#   jobs/run_all.sh experiment=demo head=eagle1      # any Hydra override goes to every stage
#   NPROC=8 jobs/run_all.sh experiment=demo          # a multi-GPU machine: 8 ranks for regen, dump and train
#   jobs/run_all.sh experiment=demo train.source=online   # no dump: train computes the states itself
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-1}

# Runs one stage on NPROC ranks. torchrun sets RANK/WORLD_SIZE; regen and dump split their work by rank
# (each rank a disjoint, deterministic share), train runs data-parallel through accelerate.
stage() {
  if ((NPROC > 1)); then
    torchrun --standalone --nproc-per-node="$NPROC" -m pipeline.run "stage=$1" "${@:2}"
  else
    python -m pipeline.run "stage=$1" "${@:2}"
  fi
}

# 1. regen: the target answers the training prompts itself, so the head learns the distribution it will
#    draft for at serving time (outputs/<experiment>/regen/, ShareGPT shards).
stage regen "$@"
# 2. dump: one forward pass of the target over every conversation; its hidden states (three aux layers +
#    the final norm output) go to Arrow shards (outputs/<experiment>/dump/). Skipped with train.source=online.
[[ " $* " == *" train.source=online "* ]] || stage dump "$@"
# 3. train: the draft head learns to predict the target's next features/tokens from the dump (or, online,
#    from the target run inside the job on regen's conversations); checkpoints
#    every train.save_every steps and resumes from the last one when rerun (outputs/<experiment>/train/<head>/).
stage train "$@"
# 4. eval: speculative decoding with the head (EAGLE-2 dynamic tree) against plain decoding; writes tau
#    (accepted tokens per target forward) and the speedup. One process: decoding is one request at a time.
python -m pipeline.run stage=eval "$@"
# 5. export: the head as config.json + model.safetensors that SGLang / vLLM load as a draft model.
python -m pipeline.run stage=export "$@"
