"""One writer per output folder: a stage holds an exclusive `flock` on `<stage dir>/.eaglet-lock.rank<R>`
while it runs, so a second run of the same stage into the same folder is refused at once, with a message
naming the running one, instead of two processes interleaving shards, checkpoints or manifests.

The kernel drops a flock when its process dies (kill -9 included), so a lock is never stale and nothing
needs cleaning up. Each rank of a multi-process job locks its own file: the ranks of one job never collide,
while every rank of a second job meets its counterpart. A rank > 0 also checks that rank 0's lock, if held,
belongs to its own job (same launcher job id, when the launcher gives one): a second job's rank 1 does not
start writing while its rank 0 is being refused. flock is local to a machine on some network filesystems
(NFS emulates it with POSIX locks, Lustre needs `-o flock`): ranks of two jobs on different nodes are held
apart only where it is not."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.dist import RankInfo, rank_info
from pipeline.redact import redact_argv

LOCK_PREFIX = ".eaglet-lock.rank"
log = logging.getLogger(__name__)


class OutputLocked(RuntimeError):
    pass


def job_id() -> Optional[str]:
    """What the ranks of one job share and another job does not: the launcher's ids. None when there are none
    (ranks started by hand with RANK/WORLD_SIZE): then ranks > 0 cannot tell their rank 0 from another job's
    and rely on their own lock file alone."""
    env = os.environ
    # torchrun's TORCHELASTIC_RUN_ID is "none" for every standalone job; its rendezvous port is not shared.
    # Every id present counts: two runs started from one Slurm step differ by their torchrun port.
    keys = [k for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT") if k in env]
    return ":".join(env[k] for k in keys) if keys else None


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (starting)"
    return (f"pid {holder.get('pid')} on {holder.get('host')} (job {holder.get('job')}), running since "
            f"{holder.get('since')}: {holder.get('command')}")


def _held_by_other(path: Path) -> bool:
    """True while some process holds `path` exclusively (probed with a shared lock, released at once)."""
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class OutputLock:
    """`with OutputLock(stage_dir, "train"):` the stage's writes. Re-entrant per process is not needed:
    `stage=all` locks each stage's own folder in turn."""

    def __init__(self, directory: Path, stage: str, rank: Optional[RankInfo] = None, wait_rank0_s: float = 5.0):
        self.dir, self.stage = Path(directory), stage
        self.rank = rank or rank_info()
        self.path = self.dir / f"{LOCK_PREFIX}{self.rank.rank}"
        self.wait_rank0_s = wait_rank0_s
        self._fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        for _ in range(20):  # a rank > 0 probing this file holds it for microseconds: try again briefly
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
        else:
            os.close(fd)
            self._refuse(_holder(self.path))
        self._fd = fd
        me = {"pid": os.getpid(), "host": socket.gethostname(), "job": job_id(), "stage": self.stage,
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(redact_argv(sys.argv))}  # a secret on the command line is not recorded
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        if self.rank.rank > 0 and me["job"] is not None:
            self._check_rank0(me["job"])
        return self

    def _check_rank0(self, job: str) -> None:
        """Rank 0's lock, when held, must be our job's; its holder record may lag its flock by a moment."""
        rank0 = self.dir / f"{LOCK_PREFIX}0"
        deadline = time.monotonic() + self.wait_rank0_s
        while _held_by_other(rank0):
            holder = _holder(rank0)
            if holder.get("job") == job:
                return
            if time.monotonic() > deadline:
                self.__exit__()
                self._refuse(holder)
            time.sleep(0.1)

    def _refuse(self, holder: dict) -> None:
        raise OutputLocked(f"{self.dir} is being written by another {holder.get('stage', self.stage)} run: "
                           f"{_describe(holder)}. Wait for it to finish or stop it; a killed run releases the "
                           f"folder at once. Or write elsewhere (name=..., output_root=...)")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def first_writer_lock(out: Path):
    """Held while one process makes `out` that every rank then reads (a GGUF's dequantization, the tokenized
    input): ranks that arrive together wait for the first instead of racing it. An exclusive flock on a file
    beside `out`; the caller checks again for `out` once it holds the lock. Where the file system has no flock,
    each process makes `out` alone, and writing it under a temporary name then renaming keeps that safe."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f".{out.name}.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            log.warning("%s: no file lock on this file system (%s); making it without one", out.parent, e)
        yield
