"""A throwaway Slurm cluster on this machine, for tests: one munged, one slurmctld and one slurmd per emulated
node, all on localhost (each slurmd with its own NodeName, port, spool and pid file), configured by a generated
slurm.conf in a private directory under /tmp. Nothing system-wide is used or touched: the munge key and socket,
ports, state and logs are all the cluster's own, so it coexists with a system Slurm or with clusters of other
test runs.

    with LocalSlurmCluster(nodes=2) as cluster:
        job = cluster.sbatch("jobs/train.sbatch", "experiment=x", options=["--time=5"])
        cluster.wait([job], timeout=120)

Two emulated nodes turn `srun torchrun --nnodes=$SLURM_NNODES --rdzv-endpoint=<first node>:<port>` into a real
two-node rendezvous. The daemons are children of this process, die with it (PR_SET_PDEATHSIG) and are stopped by
pid in `stop()`; whatever a killed earlier run left behind is found by its directory and reaped in `start()`.
Needs Debian's `slurm-wlm` and `munge` and root (SlurmUser=root)."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
DIR_PREFIX = "eaglet-slurm-"
# Job states after which nothing more happens to a job (REQUEUED/PREEMPTED are transient: it pends again).
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "BOOT_FAIL", "DEADLINE"})
# Environment that would make our commands talk to (or pretend to be inside) some other allocation.
_FOREIGN_ENV = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_)|^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT)$")


class SlurmClusterError(RuntimeError):
    pass


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class LocalSlurmCluster:
    def __init__(self, nodes: int = 2, cpus_per_node: Optional[int] = None, cred_expire_s: int = 5):
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node or max(1, (os.cpu_count() or 1) // nodes)
        # A requeued job may start again only after its previous credential expired (default 120 s).
        self.cred_expire_s = cred_expire_s
        self.root: Optional[Path] = None
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # ---------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> "LocalSlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The caller's environment minus any outer Slurm/torchrun variables, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not _FOREIGN_ENV.match(k)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self, timeout: float = 60.0) -> None:
        reap_stale_clusters()
        missing = missing_binaries()
        if missing:
            raise SlurmClusterError(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmClusterError("the local cluster runs its daemons and jobs as root (SlurmUser=root)")
        # munged refuses a socket whose directory chain is not world-executable, so not under pytest's 0700 tmp.
        self.root = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir="/tmp"))
        self.root.chmod(0o755)
        (self.root / "owner").write_text(_process_identity(os.getpid()))
        try:
            self._start_munged()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D"])
            for node in self.nodes:
                (self.root / f"spool-{node}").mkdir()
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
            self.wait_until(self._nodes_idle, timeout, "all nodes idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this object started, by pid, slurmd first."""
        if self.root is None:
            return
        if any(name == "slurmctld" and p.poll() is None for name, p in self._procs):
            subprocess.run(["scancel", "--full", "--signal=KILL", f"--user={os.getuid()}"], env=self.env,
                           capture_output=True, timeout=30)
            try:
                self.wait_until(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 30, "no jobs")
            except SlurmClusterError:
                pass  # the daemons go anyway; leftover job processes are reaped below
        for _, proc in reversed(self._procs):
            _terminate(proc)
        self._procs.clear()
        _kill_processes_of(self.root)  # slurmstepd and job tasks outlive slurmd
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    # ---------------------------------------------------------------------------------------------- commands
    def run(self, *cmd: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise SlurmClusterError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, script: str | Path, *args: str, options: Sequence[str] = (), cwd: Optional[Path] = None) -> str:
        """Submit `script args...` with sbatch `options`; returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], env=self.env, cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise SlurmClusterError(f"sbatch {script} failed: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job` records (one per array task) as key -> value; [] once slurmctld forgot the job."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return [parse_record(line) for line in proc.stdout.splitlines() if line.startswith("JobId=")]

    def job(self, job_id: str) -> dict[str, str]:
        records = self.jobs(job_id)
        if len(records) != 1:
            raise SlurmClusterError(f"job {job_id}: expected one record, got {len(records)}")
        return records[0]

    def state(self, job_id: str) -> str:
        return self.job(job_id)["JobState"]

    def wait(self, job_ids: Iterable[str], timeout: float, on_poll: Optional[Callable[[], None]] = None
             ) -> dict[str, dict[str, str]]:
        """Wait until every job (every task of an array) is in a terminal state; returns the final records."""
        job_ids = list(job_ids)

        def finished() -> bool:
            if on_poll is not None:
                on_poll()
            return all(records and all(r["JobState"] in TERMINAL_STATES for r in records)
                       for records in map(self.jobs, job_ids))

        self.wait_until(finished, timeout, f"jobs {', '.join(job_ids)} finished")
        return {r["JobId"]: r for job_id in job_ids for r in self.jobs(job_id)}

    def wait_until(self, predicate: Callable[[], object], timeout: float, what: str, poll_s: float = 0.5):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            self._check_daemons()
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")
            time.sleep(poll_s)

    def diagnostics(self, lines: int = 15) -> str:
        """squeue, sinfo and the tail of every daemon log: what a failed test prints."""
        if self.root is None:
            return "(cluster not running)"
        out = []
        for cmd in (("squeue", "-a"), ("sinfo", "-N")):
            p = self.run(*cmd, check=False)
            out.append(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")
        for log in sorted((self.root / "log").glob("*")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ---------------------------------------------------------------------------------------------- internals
    def _start_munged(self) -> None:
        munge_dir = self.root / "munge"
        munge_dir.mkdir(mode=0o755)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "log").mkdir()
        self._spawn("munged", ["munged", "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={munge_dir / 'munged.pid'}", f"--seed-file={munge_dir / 'munged.seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        self.wait_until(self._munge_works, 20, "munged to answer on its socket", poll_s=0.1)

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    def _munge_works(self) -> bool:
        if not self.munge_socket.exists():
            return False
        cred = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True)
        return cred.returncode == 0 and subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=cred.stdout,
                                                       capture_output=True).returncode == 0

    def _write_conf(self) -> None:
        root = self.root
        ports = _free_ports(1 + len(self.nodes))
        mem_mb = _mem_total_mb() // (2 * len(self.nodes))  # not enforced (CR_CPU); must not exceed what slurmd sees
        # One NodeName line per emulated node: its own slurmd port (free ports are not consecutive).
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} "
            f"RealMemory={mem_mb} State=UNKNOWN" for node, port in zip(self.nodes, ports[1:]))
        self.conf.write_text(f"""\
# Generated by tests/support/slurm_cluster.py: {len(self.nodes)} emulated node(s) on localhost.
ClusterName=eaglet-test
SlurmctldHost=localhost
SlurmctldPort={ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}
SlurmUser=root
SlurmdUser=root
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Schedule pending jobs (dependencies just satisfied, requeued jobs) every second, not every minute.
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=3600
MailProg=/bin/true
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (root / "state").mkdir()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, cwd=self.root)
        log.close()
        self._procs.append((name, proc))

    def _check_daemons(self) -> None:
        dead = [(name, p.returncode) for name, p in self._procs if p.poll() is not None]
        if dead:
            raise SlurmClusterError(f"daemon(s) exited: {dead}\n{self.diagnostics()}")

    def _nodes_idle(self) -> bool:
        proc = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)


# -------------------------------------------------------------------------------------------------- helpers


def reap_stale_clusters() -> list[Path]:
    """Clusters whose owning process is gone (a killed test run): kill their processes, remove their dirs."""
    reaped = []
    for root in Path("/tmp").glob(f"{DIR_PREFIX}*"):
        owner = root / "owner"
        try:
            pid = int(owner.read_text().split()[0])
            alive = _process_identity(pid) == owner.read_text()
        except (OSError, ValueError, IndexError):
            alive = False
        if not alive:
            _kill_processes_of(root)
            shutil.rmtree(root, ignore_errors=True)
            reaped.append(root)
    return reaped


def _kill_processes_of(root: Path) -> None:
    """SIGKILL every process that belongs to the cluster in `root`: its daemons (munged names its socket on the
    command line, Slurm daemons and slurmstepd inherit SLURM_CONF) and the job processes (they inherit it too)."""
    marker = str(root / "")
    for pid_dir in Path("/proc").glob("[0-9]*"):
        pid = int(pid_dir.name)
        if pid == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().decode(errors="replace")
            environ = (pid_dir / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline or f"SLURM_CONF={root}/slurm.conf\0" in environ:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _process_identity(pid: int) -> str:
    """pid plus its start time (field 22 of /proc/<pid>/stat), so a recycled pid is not mistaken for the owner."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    start = stat.rsplit(")", 1)[1].split()[19]
    return f"{pid} {start}"


def parse_record(line: str) -> dict[str, str]:
    """`scontrol show -o` output: `Key=value` pairs separated by spaces (values may contain spaces)."""
    return dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|\s*$)", line.strip()))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return sorted(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise SlurmClusterError("no MemTotal in /proc/meminfo")
