"""A llama.cpp server that regen starts and stops itself (`regen.backend=llamacpp`), the CPU engine.

llama.cpp's `llama-server` serves the target's GGUF with `slots` parallel sequences and continuous batching;
regen talks to it through the `openai` backend with one conversation in flight per slot (waves.py's
per-conversation schedule), so the slots stay full and a conversation's next turn reuses its slot's KV cache.
`make llama-server` builds the binary (into eaglet's cache) from the llama.cpp that the pinned
llama-cpp-python vendors, with its AMX kernels made safe by tools/patch_llama_cpp.py.
Measured on 2 cores: docs/results/speed.md.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from pipeline.regen.config import LlamaCppConfig
from pipeline.regen.managed_server import ManagedServer, _die_with_parent, default_threads, free_port
from pipeline.target import TargetConfig, cache_root

__all__ = ["LlamaServer", "binary_path", "find_binary", "free_port", "default_threads", "_die_with_parent"]

log = logging.getLogger(__name__)


def binary_path(cfg: LlamaCppConfig, target: TargetConfig) -> Path:
    """regen.llamacpp.binary, or where `make llama-server` builds it: the eaglet cache beside the targets."""
    return Path(cfg.binary).expanduser() if cfg.binary else cache_root(target) / "llama.cpp" / "bin" / "llama-server"


def find_binary(cfg: LlamaCppConfig, target: TargetConfig) -> Optional[Path]:
    """The llama-server to run, if it is an executable file."""
    path = binary_path(cfg, target)
    return path if path.is_file() and os.access(path, os.X_OK) else None


class LlamaServer(ManagedServer):
    """`llama-server` on 127.0.0.1 (a free port) with `slots` sequences, each with its own KV cache of
    `ctx_per_slot` tokens (capped at `max_seq`, the model's context); its log goes to `log_path`; `close`
    stops it. Not a unified KV pool: there every sequence's attention scans the whole pool,
    which measured 3x slower decoding at 32 slots."""

    name = "llama-server"

    def __init__(self, binary: Path, gguf: Path, cfg: LlamaCppConfig, log_path: Path, max_seq: int):
        super().__init__(log_path)
        threads = cfg.threads or default_threads()
        self._start([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(cfg.slots), "-c", str(cfg.slots * min(cfg.ctx_per_slot, max_seq)),
                     "-t", str(threads), "-tb", str(threads), "--no-webui"], cfg.startup_timeout_s)
        log.info("llama-server up in %.1f s: %d slots x %d tokens, %d threads (%s)", self.startup_s, cfg.slots,
                 cfg.ctx_per_slot, threads, log_path)
