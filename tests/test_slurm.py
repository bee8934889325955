"""The Slurm launch path, for real: a local cluster (tests/support/slurm_cluster.py: munged, slurmctld, two emulated
nodes on localhost) runs the project's own jobs/*.sbatch, chained by jobs/submit_chain.sh, on a tiny experiment.
Regen and dump run one rank per node (each rank its own share), train is a two-node torchrun rendezvous (DDP
through accelerate). During training the job is first told its time limit is near (the `--signal=B:USR1`
path: checkpoint, exit, requeue itself), then requeued by `scontrol requeue`; it resumes both times and the
chain finishes. A Hydra sweep through hydra-submitit-launcher (`hydra/launcher=slurm`) trains two heads as two
Slurm jobs.

The Slurm tests need Debian's slurm-wlm and munge, and root: skipped without them, except under CI=true
where they fail instead. jobs/run_all.sh, the local equivalent of the chain, runs without Slurm."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.slurm_cluster import LocalSlurmCluster, missing_binaries, parse_record

pytestmark = [pytest.mark.cluster, pytest.mark.chain]

JOBS = REPO / "jobs"
STAGE_SCRIPTS = ("regen", "dump", "train", "eval", "export")


# Every job gets one CPU per task, no GPU, and a time limit that turns a hang into a failure.
SBATCH_COMMON = ["--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
TRAIN_STEPS = 300
SAVE_EVERY = 20


@pytest.fixture(scope="module")
def cluster():
    missing = missing_binaries()
    if (missing or os.geteuid() != 0) and os.environ.get("CI", "").lower() != "true":
        pytest.skip(f"a local Slurm needs root and {', '.join(missing) or 'nothing else'} (apt-get install "
                    "slurm-wlm munge); under CI=true these tests fail instead of skipping")
    with LocalSlurmCluster(nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_model_dir) -> dict:
    """A tiny experiment: the tiny Llama as target, a few short regenerated answers, a small head."""
    root = tmp_path_factory.mktemp("slurm_experiment")
    (root / "logs").mkdir()
    overrides = [
        "target=hf", f"target.path={tiny_model_dir}", "target.name=tiny", "target.gguf_package=null",
        f"output_root={root / 'outputs'}", "name=slurm", "wandb.mode=disabled",
        # 8 conversations in 4 regen shards and 4 dump shards: two per rank.
        "regen.limit=8", "regen.max_new_tokens=12", "regen.batch_size=2", "regen.batches_per_shard=1",
        "dump.max_batch_size=2", "dump.shard_bytes=100000",
        "head.draft_vocab_size=64",
        # Small micro-batches: several steps per epoch, and enough steps to interrupt the run twice.
        f"train.max_steps={TRAIN_STEPS}", "train.epochs=1000", "train.micro_batch_tokens=64",
        f"train.save_every={SAVE_EVERY}", "train.eval_every=0", "train.tau_prompts=0", "train.plot=false",
        "train.warmup_steps=2",
        "eval.limit=2", "eval.max_new_tokens=8",
    ]
    return {"root": root, "out": root / "outputs" / "slurm", "overrides": overrides,
            "sbatch": SBATCH_COMMON + [f"--output={root / 'logs'}/%x-%j.out"]}


def test_requeue_exit_code_agrees_with_the_trainer():
    from pipeline.train.checkpoint import REQUEUE_EXIT_CODE

    match = re.search(r"^REQUEUE_EXIT_CODE=(\d+)$", (JOBS / "common.sh").read_text(), re.M)
    assert match and int(match.group(1)) == REQUEUE_EXIT_CODE


@pytest.mark.parametrize("stage", STAGE_SCRIPTS)
def test_job_scripts_are_thin(stage):
    """An #SBATCH header, the shared mechanics, and one srun line that hands every argument to Hydra."""
    path = JOBS / f"{stage}.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert re.search(r"^#SBATCH --job-name=eaglet-" + stage + "$", text, re.M)
    body = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert body[0].startswith("source ") and body[0].endswith("/jobs/common.sh\"")
    command = " ".join(line.rstrip("\\") for line in body[1:])
    assert re.search(r"\bsrun\b", command)
    assert re.search(rf"(python|torchrun .*) -m pipeline\.run stage={stage} \"\$@\"$", command)
    # No hyperparameters in shell: the only Hydra override a script sets is its stage.
    assert re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+=\S+", command) == []


def test_run_all_locally_on_two_ranks(tmp_path, experiment):
    """jobs/run_all.sh, no Slurm: every stage in turn, regen/dump/train on two torchrun ranks."""
    overrides = [o.replace(str(experiment["root"] / "outputs"), str(tmp_path)) for o in experiment["overrides"]
                 if not o.startswith("train.max_steps=")]
    env = {k: v for k, v in os.environ.items() if not re.match(r"SLURM_|RANK$|WORLD_SIZE$|LOCAL_RANK$|MASTER_", k)}
    env.update(NPROC="2", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(JOBS / "run_all.sh"), *overrides, "train.max_steps=4"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "slurm"
    for stage_dir in ("regen", "dump", "train/eagle3"):
        assert (out / stage_dir / "manifest.json").is_file(), stage_dir
    assert list((out / "eval" / "eagle3").glob("*/summary.json"))
    assert list((out / "export" / "eagle3").glob("*/model.safetensors"))
    assert json.loads((out / "train" / "eagle3" / "manifest.json").read_text())["counts"]["world_size"] == 2


def _checkpoints(train_dir: Path) -> list[int]:
    root = train_dir / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) if root.is_dir() else []


@pytest.fixture(scope="module")
def chain(cluster, experiment) -> dict:
    """Submit the whole chain; interrupt training twice (time-limit signal, then scontrol requeue)."""
    # One rank per (emulated) node for the parallel stages; eval and export take one task on one node.
    env = dict(cluster.env, STAGES=" ".join(STAGE_SCRIPTS),
               REGEN_SBATCH="--nodes=2", DUMP_SBATCH="--nodes=2", TRAIN_SBATCH="--nodes=2")
    t0 = time.time()
    proc = subprocess.run([str(JOBS / "submit_chain.sh"), *experiment["sbatch"], "--", *experiment["overrides"]],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids = dict(line.split() for line in proc.stdout.splitlines())
    assert list(ids) == list(STAGE_SCRIPTS)
    train, train_dir = ids["train"], experiment["out"] / "train" / "eagle3"
    logs = experiment["root"] / "logs"

    def running_with_checkpoint_after(step: int):
        def ready():
            if cluster.state(train) != "RUNNING":
                return None
            later = [s for s in _checkpoints(train_dir) if s > step]
            return later[0] if later else None
        return ready

    try:
        # 1. The time limit is near: Slurm would send `--signal=B:USR1@300` to the batch shell; send it now.
        first = cluster.wait_until(running_with_checkpoint_after(0), 240, "a first train checkpoint")
        cluster.run("scancel", "--signal=USR1", "--batch", train)
        cluster.wait_until(lambda: cluster.job(train)["Restarts"] == "1", 60, "train to requeue itself")
        # 2. Preemption / an operator's requeue, once the second attempt has saved a later checkpoint.
        before = max(_checkpoints(train_dir))
        cluster.wait_until(running_with_checkpoint_after(before), 120, "a checkpoint of the second attempt")
        cluster.run("scontrol", "requeue", train)
        final = cluster.wait(ids.values(), timeout=300)
    except Exception:
        for log in sorted(logs.glob("*.out")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        raise
    wall = time.time() - t0
    records = {stage: final[job_id] for stage, job_id in ids.items()}
    _print_wall_times(cluster, ids, wall)
    return {"ids": ids, "records": records, "logs": logs, "first_checkpoint": first, "train_dir": train_dir,
            "wall_s": wall}


def _print_wall_times(cluster, ids: dict, wall: float) -> None:
    """Per job: attempts and seconds spent running (from the job completion log, one line per attempt)."""
    lines = (cluster.root / "log" / "jobcomp.txt").read_text().splitlines()
    print(f"\nslurm chain: {wall:.0f} s from submission to the last job's end")
    for stage, job_id in ids.items():
        attempts = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines if line.startswith(f"JobId={job_id} ")]
        seconds = sum((datetime.fromisoformat(a["EndTime"]) - datetime.fromisoformat(a["StartTime"])).total_seconds()
                      for a in attempts)
        print(f"  {stage:7s} job {job_id}: {len(attempts)} attempt(s), {seconds:.0f} s running, "
              f"final {attempts[-1]['JobState'] if attempts else '?'}")


def test_chain_completes_in_order(chain):
    records = chain["records"]
    for stage, record in records.items():
        assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (stage, record)
    starts = [datetime.fromisoformat(records[s]["StartTime"]) for s in STAGE_SCRIPTS]
    ends = [datetime.fromisoformat(records[s]["EndTime"]) for s in STAGE_SCRIPTS]
    assert all(start >= end for start, end in zip(starts[1:], ends[:-1])), "afterok: a stage started early"


def test_regen_and_dump_split_across_ranks(chain, experiment):
    """Two ranks, each its own deterministic share: shard k is written by rank k % 2."""
    out = experiment["out"]
    regen = json.loads((out / "regen" / "manifest.json").read_text())
    assert regen["counts"]["conversations"] == 8
    assert [s["rank"] for s in regen["shards"]] == [0, 1, 0, 1]
    dump = json.loads((out / "dump" / "manifest.json").read_text())
    assert dump["counts"]["rows"] == 8 and len(dump["shards"]) == 4
    log = (chain["logs"] / f"eaglet-dump-{chain['ids']['dump']}.out").read_text()
    assert "2 node(s) x 1 task(s)" in log
    written = dict(re.findall(r"rank (\d)/2 writes (\d+) shards", log))
    assert written == {"0": "2", "1": "2"}, written


def test_train_was_two_node_ddp_and_resumed_twice(chain, experiment):
    record, train_dir = chain["records"]["train"], chain["train_dir"]
    assert record["Restarts"] == "2"
    log = (chain["logs"] / f"eaglet-train-{chain['ids']['train']}.out").read_text()
    assert log.count("attempt ") == 3 and "attempt 3 on n[1-2]: 2 node(s)" in log
    assert "SIGUSR1: time limit near" in log and "requeueing job" in log
    # Every rank logs its resume: two ranks x two resumes, from two checkpoints (the stop of attempt 1, the
    # stop of attempt 2), both before the end.
    resumed = [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+) of \d+\)", log)]
    assert len(resumed) == 4 and len(set(resumed)) == 2, resumed
    assert chain["first_checkpoint"] <= min(resumed) < max(resumed) < TRAIN_STEPS, resumed
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert manifest["counts"]["world_size"] == 2
    assert manifest["counts"]["steps"] == TRAIN_STEPS
    assert (train_dir / "final" / "model.safetensors").is_file()


def test_eval_and_export_outputs(chain, experiment):
    out = experiment["out"]
    assert list((out / "eval" / "eagle3").glob("*/summary.json"))
    assert list((out / "export" / "eagle3").glob("*/model.safetensors"))


def test_hydra_submitit_sweep_trains_two_heads(cluster, experiment, chain):
    """`-m head=eagle1,eagle3 hydra/launcher=slurm`: one Slurm job per head (an array), on the chain's dump."""
    launcher = ["hydra/launcher=slurm", "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1",
                "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=0", "hydra.launcher.timeout_min=10"]
    # A sweep over kinds sets only what every kind has: eagle1 has no draft vocabulary, and head.draft_vocab_size
    # would fail its job at compose (an eagle3-only option goes in conf/head_recipe/eagle3/<experiment>.yaml).
    overrides = [o for o in experiment["overrides"] if not o.startswith(("train.max_steps=", "head.draft_vocab_size="))]
    cmd = [sys.executable, "-m", "pipeline.run", "-m", "stage=train", "head=eagle1,eagle3",
           "head.name=sweep_${head.kind}", "train.max_steps=6", *overrides, *launcher]
    proc = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = map(parse_record, cluster.run("scontrol", "show", "job", "-o").stdout.splitlines())
    arrays = {r["ArrayJobId"] for r in records if r.get("JobName") == "eaglet-sweep"}
    assert len(arrays) == 1, arrays
    # submitit returns once both results are written; the tasks may still be COMPLETING.
    sweep = list(cluster.wait(arrays, timeout=60).values())
    assert {r["ArrayTaskId"] for r in sweep} == {"0", "1"}, sweep
    assert all(r["JobState"] == "COMPLETED" for r in sweep), sweep
    for kind in ("eagle1", "eagle3"):
        manifest = json.loads((experiment["out"] / "train" / f"sweep_{kind}" / "manifest.json").read_text())
        assert manifest["counts"]["steps"] == 6 and manifest["config"]["head"]["kind"] == kind


def test_a_failed_stage_cancels_the_rest_of_the_chain(cluster, experiment):
    """export of a head that was never trained fails; the eval job queued behind it is cancelled, not left
    pending forever."""
    overrides = [o.replace("name=slurm", "name=never_trained") for o in experiment["overrides"]]
    env = dict(cluster.env, STAGES="export eval")
    proc = subprocess.run([str(JOBS / "submit_chain.sh"), *experiment["sbatch"], "--", *overrides], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids = dict(line.split() for line in proc.stdout.splitlines())
    final = cluster.wait(ids.values(), timeout=120)
    export, eval_ = final[ids["export"]], final[ids["eval"]]
    assert export["JobState"] == "FAILED" and export["ExitCode"] != "0:0"
    assert eval_["JobState"] == "CANCELLED" and eval_["Reason"] == "DependencyNeverSatisfied"
    log = (experiment["root"] / "logs" / f"eaglet-export-{ids['export']}.out").read_text()
    assert "never_trained" in log
