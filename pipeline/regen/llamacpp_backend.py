"""`regen.backend=llamacpp`: a llama.cpp server that regen starts on the target's GGUF (llama_server.py),
answered through the OpenAI-compatible HTTP client (openai_backend.py) with one conversation per slot."""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Optional

from pipeline.regen.openai_backend import make_managed

log = logging.getLogger(__name__)


def unavailable(cfg) -> Optional[str]:
    from pipeline.regen.llama_server import BinaryMismatch, binary_path, checked_binary, find_binary
    from pipeline.target import resolve_device, resolve_source

    if cfg.target.chat_template:
        return "the server renders chats with the GGUF's template, not target.chat_template"
    if resolve_device(cfg.target.device).type != "cpu":
        return "llama-server is built for the CPU here"
    if resolve_source(cfg.target)[0] != "gguf":
        return f"target {cfg.target.name} is not a GGUF"
    if find_binary(cfg.regen.llamacpp, cfg.target) is None:
        return f"no llama-server at {binary_path(cfg.regen.llamacpp, cfg.target)} (make llama-server)"
    try:
        checked_binary(cfg.regen.llamacpp, cfg.target)
    except BinaryMismatch as e:  # said aloud: `auto` then regenerates in-process, more slowly
        log.warning("regen.backend=auto: not llamacpp: %s", e)
        return str(e)
    return None


def version(cfg=None) -> Optional[str]:
    from pipeline.regen.config import LlamaCppConfig
    from pipeline.regen.llama_server import checked_binary, find_binary
    from pipeline.target import TargetConfig

    lcfg, target = cfg.regen.llamacpp if cfg else LlamaCppConfig(), cfg.target if cfg else TargetConfig()
    if find_binary(lcfg, target) is None:
        return None
    binary = checked_binary(lcfg, target)  # it is executed: the same check as before serving
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    line = next((x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version")), "")
    return line.removeprefix("version:").strip() or None


def make(cfg, info):
    from pipeline.target import resolve_source

    rcfg = cfg.regen
    # The GGUF names the served model (what the server's /models lists varies with its version).
    generation = {"served_model": Path(resolve_source(cfg.target)[1]).name}
    return make_managed(cfg, "llamacpp", generation, lambda: start_server(cfg, info), "default",
                        rcfg.llamacpp.slots, rcfg.llamacpp.timeout_s)


def start_server(cfg, info):
    from transformers import AutoConfig

    from pipeline.regen.llama_server import LlamaServer, checked_binary
    from pipeline.target import materialize, resolve_source

    kind, gguf = resolve_source(cfg.target)
    if kind != "gguf":
        raise ValueError(f"regen.backend=llamacpp serves a GGUF target; target {cfg.target.name} is a {kind} "
                         f"({cfg.target.path}): use regen.backend=hf")
    binary = checked_binary(cfg.regen.llamacpp, cfg.target)  # its recorded sha256, before it is executed
    hf_config = AutoConfig.from_pretrained(materialize(cfg.target)[0], revision=cfg.target.revision)
    return LlamaServer(binary, Path(gguf), cfg.regen.llamacpp,
                       cfg.stage_dir("regen") / f"llama-server.rank{info.rank}.log",
                       max_seq=getattr(hf_config, "max_position_embeddings", None) or 4096)
