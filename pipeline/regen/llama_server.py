"""A llama.cpp server that regen starts and stops itself (`regen.backend=llamacpp`), the CPU engine.

llama.cpp's `llama-server` serves the target's GGUF with `slots` parallel sequences and continuous batching;
regen talks to it through the `openai` backend with one conversation in flight per slot (waves.py's
per-conversation schedule), so the slots stay full and a conversation's next turn reuses its slot's KV cache.
`make llama-server` builds the binary (into eaglet's cache) from the llama.cpp that the pinned
llama-cpp-python vendors, with its AMX kernels made safe by jobs/patch_llama_cpp.py.
Measured on 2 cores: docs/results.md, "Speed of every stage".
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
from typing import Optional

from pipeline.regen.config import LlamaCppConfig
from pipeline.target import TargetConfig, cache_root

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary_path(cfg: LlamaCppConfig, target: TargetConfig) -> Path:
    """regen.llamacpp.binary, or where `make llama-server` builds it: the eaglet cache beside the targets."""
    return Path(cfg.binary).expanduser() if cfg.binary else cache_root(target) / "llama.cpp" / "bin" / "llama-server"


def find_binary(cfg: LlamaCppConfig, target: TargetConfig) -> Optional[Path]:
    """The llama-server to run, if it is an executable file."""
    path = binary_path(cfg, target)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _die_with_parent() -> None:
    """In the server's process before exec: the kernel kills it when regen dies, however regen dies (a SIGTERM
    or kill -9 skips regen's own cleanup), so a killed run never leaves a server holding the CPU and its KV
    cache. SIGKILL, not SIGTERM: llama-server's graceful shutdown was seen to hang with requests in flight,
    and the server holds nothing to save."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def default_threads() -> int:
    """This process's CPUs shared among the ranks on this node (each rank runs its own server)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


class LlamaServer:
    """`llama-server` on 127.0.0.1 (a free port) with `slots` sequences, each with its own KV cache of
    `ctx_per_slot` tokens (capped at `max_seq`, the model's context); its log goes to `log_path`; `close`
    stops it. Not a unified KV pool: there every sequence's attention scans the whole pool,
    which measured 3x slower decoding at 32 slots."""

    def __init__(self, binary: Path, gguf: Path, cfg: LlamaCppConfig, log_path: Path, max_seq: int):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        threads = cfg.threads or default_threads()
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-np", str(cfg.slots), "-c", str(cfg.slots * min(cfg.ctx_per_slot, max_seq)),
                        "-t", str(threads), "-tb", str(threads), "--no-webui"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        try:
            self._wait_healthy(cfg.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0
        log.info("llama-server up in %.1f s: %d slots x %d tokens, %d threads (%s)", self.startup_s, cfg.slots,
                 cfg.ctx_per_slot, threads, log_path)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode} at start; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"llama-server did not become healthy within {timeout_s:g} s; see {self.log_path}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
