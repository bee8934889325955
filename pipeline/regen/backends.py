"""Regen backends: every engine regen can answer through, registered here and nowhere else.

An entry names the module that implements the backend. Each such module defines
    unavailable(cfg: EagletConfig) -> Optional[str]   None when it can serve the configured target on this
                                                     machine, else a one-line reason (not installed, ...)
    make(cfg: EagletConfig, info: RankInfo) -> (backend, target fingerprint, generation parameters)
    version() -> Optional[str]                       the engine's version, None when it is not installed
and its backend object follows `waves.Backend`. `regen.backend` takes the names below (or `auto`), and
`regen.backend=auto` takes the first available backend of `AUTO_ORDER` for the device, fastest first as
measured by bench/bench_stages.py (docs/results/speed.md).

This module imports nothing heavy: the config imports it for the list of names.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Entry:
    module: str
    what: str
    # How its backend's `prompt_length` measures a prompt to plan batches: "tokens" (eaglet renders and tokenizes
    # it: in-process engines) or "chars" (a server tokenizes it). An answer store's upgrade rebuilds a plan with it.
    measure: str = "tokens"


BACKENDS: dict[str, Entry] = {
    "hf": Entry("pipeline.regen.hf_backend", "in-process transformers generate, one padded batch per wave"),
    "llamacpp": Entry("pipeline.regen.llamacpp_backend",
                      "a llama.cpp server regen starts itself on the target's GGUF (CPU)", "chars"),
    "openai": Entry("pipeline.regen.openai_backend",
                    "OpenAI-compatible servers you run (vLLM, SGLang, llama.cpp): regen.openai.base_url", "chars"),
    "vllm": Entry("pipeline.regen.vllm_server",
                  "vLLM (its CPU build here): a server regen starts on the target's HF folder (make engine-vllm)",
                  "chars"),
    "ctranslate2": Entry("pipeline.regen.ctranslate2_backend",
                         "CTranslate2 in process, the target converted once (batched generation per wave)"),
    "openvino": Entry("pipeline.regen.openvino_backend",
                      "OpenVINO GenAI's continuous-batching pipeline in process, the target converted once"),
}

# Per device kind, first available wins (bench/results/stages.json measures them side by side). On CPU vLLM
# measured fastest (1.56x llama.cpp) but is opt-in: a 3.5 GB venv of its own and about a minute of start-up;
# OpenVINO (1.08x) needs its converter venv. A vLLM for the GPU is a server you run (`openai`) until
# `make engine-vllm` installs a GPU build.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("llamacpp", "hf"),
    "cuda": ("vllm", "hf"),
}


def names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def module(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"regen.backend={name!r}: choose one of auto, {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name].module)
