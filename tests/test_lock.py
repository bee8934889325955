"""One writer per output folder (pipeline/lock.py): a second run of a stage into a folder another run is
writing is refused at once, naming the running one; a killed run leaves no stale lock; the ranks of one
multi-process job share a folder while a second job's ranks are refused -- with real processes, the real CLI
and a real torchrun job."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.dist import RankInfo
from pipeline.lock import HELD_SUFFIX, LOCK_PREFIX, OutputLock, OutputLocked
from tests.support.paths import REPO
from tests.support.tiny_runs import EXPERIMENT, overrides, run_cli

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


# Without flock (a file system that lacks it, simulated by tests/support/lock_holder.py), the heartbeat file
# lock must keep every guarantee of the flock one.
NO_FLOCK = {"EAGLET_TEST_NO_FLOCK": "1"}


@pytest.mark.cluster
@pytest.mark.parametrize("fs", [{}, NO_FLOCK], ids=["flock", "no-flock"])
def test_ranks_of_one_job_share_the_folder_and_a_second_job_is_refused(tmp_path, fs):
    port = 29611 if not fs else 29621
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    job = hold(tmp_path, env=fs, launcher=torchrun)  # both ranks of one real torchrun job hold the folder
    try:
        for rank, world in ((0, 2), (1, 2), (0, 1)):  # a second job, of either size, on any rank
            refused = try_lock(tmp_path, {**rank_env(rank, world, port + 1), **fs})
            assert refused.returncode == 3 and "is being written by another train run" in refused.stdout
    finally:
        stop(job)
    # A single-process run holds rank 0; a 2-rank job's rank 1 has its own file free, yet is refused while
    # rank 0 belongs to another job (it would write before its own rank 0 is turned away).
    single = hold(tmp_path, env=fs)
    try:
        refused = try_lock(tmp_path, {**rank_env(1, 2, port + 2), **fs})
        assert refused.returncode == 3 and f"pid {single.ranks[0]}" in refused.stdout
    finally:
        stop(single)
    assert try_lock(tmp_path, {**rank_env(1, 2, port + 2), **fs}).returncode == 0
    # the killed single run's lock file is taken over (its process is dead), and released
    assert try_lock(tmp_path, fs).returncode == 0
    assert not list(tmp_path.glob(f"*{HELD_SUFFIX}"))


def test_without_flock_a_heartbeat_file_holds_and_a_killed_holder_is_taken_over_at_once(tmp_path):
    holder = hold(tmp_path, env=NO_FLOCK)
    held = tmp_path / f"{LOCK_PREFIX}0{HELD_SUFFIX}"
    try:
        record = json.loads(held.read_text())
        assert record["pid"] == holder.ranks[0] and record["host"] == socket.gethostname()
        refused = try_lock(tmp_path, NO_FLOCK)
        assert refused.returncode == 3 and f"pid {holder.ranks[0]}" in refused.stdout
        # with flock working (auto), a second run still meets the heartbeat file of the first (a mixed cluster)
        assert try_lock(tmp_path, {}).returncode == 3
    finally:
        stop(holder)  # kill -9: the file stays behind, its holder is dead
    assert held.exists()
    t0 = time.monotonic()
    again = try_lock(tmp_path, NO_FLOCK)
    assert again.returncode == 0 and again.stdout.startswith("locked rank 0"), again.stdout + again.stderr
    assert time.monotonic() - t0 < 30 and not held.exists()


def test_a_file_locked_run_and_a_flocked_run_see_each_other(tmp_path):
    """EAGLET_LOCK=file in a job, the default in an interactive rerun on the same folder (or the reverse)."""
    for holder_env, second_env in (({"EAGLET_LOCK": "file"}, {}), ({}, {"EAGLET_LOCK": "file"})):
        holder = hold(tmp_path, env=holder_env)
        try:
            refused = try_lock(tmp_path, second_env)
            assert refused.returncode == 3 and f"pid {holder.ranks[0]}" in refused.stdout, refused.stdout
        finally:
            stop(holder)
        assert try_lock(tmp_path, second_env).returncode == 0  # the killed holder's lock, of either kind, is free


def test_flock_mode_refuses_to_run_unprotected(tmp_path):
    out = try_lock(tmp_path, {**NO_FLOCK, "EAGLET_LOCK": "flock"})
    assert out.returncode == 1 and "has no flock" in out.stderr and "EAGLET_LOCK=file" in out.stderr


def other_host_lock(directory: Path, age_s: float) -> Path:
    """A lock file left by a run on another node, its last heartbeat `age_s` ago."""
    held = directory / f"{LOCK_PREFIX}0{HELD_SUFFIX}"
    directory.mkdir(parents=True, exist_ok=True)
    held.write_text(json.dumps({"pid": 4242, "host": "node-b", "job": "77", "stage": "train", "token": "b",
                                "since": "earlier", "command": "python -m pipeline.run stage=train"}))
    os.utime(held, (time.time() - age_s,) * 2)
    return held


def test_a_lock_from_another_node_is_kept_while_it_beats_and_taken_over_once_it_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_LOCK", "file")
    monkeypatch.setenv("EAGLET_LOCK_STALE_S", "1")
    one = RankInfo(0, 1, 0)
    # A fresh heartbeat: refused at once, naming the other node's run.
    held = other_host_lock(tmp_path, age_s=0)
    with pytest.raises(OutputLocked, match="pid 4242 on node-b"):
        OutputLock(tmp_path, "train", one).__enter__()
    # An old-looking heartbeat that still moves (a node whose clock is behind): watched, and kept.
    os.utime(held, (time.time() - 3600,) * 2)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            os.utime(held, (os.stat(held).st_mtime + 0.2,) * 2)
    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(OutputLocked, match="node-b"):
            OutputLock(tmp_path, "train", one).__enter__()
    finally:
        stop.set()
        beating.join()
    # The heartbeat stands still for the stale time: the lock is taken over, this run's record replaces it.
    t0 = time.monotonic()
    with OutputLock(tmp_path, "train", one):
        assert 1.0 <= time.monotonic() - t0 < 10
        record = json.loads(held.read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        beat0 = held.stat().st_mtime_ns
        time.sleep(0.6)
        assert held.stat().st_mtime_ns > beat0  # this run's heartbeat
    assert not held.exists()


def test_a_run_whose_lock_was_taken_over_stops_and_a_passing_read_error_does_not_stop_it(tmp_path):
    env = {**NO_FLOCK, "EAGLET_LOCK_STALE_S": "0.4"}  # a beat every 0.1 s
    holder = hold(tmp_path, env=env)
    held = tmp_path / f"{LOCK_PREFIX}0{HELD_SUFFIX}"
    try:
        record = held.read_text()
        held.write_text("{not json")  # what a torn read looks like: tried again at the next beat
        time.sleep(0.5)
        held.write_text(record)
        time.sleep(0.5)
        assert holder.poll() is None
        held.write_text(json.dumps({**json.loads(record), "token": "another run"}))  # taken over
        assert holder.wait(timeout=10) == -signal.SIGTERM  # stopped as a stop signal stops it
    finally:
        if holder.poll() is None:
            stop(holder)
