"""Data parallelism: 2 processes (torchrun, DDP over gloo, 1 thread each) with grad_accum=1 train on the same
global batch as 1 process with grad_accum=2 (same micro-batches per step, data.StepSchedule), so the per-step
losses agree. Bitwise equality is not guaranteed: 1 vs 2 threads may split matmul reductions differently, and
the all-reduce sums the ranks' gradients in its own order (the /2 of both schemes is exact in binary floating
point). Those are float32 reassociations, ~1e-7 relative per step; 1e-5 leaves room for them to compound over
the run, while a real divergence (another micro-batch, a missing gradient sync, a rank-dependent noise seed)
moves the losses by 1e-3 or more from the second step on. (On the 2-core CI machine they come out equal.)"""
from __future__ import annotations

import json
import os
import sys

import pytest

from pipeline.lock import LOCK_PREFIX
from pipeline.train import checkpoint as ckpt
from pipeline.train.run import main
from tests.support.paths import REPO
from tests.support.tiny_runs import (
    EXPERIMENT,
    as_config,
    online_cli,
    overrides,
    run_cli,
    train_losses,
)

pytestmark = pytest.mark.cluster

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# What `accelerate launch --config_file conf/accelerate/deepspeed_zero2.yaml` puts in each process's environment.
DEEPSPEED_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "conf/deepspeed/zero2.json"}


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_two_processes_reproduce_one_process_with_the_same_global_batch(dump_root, tiny_model_dir, kind):
    # 7 micro-batches per epoch -> 3 steps of 2 per epoch; 8 steps cross two epoch boundaries and a resume point.
    common = dict(max_steps=8, epochs=3, save_every=4, eval_every=4, tau_prompts=1)
    one = overrides(dump_root, tiny_model_dir, kind, f"one-{kind}", grad_accum=2, **common)
    main(as_config(one))
    two = overrides(dump_root, tiny_model_dir, kind, f"two-{kind}", grad_accum=1, **common)
    out = run_cli(two, env={"OMP_NUM_THREADS": "1"}, launcher=TORCHRUN, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]

    ref = train_losses(dump_root / EXPERIMENT / "train" / f"one-{kind}")
    got = train_losses(dump_root / EXPERIMENT / "train" / f"two-{kind}")
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    assert len({round(v, 3) for v in ref.values()}) > 4  # the losses do move: the comparison has teeth

    two_dir = dump_root / EXPERIMENT / "train" / f"two-{kind}"
    last = ckpt.latest_checkpoint(two_dir)
    assert {p.name for p in last.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
    assert (two_dir / "manifest.json").is_file() and (two_dir / "final" / "model.safetensors").is_file()
    assert os.path.getsize(two_dir / "metrics.jsonl") > 0


def test_online_ranks_run_their_own_target_and_reproduce_one_process(dump_root, tiny_model_dir, shared_data):
    """train.source=online on 2 ranks: each rank loads its own target replica and computes the states of its own
    micro-batches. The losses equal one process's with grad_accum=2, as offline: a rank whose states were wrong
    or missing (zeros, another rank's rows) would move them from the first step."""
    common = dict(max_steps=4, epochs=2, save_every=2, eval_every=0, tau_prompts=0)
    runs = {}
    for name, accum, launcher in (("online-one", 2, None), ("online-two", 1, TORCHRUN)):
        d = {**overrides(dump_root, tiny_model_dir, "eagle3", name, grad_accum=accum, **common),
             **online_cli(shared_data)}
        out = run_cli(d, env={"OMP_NUM_THREADS": "1"}, launcher=launcher, timeout=180)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        runs[name] = dump_root / EXPERIMENT / "train" / name
    ref, got = train_losses(runs["online-one"]), train_losses(runs["online-two"])
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    manifest = json.loads((runs["online-two"] / "manifest.json").read_text())
    assert manifest["source"] == "online" and manifest["counts"]["world_size"] == 2


@pytest.mark.parametrize("launcher, processes", [("python", 1), ("torchrun", 2), ("accelerate", 2)])
def test_skip_under_deepspeed_is_refused_by_every_launcher_before_any_step(tmp_path, tiny_model_dir, launcher,
                                                                           processes):
    """train.on_nonfinite=skip with DeepSpeed asked for by the launcher, not the train config (which TrainConfig's
    own check cannot see): one process and torchrun's two with the variables accelerate sets, and accelerate launch
    itself with conf/accelerate/deepspeed_zero2.yaml. Each rank refuses in Parallel with the one line, before any
    row is read or step taken: the train folder holds nothing but the output locks. The launcher stops the other
    ranks at the first rank's exit, so a loaded machine may show one line where two ranks ran (CI, 2026-12-05)."""
    d = overrides(tmp_path, tiny_model_dir, "eagle3", "ds", on_nonfinite="skip", tau_prompts=0)
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(REPO / "conf" / "accelerate" / "deepspeed_zero2.yaml"), "--num_processes", "2"]
    out = run_cli(d, env={"OMP_NUM_THREADS": "1", **(DEEPSPEED_ENV if launcher != "accelerate" else {})},
                  launcher={"python": None, "torchrun": TORCHRUN, "accelerate": accelerate}[launcher], timeout=120)
    assert out.returncode != 0
    line = ("eaglet: train: TrainSetupError: train.on_nonfinite=skip cannot run under DeepSpeed (accelerate "
            "launch's DeepSpeed plugin, ACCELERATE_USE_DEEPSPEED=true)")
    assert 1 <= out.stderr.count(line) <= processes, out.stderr[-3000:]
    assert out.stderr.count("eaglet: ") == out.stderr.count(line), out.stderr[-3000:]  # nothing else went wrong
    train_dir = tmp_path / EXPERIMENT / "train" / "ds"
    assert {p.name for p in train_dir.iterdir()} <= {f"{LOCK_PREFIX}{r}" for r in range(processes)}
