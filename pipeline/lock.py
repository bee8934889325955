"""One writer per output folder: a stage holds an exclusive lock on `<stage dir>/.eaglet-lock.rank<R>` while
it runs, so a second run of the same stage into the same folder is refused at once, with a message naming the
running one, instead of two processes interleaving shards, checkpoints or manifests.

Each rank of a multi-process job locks its own file: the ranks of one job never collide, while every rank of a
second job meets its counterpart. A rank > 0 also checks that rank 0's lock, if held, belongs to its own job
(same launcher job id, when the launcher gives one): a second job's rank 1 does not start writing while its
rank 0 is being refused.

Two mechanisms, chosen by `EAGLET_LOCK` (auto | flock | file):
- **flock** (the default where it works): the kernel drops the lock when its process dies (kill -9 included),
  so a lock is never stale and nothing needs cleaning up.
- **file**: a lock file created with O_EXCL (`.eaglet-lock.rank<R>.held`, holding host, pid, job and command),
  kept alive by a heartbeat (its mtime, touched every `EAGLET_LOCK_STALE_S`/4 seconds, default 60). It is
  for file systems where flock fails (Lustre mounted `noflock`: `auto` falls back to it, with a warning) or
  where flock is node-local and so protects nothing across nodes (Lustre `localflock`, some NFS setups: set
  `EAGLET_LOCK=file` there). A lock whose holder is gone is taken over: at once when the holder ran on this
  host and its process is dead; from another host, once its heartbeat has not moved for the stale time,
  watched on this host's clock (so clock skew between nodes only delays a take-over, never hastens one)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from pipeline.dist import RankInfo, rank_info
from pipeline.redact import redact_argv

LOCK_PREFIX = ".eaglet-lock.rank"
HELD_SUFFIX = ".held"  # the file lock's name: <LOCK_PREFIX><rank><HELD_SUFFIX>
LOCK_MODES = ("auto", "flock", "file")
# flock's errors on a file system that does not implement it (Lustre `noflock` gives ENOSYS; NFS without a
# lock manager ENOLCK; FUSE file systems EOPNOTSUPP or EINVAL).
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
log = logging.getLogger(__name__)


class OutputLocked(RuntimeError):
    pass


def lock_mode() -> str:
    mode = os.environ.get("EAGLET_LOCK", "auto")
    if mode not in LOCK_MODES:
        raise ValueError(f"EAGLET_LOCK={mode!r}: choose one of {', '.join(LOCK_MODES)}")
    return mode


def stale_after_s() -> float:
    """How long a file lock's heartbeat may stand still before its holder counts as gone."""
    return float(os.environ.get("EAGLET_LOCK_STALE_S", "60"))


def job_id() -> Optional[str]:
    """What the ranks of one job share and another job does not: the launcher's ids. None when there are none
    (ranks started by hand with RANK/WORLD_SIZE): then ranks > 0 cannot tell their rank 0 from another job's
    and rely on their own lock file alone."""
    env = os.environ
    # torchrun's TORCHELASTIC_RUN_ID is "none" for every standalone job; its rendezvous port is not shared.
    # Every id present counts: two runs started from one Slurm step differ by their torchrun port.
    keys = [k for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT") if k in env]
    return ":".join(env[k] for k in keys) if keys else None


def _proc_stat(pid: int) -> Optional[list[str]]:
    """/proc/<pid>/stat's fields after the command name (state first), or None where there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _process_start(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot, field 22 of /proc/<pid>/stat): a pid reused by a later
    process has another one. None where there is no /proc or no such process."""
    stat = _proc_stat(pid)
    return stat[19] if stat else None


def _alive_here(holder: dict) -> bool:
    """Whether a holder that ran on this host is still running (the same process, not a reuse of its pid)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return True  # a record being written: assume alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: the pid exists
    # A killed process nobody has reaped yet (a container without an init) is a zombie: it holds nothing.
    started = holder.get("started")
    return stat[0] not in ("Z", "X") and (started is None or stat[19] == started)


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


def _holder_record(stage: str) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "job": job_id(), "stage": stage,
            "started": _process_start(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(redact_argv(sys.argv))}  # a secret on the command line is not recorded


def _flock_held_by_other(path: Path) -> bool:
    """True while some process holds `path`'s flock exclusively (probed with a shared lock, released at once);
    False also where the file system has no flock."""
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _live_holder(directory: Path, rank: int, flock: bool = True, file: bool = True) -> Optional[dict]:
    """The record of another process holding rank `rank`'s lock of `directory`, by flock or by lock file (the
    kinds asked for), else None."""
    path = directory / f"{LOCK_PREFIX}{rank}"
    if flock and _flock_held_by_other(path):
        return _holder(path)
    return FileLock(path.with_name(path.name + HELD_SUFFIX), {}).live_holder() if file else None


class FileLock:
    """The O_EXCL lock file with a heartbeat (the module's docstring says when it is used)."""

    def __init__(self, path: Path, record: dict):
        self.path = Path(path)
        self.record = {**record, "token": uuid.uuid4().hex}
        self.stale_s = stale_after_s()
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def acquire(self) -> Optional[dict]:
        """Takes the lock (None) or returns the live holder's record. A gone holder's lock is taken over."""
        for _ in range(3):  # a take-over frees the name, and another process may create it first
            if self._create():
                self._beat = threading.Thread(target=self._heartbeat, name=f"lock-heartbeat {self.path}",
                                              daemon=True)
                self._beat.start()
                return None
            try:
                inode = self.path.stat().st_ino
            except FileNotFoundError:
                continue
            holder = _holder(self.path)
            if not self.gone(holder):
                return holder
            self.break_stale(holder, inode)
        return _holder(self.path) or {"pid": None, "host": None, "command": "(taking over a stale lock)"}

    def _create(self) -> bool:
        """Creates the lock file with its whole record in one step (a hard link of a written temporary fails
        if the name exists), so no process ever sees a held lock without its record; where the file system
        has no hard links, O_EXCL then a write. False if it exists."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{self.record['token'][:8]}.new")
        tmp.write_text(json.dumps(self.record))
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.record))
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def gone(self, holder: dict) -> bool:
        """Whether the lock's holder has stopped: on this host, its process is dead; on another, its heartbeat
        (the file's mtime) has not moved for the stale time. A fresh heartbeat is trusted at once; an old one
        is watched for the stale time on this host's monotonic clock first."""
        if holder.get("host") == socket.gethostname():
            return not _alive_here(holder)
        try:
            beat = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return True
        if abs(time.time() - beat / 1e9) < self.stale_s:
            return False
        deadline = time.monotonic() + self.stale_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.stale_s / 10))
            try:
                if self.path.stat().st_mtime_ns != beat:
                    return False
            except FileNotFoundError:
                return True
        log.warning("%s: the lock of %s has had no heartbeat for %.0f s: taking it over", self.path.parent,
                    _describe(holder), self.stale_s)
        return True

    def break_stale(self, holder: dict, inode: int) -> None:
        """Removes the lock file of a gone holder, unless it is another file by now (another process took
        it over and holds it): take-overs are serialized by a second O_EXCL file, held for a moment."""
        breaker = self.path.with_name(self.path.name + ".break")
        try:
            fd = os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):  # a breaker killed mid-way: its file outlives it
                if time.time() - breaker.stat().st_mtime > max(self.stale_s, 10):
                    breaker.unlink()
            time.sleep(0.1)
            return
        os.close(fd)
        try:
            with contextlib.suppress(FileNotFoundError):
                if self.path.stat().st_ino == inode and _holder(self.path).get("token") == holder.get("token"):
                    self.path.unlink()
        finally:
            breaker.unlink()

    def _heartbeat(self) -> None:
        """Touches the lock file every stale time / 4. A read or touch that fails (a passing NFS error) is tried
        again at the next beat; only another run's record in the file means the lock was taken over (this
        process stood still for the stale time: suspended, or cut off from the file system): then the run is
        stopped as a stop signal stops it, since two runs must not write one folder."""
        interval = max(self.stale_s / 4, 0.05)
        while not self._stop.wait(interval):
            try:
                holder = json.loads(self.path.read_text())
            except FileNotFoundError:
                holder = {}
            except (OSError, ValueError):
                continue
            if holder.get("token") != self.record["token"]:
                log.error("%s: this run's lock was taken over by %s (no heartbeat for %.0f s: was the process "
                          "suspended?); stopping this run", self.path.parent, _describe(holder), self.stale_s)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def live_holder(self) -> Optional[dict]:
        """The record of the live holder of this file lock (another process's), or None."""
        if not self.path.exists():
            return None
        holder = _holder(self.path)
        return None if self.gone(holder) else holder

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if _holder(self.path).get("token") == self.record["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class OutputLock:
    """`with OutputLock(stage_dir, "train"):` the stage's writes. Re-entrant per process is not needed:
    `stage=all` locks each stage's own folder in turn."""

    def __init__(self, directory: Path, stage: str, rank: Optional[RankInfo] = None, wait_rank0_s: float = 5.0):
        self.dir, self.stage = Path(directory), stage
        self.rank = rank or rank_info()
        self.path = self.dir / f"{LOCK_PREFIX}{self.rank.rank}"
        self.wait_rank0_s = wait_rank0_s
        self.mode = lock_mode()
        self._fd: Optional[int] = None
        self._file: Optional[FileLock] = None

    def __enter__(self) -> "OutputLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        me = _holder_record(self.stage)
        if self.mode != "file" and not self._take_flock(me):
            self.mode = "file"
        if self.mode == "file":
            self._file = FileLock(self.dir / f"{LOCK_PREFIX}{self.rank.rank}{HELD_SUFFIX}", me)
            if (holder := self._file.acquire()) is not None:
                self._file = None
                self._refuse(holder)
        # A run of the other kind (EAGLET_LOCK=file in a job, auto in an interactive rerun) holds the folder too:
        # each kind looks at the other's lock before writing.
        if (other := _live_holder(self.dir, self.rank.rank, flock=self.mode == "file",
                                  file=self.mode != "file")) is not None:
            self.__exit__()
            self._refuse(other)
        if self.rank.rank > 0 and me["job"] is not None:
            self._check_rank0(me["job"])
        return self

    def _take_flock(self, me: dict) -> bool:
        """Holds the flock (True), or False where the file system has none (auto falls back to the file lock;
        flock mode refuses to run unprotected)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        for _ in range(20):  # a rank > 0 probing this file holds it for microseconds: try again briefly
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
            except OSError as e:
                os.close(fd)
                if e.errno not in NO_FLOCK:
                    raise
                if self.mode == "flock":
                    raise OSError(e.errno, f"{self.dir}: this file system has no flock ({e.strerror}); set "
                                           f"EAGLET_LOCK=file (or auto) to lock with a heartbeat file") from e
                log.warning("%s: no flock on this file system (%s): locking with a heartbeat file instead "
                            "(EAGLET_LOCK=file)", self.dir, e.strerror)
                return False
        else:
            os.close(fd)
            self._refuse(_holder(self.path))
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        return True

    def _check_rank0(self, job: str) -> None:
        """Rank 0's lock, when held, must be our job's; its holder record may lag its lock by a moment."""
        deadline = time.monotonic() + self.wait_rank0_s
        while (holder := _live_holder(self.dir, 0)) is not None:
            if holder.get("job") == job:
                return
            if time.monotonic() > deadline:
                self.__exit__()
                self._refuse(holder)
            time.sleep(0.1)

    def _refuse(self, holder: dict) -> None:
        released = ("at once" if self.mode != "file" else
                    f"at once on its own host, after {stale_after_s():.0f} s without a heartbeat from another")
        raise OutputLocked(f"{self.dir} is being written by another {holder.get('stage', self.stage)} run: "
                           f"{_describe(holder)}. Wait for it to finish or stop it; a killed run releases the "
                           f"folder {released}. Or write elsewhere (name=..., output_root=...)")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._file is not None:
            self._file.release()
            self._file = None
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
