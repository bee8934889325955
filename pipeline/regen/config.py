from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.choices import Choice
from pipeline.regen.backends import names as backend_names

# `auto` and every registered backend (pipeline/regen/backends.py: a backend is one entry there).
RegenBackend = Choice("RegenBackend", {name: name for name in ("auto", *backend_names())})


class OnDegenerate(Choice):
    flag = "flag"  # keep empty / cut-off answers, flagged in the records
    drop = "drop"  # drop the conversation


class KVCacheKind(Choice):
    dynamic = "dynamic"
    static = "static"


@dataclass
class OpenAIBackendConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "default"
    api_key_env: str = "OPENAI_API_KEY"
    # Conversations in flight; each sends its next turn as soon as its answer returns. Set it to the server's
    # parallel slots (llama.cpp `-np`, vLLM/SGLang max running requests) so continuous batching stays full.
    concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0


@dataclass
class LlamaCppConfig:
    """`regen.backend=llamacpp`: a llama.cpp server regen starts itself (pipeline/regen/llama_server.py)."""
    # Empty: <eaglet cache>/llama.cpp/bin/llama-server ($EAGLET_CACHE or ~/.cache/eaglet), where
    # `make llama-server` builds it.
    binary: str = ""
    slots: int = 32  # parallel sequences (conversations in flight)
    # KV cache tokens per slot (capped at the model's context): the longest conversation history plus
    # max_new_tokens must fit, or the server refuses that turn (recorded as a failure, http_400). Memory:
    # slots x ctx_per_slot x the KV bytes per token (23 KiB for SmolLM2-135M: 32 x 4096 is 3 GiB).
    ctx_per_slot: int = 4096
    threads: Optional[int] = None  # None: this process's CPUs shared among the ranks on the node
    startup_timeout_s: float = 120.0
    timeout_s: float = 1800.0  # per request: a slot shares the CPU with slots - 1 others


@dataclass
class HFGenerateConfig:
    """`regen.backend=hf` options (the bench of engines, bench/bench_stages.py, measures them)."""
    # dynamic: the KV cache grows each step (HF's default) | static: one cache per batch, allocated for its
    # prompt width + max_new_tokens (fixed shapes, which torch.compile needs).
    cache: KVCacheKind = KVCacheKind.dynamic
    # torch.compile the forward that generate runs (needs cache=static). It compiles once per batch shape, so
    # static widths are rounded up to pad_to_multiple tokens to let batches share compiled graphs.
    compile: bool = False
    pad_to_multiple: int = 256

    def __post_init__(self) -> None:
        self.cache = KVCacheKind.parse(self.cache, "regen.hf.cache")
        if self.compile and self.cache != KVCacheKind.static:
            raise ValueError("regen.hf.compile needs regen.hf.cache=static (a growing cache changes shape each step)")


@dataclass
class RegenConfig:
    # auto: llamacpp when the target is a GGUF, it runs on CPU and the llama-server binary is built (AMX
    # prompt processing, continuous batching; the comparison with hf is in docs/results.md), else hf.
    # hf: in-process batched HF generate. llamacpp: a llama.cpp server regen starts itself. openai: any
    # OpenAI-compatible server you run.
    backend: RegenBackend = RegenBackend.auto
    batch_size: int = 16
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    limit: Optional[int] = None  # first N conversations of the input (None: all)
    batches_per_shard: int = 4
    on_degenerate: OnDegenerate = OnDegenerate.flag  # empty answers, answers cut at max_new_tokens
    # A directory holding a different run (input, plan, generation settings, target) is refused unless set.
    overwrite: bool = False
    # Rank 0 waits this long for the other ranks' shards before giving up on the manifest.
    wait_timeout_s: float = 3600.0
    progress: bool = True
    # Generate nothing: write the manifest over the shards finished so far (it records the missing ones,
    # "complete": false) so the next stages can start while a long regen is still unfinished. A later
    # plain rerun finishes the missing shards and rewrites the manifest (the dump must then be redone).
    finalize_partial: bool = False
    hf: HFGenerateConfig = field(default_factory=HFGenerateConfig)
    openai: OpenAIBackendConfig = field(default_factory=OpenAIBackendConfig)
    llamacpp: LlamaCppConfig = field(default_factory=LlamaCppConfig)

    def __post_init__(self) -> None:
        self.backend = RegenBackend.parse(self.backend, "regen.backend")
        self.on_degenerate = OnDegenerate.parse(self.on_degenerate, "regen.on_degenerate")
