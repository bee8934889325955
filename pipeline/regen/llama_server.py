"""A llama.cpp server that regen starts and stops itself (`regen.backend=llamacpp`), the CPU engine.

llama.cpp's `llama-server` serves the target's GGUF with `slots` parallel sequences and continuous batching;
regen talks to it through the `openai` backend with one conversation in flight per slot (waves.py's
per-conversation schedule), so the slots stay full and a conversation's next turn reuses its slot's KV cache.
`make llama-server` builds the binary (into eaglet's cache) from the llama.cpp that the pinned
llama-cpp-python vendors, with its AMX kernels made safe by tools/patch_llama_cpp.py, and records its sha256
beside it (`llama-server.sha256`). eaglet runs a binary only after checking it against that record
(`checked_binary`): the one in its cache must have the record and match it; a binary the user names
(regen.llamacpp.binary) is the user's choice, checked only when a record lies beside it.
Measured on 2 cores: docs/results/speed.md.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from pipeline.files import sha256_file
from pipeline.regen.config import LlamaCppConfig
from pipeline.regen.managed_server import ManagedServer, _die_with_parent, default_threads, free_port
from pipeline.target import TargetConfig, cache_root

__all__ = ["LlamaServer", "BinaryMismatch", "binary_path", "checked_binary", "digest_record", "find_binary",
           "free_port", "default_threads", "_die_with_parent"]

log = logging.getLogger(__name__)


class BinaryMismatch(RuntimeError):
    """A llama-server whose bytes are not the ones recorded when it was built: never executed."""


def built_path(target: TargetConfig) -> Path:
    """Where `make llama-server` builds it: the eaglet cache beside the targets."""
    return cache_root(target) / "llama.cpp" / "bin" / "llama-server"


def binary_path(cfg: LlamaCppConfig, target: TargetConfig) -> Path:
    """regen.llamacpp.binary, or where `make llama-server` builds it."""
    return Path(cfg.binary).expanduser() if cfg.binary else built_path(target)


def digest_record(binary: Path) -> Path:
    """The sha256 that `make llama-server` records beside the binary it builds."""
    return binary.with_name(binary.name + ".sha256")


def check_binary(binary: Path, required: bool) -> Path:
    """`binary` if its sha256 is the one recorded beside it, else BinaryMismatch in one line (the path, both
    digests, how to rebuild). `required`: a missing record is refused too (eaglet's own build); otherwise (a
    binary the user named) a missing record means the binary is taken as the user's choice."""
    record = digest_record(binary)
    rebuild = f"remove {binary} and {record} and run `make llama-server` to build it again"
    if not record.is_file():
        if not required:
            return binary
        raise BinaryMismatch(f"{binary} has no sha256 record ({record} is missing, so the binary cannot be checked "
                             f"before it runs): {rebuild}")
    expected = (record.read_text().split() or [""])[0].lower()
    found = sha256_file(binary)
    if found != expected:
        raise BinaryMismatch(f"{binary}: sha256 {found}, but {record} records {expected or '(nothing)'}; the "
                             f"binary changed since it was built and is not run: {rebuild}")
    return binary


def checked_binary(cfg: LlamaCppConfig, target: TargetConfig) -> Path:
    """The llama-server to execute, checked against its recorded sha256 (check_binary); FileNotFoundError when
    there is no executable, BinaryMismatch when its bytes are not the recorded ones."""
    path = find_binary(cfg, target)
    if path is None:
        raise FileNotFoundError(f"no llama-server executable at {binary_path(cfg, target)}: build it with "
                                "`make llama-server` (or set regen.llamacpp.binary), or use regen.backend=hf")
    own = os.path.abspath(path) == os.path.abspath(built_path(target))
    return check_binary(path, required=own)


def find_binary(cfg: LlamaCppConfig, target: TargetConfig) -> Optional[Path]:
    """The llama-server to run, if it is an executable file."""
    path = binary_path(cfg, target)
    return path if path.is_file() and os.access(path, os.X_OK) else None


class LlamaServer(ManagedServer):
    """`llama-server` on 127.0.0.1 (a free port) with `slots` sequences, each with its own KV cache of
    `ctx_per_slot` tokens (capped at `max_seq`, the model's context); its log goes to `log_path`; `close`
    stops it; `extra_args` go to its command line as they are (bench/serve_llamacpp.py adds a draft). Not a
    unified KV pool: there every sequence's attention scans the whole pool, which measured 3x slower decoding at
    32 slots."""

    name = "llama-server"

    def __init__(self, binary: Path, gguf: Path, cfg: LlamaCppConfig, log_path: Path, max_seq: int,
                 extra_args: Sequence[str] = ()):
        super().__init__(log_path)
        threads = cfg.threads or default_threads()
        self._start([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(cfg.slots), "-c", str(cfg.slots * min(cfg.ctx_per_slot, max_seq)),
                     "-t", str(threads), "-tb", str(threads), "-fa", str(cfg.flash_attn), "--no-webui",
                     *extra_args], cfg.startup_timeout_s)
        log.info("llama-server up in %.1f s: %d slots x %d tokens, %d threads, flash attention %s (%s)",
                 self.startup_s, cfg.slots, cfg.ctx_per_slot, threads, cfg.flash_attn, log_path)
