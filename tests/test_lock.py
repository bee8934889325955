"""One writer per output folder (pipeline/lock.py): a second run of a stage into a folder another run is
writing is refused at once, naming the running one; a killed run leaves no stale lock; the ranks of one
multi-process job share a folder while a second job's ranks are refused -- with real processes, the real CLI
and a real torchrun job."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.test_train import EXPERIMENT, overrides, run_cli

REPO = Path(__file__).resolve().parents[1]
HOLDER = ["-m", "tests.support.lock_holder"]  # run from the repository root (cwd=REPO)


def hold(directory: Path, env: dict | None = None, launcher: list[str] | None = None, seconds: float = 120):
    """A process (or a torchrun job) holding the lock of `directory`; returns once every rank holds it."""
    cmd = (launcher or [sys.executable]) + [*HOLDER, str(directory), str(seconds)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    lines = [proc.stdout.readline() for _ in range(2 if launcher else 1)]
    proc.ranks = [int(line.split()[-1]) for line in lines if line.startswith("locked rank")]
    if len(proc.ranks) != len(lines):
        stop(proc)
        raise AssertionError(lines)
    return proc


def stop(proc: subprocess.Popen) -> None:
    """kill -9 of every rank (torchrun starts each worker in a session of its own) and the launcher."""
    for pid in getattr(proc, "ranks", []):
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def try_lock(directory: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *HOLDER, str(directory), "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_a_second_run_is_refused_at_once_and_a_killed_run_leaves_no_stale_lock(tmp_path, tiny_model_dir):
    train_dir = tmp_path / EXPERIMENT / "train" / "h"
    holder = hold(train_dir)
    try:
        t0 = time.monotonic()
        refused = run_cli(overrides(tmp_path, tiny_model_dir, "eagle3", "h"))
        assert refused.returncode == 1
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith(f"eaglet: train: OutputLocked: {train_dir} is being written by another train run: "
                               f"pid {holder.ranks[0]} on ") and "lock_holder.py" in line, line
        assert time.monotonic() - t0 < 60  # refused before loading anything heavy (no dump exists here at all)
    finally:
        stop(holder)  # kill -9: the kernel drops its flock
    again = try_lock(train_dir, {})
    assert again.returncode == 0 and again.stdout.startswith("locked rank 0")


def rank_env(rank: int, world: int, port: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def test_ranks_of_one_job_share_the_folder_and_a_second_job_is_refused(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29611"]
    job = hold(tmp_path, launcher=torchrun)  # both ranks of one real torchrun job hold the folder together
    try:
        for rank, world in ((0, 2), (1, 2), (0, 1)):  # a second job, of either size, on any rank
            refused = try_lock(tmp_path, rank_env(rank, world, 29612))
            assert refused.returncode == 3 and "is being written by another train run" in refused.stdout
    finally:
        stop(job)
    # A single-process run holds rank 0; a 2-rank job's rank 1 has its own file free, yet is refused while
    # rank 0 belongs to another job (it would write before its own rank 0 is turned away).
    single = hold(tmp_path)
    try:
        refused = try_lock(tmp_path, rank_env(1, 2, 29613))
        assert refused.returncode == 3 and f"pid {single.ranks[0]}" in refused.stdout
    finally:
        stop(single)
    assert try_lock(tmp_path, rank_env(1, 2, 29613)).returncode == 0
