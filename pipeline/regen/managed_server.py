"""A local inference server that regen starts and stops itself: what llama.cpp's (llama_server.py) and vLLM's
(vllm_server.py) managed servers share.

The server listens on 127.0.0.1 at a free port, writes its log to a file under the regen stage directory, is
killed by the kernel when regen dies (`_die_with_parent`), counts as started once its health endpoint answers
200 (within a timeout; a server that exits first is reported with its exit code and log), and `close` stops
it together with any process it started (vLLM runs its engine and worker in processes of their own, which
the kernel does not kill with their parent: such a server runs in a process group that regen stops whole).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: the kernel kills it when regen dies, however regen dies (a SIGTERM
    or kill -9 skips regen's own cleanup), so a killed run never leaves a server holding the CPU and its KV
    cache. SIGKILL, not SIGTERM: llama-server's graceful shutdown was seen to hang with requests in flight,
    and the server holds nothing to save."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def default_threads() -> int:
    """This process's CPUs shared among the ranks on this node (each rank runs its own server)."""
    return len(rank_cpus())


def local_ranks() -> tuple[int, int]:
    """(this rank's index on its node, ranks on the node)."""
    size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    rank = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)
    return rank, max(1, size)


def rank_cpus() -> list[int]:
    """This rank's share of this process's CPUs: an equal slice per rank on the node (at least one CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    rank, size = local_ranks()
    per = max(1, len(cpus) // size)
    return cpus[(rank % size) * per:][:per] or cpus[:1]


def process_tree(pid: int) -> list[int]:
    """`pid` and every living descendant (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# The parent of a server that starts processes of its own (own_group=True): it runs in a process group of its own
# with the server, and when regen dies (PR_SET_PDEATHSIG, SIGTERM here) or stops it, it stops the whole group:
# SIGTERM to the server, then SIGKILL to the group once the server is gone or after 20 s. The kernel does not
# kill a server's children with their parent (vLLM's engine and worker processes outlived a kill -9 of its API
# server: 3 GB held by orphans). Exits as the server did. Standard library only: it runs in regen's Python with
# the server's environment.
GROUP_LAUNCHER = r"""
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # regen died before the line above
    sys.exit(1)
stopping = None
def stop(*_):
    global stopping
    if stopping is None:
        stopping = time.monotonic()
        server.terminate()  # the server stops its own children first; what is left is killed below
def kill_group():  # every other process of this group (the server's children survive it)
    me, group = os.getpid(), os.getpgid(0)
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(entry) != me and os.getpgid(int(entry)) == group:
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass
signal.signal(signal.SIGTERM, stop)
server = subprocess.Popen(sys.argv[2:])
while True:
    try:
        code = server.wait(timeout=0.2)
        break
    except subprocess.TimeoutExpired:
        if stopping is not None and time.monotonic() - stopping > 20:
            kill_group()
kill_group()
if code < 0:  # killed by a signal: so is this launcher (regen reads the server's exit as it was)
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class ManagedServer:
    """A server process started with `command` (built by the subclass around `self.port`), up once
    `health_path` answers 200. Subclasses set `name` (the engine in messages) and call `_start`; one whose server
    starts processes of its own sets `own_group` (the server then runs under GROUP_LAUNCHER, `proc` is that
    launcher, which exits as the server does)."""

    name = "server"
    health_path = "/health"
    own_group = False

    def __init__(self, log_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        self.command: list[str] = []
        self.startup_s: Optional[float] = None
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def _start(self, command: Sequence[str], startup_timeout_s: float, env: Optional[dict] = None) -> None:
        self.command = [str(c) for c in command]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        if self.own_group:
            self.proc = subprocess.Popen([sys.executable, "-c", GROUP_LAUNCHER, str(os.getpid()), *self.command],
                                         stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        else:
            self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_die_with_parent)
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} at start; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.health_path}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not become healthy within {timeout_s:g} s; see {self.log_path}")

    def peak_rss_mb(self) -> Optional[float]:
        """The peak resident memory (VmHWM) of the server and its living descendants, summed, in MiB; None once
        it has exited. Read it before `close`. Pages the processes share count once per process."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        tree = process_tree(self.proc.pid)[1 if self.own_group else 0:]  # not the launcher
        return round(sum(_status_kb(p, "VmHWM") for p in tree) / 1024, 1)

    def close(self) -> None:
        if self.proc is not None:
            tree = process_tree(self.proc.pid) if self.proc.poll() is None else []
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            for pid in tree[1:]:  # children the server did not stop itself
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.own_group:  # whatever is left of the group, also when the launcher itself was killed
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self._log is not None:
            self._log.close()
