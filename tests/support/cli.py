"""`python -m pipeline.run ...` as a user runs it, many times over one warm interpreter (the `cli` fixture).

The checks of what the command line prints on a bad input (one line, no traceback, the exit status) need the
real entry point in a real process, not torch's and the stages' two seconds of imports each time. The server
below imports them once; each call then forks a child that runs the entry point as `python -m pipeline.run`
would (`sys.argv`, the working directory and the environment of the call; its own stdout, stderr and exit
status), and the parent answers with them. The server never runs a model, so no thread pool exists when it
forks. Environment variables that take effect at import (OMP_NUM_THREADS, ...) keep the server's values: calls
that need them start their own process. Tests that test processes (kills, signals, torchrun, Slurm) do.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from tests.support.paths import REPO


class CliServer:
    """`server(args, cwd=REPO, env=None, timeout=120)` -> subprocess.CompletedProcess of
    `python -m pipeline.run *args`, run in a child forked from one warm interpreter."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.cli"], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def __call__(self, args, cwd=REPO, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
        request = {"args": [str(a) for a in args], "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                   "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI server ended (exit {self.proc.wait()})")
        reply = json.loads(line)
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(["pipeline.run", *args], timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(["pipeline.run", *args], reply["returncode"], reply["stdout"],
                                           reply["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _child(request: dict, out: int, err: int) -> None:
    """In the forked child: become `python -m pipeline.run <args>` and never return."""
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        # As under `python -m`, the entry point runs as __main__ only (the server imported it as a module).
        sys.argv = [sys.modules.pop("pipeline.run").__file__, *request["args"]]
        try:
            runpy.run_module("pipeline.run", run_name="__main__", alter_sys=True)  # what `python -m` does
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()  # what the interpreter prints for an uncaught exception
            code = 1
    finally:
        _save_coverage()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _save_coverage() -> None:
    """A measured run (coverage.py's subprocess patch) keeps what each child ran: os._exit skips atexit."""
    try:
        import coverage
    except ImportError:
        return
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.stop()
        cov.save()


def serve() -> None:
    import pipeline.run  # noqa: F401  (torch, transformers, Hydra and the config store)
    from pipeline.run import STAGE_MODULES

    for module in STAGE_MODULES.values():  # each stage's own imports, paid once
        __import__(module)
    for line in sys.stdin:
        request = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                _child(request, out.fileno(), err.fileno())
            timed_out = False
            try:
                with _alarm(request["timeout"]):
                    _, status = os.waitpid(pid, 0)
            except TimeoutError:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
            reply = {"returncode": os.waitstatus_to_exitcode(status), "timeout": timed_out}
            for name, f in (("stdout", out), ("stderr", err)):
                f.seek(0)
                reply[name] = f.read().decode(errors="replace")
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class _alarm:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        def expire(*_):
            raise TimeoutError

        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    serve()
