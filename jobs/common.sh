# Sourced by every jobs/*.sbatch script: the Slurm mechanics, written once. Hyperparameters never live
# here or in the job scripts; they are in conf/ and reach the stages as Hydra overrides ("$@").
#
# Layout the scripts assume: one Slurm task per GPU (--ntasks-per-node = GPUs per node). regen, dump and
# eval start one python per task (`srun python -m pipeline.run ...`, rank = SLURM_PROCID); train starts one
# torchrun per node that spawns one process per task slot.

# = pipeline.train.checkpoint.REQUEUE_EXIT_CODE (tests/test_slurm.py checks that the two agree): the train
# stage saved a checkpoint on SIGTERM/SIGUSR1 and wants to be run again.
REQUEUE_EXIT_CODE=75

set -uo pipefail

# sbatch copies the script into Slurm's spool directory, so the repository is where sbatch was called
# (or EAGLET_ROOT): run the code and resolve relative paths (outputs/, conf/) from there.
cd "${EAGLET_ROOT:-$SLURM_SUBMIT_DIR}" || exit 1

# srun (since Slurm 22.05) no longer inherits the allocation's --cpus-per-task; pass it on explicitly.
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
# Every process gets the threads of the CPUs Slurm gave its task, not one per core of the whole node
# (several ranks share a node: oversubscribed OpenMP pools are slower than small ones).
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1} MKL_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

echo "[eaglet] $(date -Is) job ${SLURM_JOB_ID} (${SLURM_JOB_NAME}) attempt $((${SLURM_RESTART_COUNT:-0} + 1))" \
  "on ${SLURM_JOB_NODELIST}: ${SLURM_NNODES} node(s) x ${SLURM_NTASKS_PER_NODE:-1} task(s)," \
  "${SLURM_CPUS_PER_TASK:-1} CPU(s) and ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node; overrides: $*"

# Address of the allocation's first node, where torchrun's c10d rendezvous listens. NodeAddr is how
# Slurm itself reaches the node, so it also works where node names do not resolve between nodes.
first_node_addr() {
  local head
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  scontrol show node "$head" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'
}

# A rendezvous port per job, so two jobs sharing a first node do not collide (override: EAGLET_RDZV_PORT).
RDZV_PORT=${EAGLET_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# The target's layout (target.tensor_parallel): TP consecutive tasks hold ONE target sharded TP ways by
# transformers' tensor parallelism, in dump, online training, eval and train's tau probe; the job's tasks / TP are
# the data-parallel replicas. E.g. 2 nodes x 8 GPUs with TP=8: two groups (DP 2), one per node. TP must divide the
# job's tasks and the target's attention and key/value heads; unset: 1 (a whole target per task). Passed to
# every stage before the job's own overrides (which win):  TP=8 sbatch --nodes=2 jobs/dump.sbatch experiment=...
# Eval decodes on one group: sbatch --ntasks-per-node=8 --gpus-per-node=8 with TP=8.
if [[ -n ${TP:-} ]]; then
  set -- "target.tensor_parallel=${TP}" "$@"
  # The tasks srun starts without torchrun (dump, eval) meet at the first node (rank = SLURM_PROCID).
  if ((TP > 1)); then
    export MASTER_ADDR=${MASTER_ADDR:-$(first_node_addr)} MASTER_PORT=${MASTER_PORT:-$((RDZV_PORT + 1))}
  fi
fi

# GRACE: seconds a stopping train stage gets to write its checkpoint (default 300; a 70B head's checkpoint is
# ~17 GB: size GRACE from bench/results/checkpoint.json, docs/cluster.md "Time limits and preemption").
#  - The time-limit warning comes GRACE seconds ahead: submit with --signal=B:USR1@$GRACE (submit_chain.sh does
#    when GRACE is set; train.sbatch's own line is the default's, 300).
#  - torchrun forwards SIGTERM to its workers and SIGKILLs them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds,
#    30 by default: too short for a large checkpoint, so GRACE here too (the pinned torch 2.13 reads it).
# Preemption's own window (the partition's GraceTime, or KillWait) is the cluster's, not the job's.
GRACE=${GRACE:-300}
# 30 s of GRACE are kept for what follows the save (the exit, the script's requeue) before the time limit.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$(( GRACE > 60 ? GRACE - 30 : 30 ))}

# run_resumable <srun command...>: run the job's step so that the job survives time limits and preemption.
#  - SIGUSR1 (`#SBATCH --signal=B:USR1@<s>`: the time limit is <s> seconds away) reaches only this shell.
#    Ask every task to stop (SIGTERM: the trainer checkpoints and exits REQUEUE_EXIT_CODE; regen/dump
#    keep their finished shards), wait for them, and requeue the job: the rerun resumes.
#  - SIGTERM (scancel, preemption, `scontrol requeue`): Slurm signals the tasks itself and requeues the
#    job when that was asked for. Only wait, so the checkpoint is written within KillWait.
# A task exiting REQUEUE_EXIT_CODE on its own (e.g. a signal sent to the tasks only) also requeues.
run_resumable() {
  local stop=0 rc pid
  trap 'stop=1; echo "[eaglet] $(date -Is) SIGUSR1: time limit near, stopping the tasks to requeue";
        scancel --signal=TERM "$SLURM_JOB_ID"' USR1
  trap 'echo "[eaglet] $(date -Is) SIGTERM: waiting for the tasks to save and exit"' TERM
  "$@" &
  pid=$!
  # A trapped signal interrupts `wait` while the step still runs: wait again until it is gone, then
  # collect its exit status (bash keeps it for a finished background job).
  while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
  wait "$pid"
  rc=$?
  trap - USR1 TERM
  # rc 0 after a stop request: the stage finished before it saw the signal; nothing to resume.
  if ((rc == REQUEUE_EXIT_CODE)) || ((stop && rc != 0)); then
    echo "[eaglet] $(date -Is) step exited ${rc} after a stop request: requeueing job ${SLURM_JOB_ID}"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "[eaglet] scontrol requeue refused (is the job submitted with --requeue?)" >&2
  fi
  exit "$rc"
}
