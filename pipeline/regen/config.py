from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
class RegenConfig:
    backend: str = "hf"  # hf | openai
    batch_size: int = 16
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    limit: Optional[int] = None  # first N conversations of the input (None: all)
    batches_per_shard: int = 4
    on_degenerate: str = "flag"  # flag | drop (empty answers, answers cut at max_new_tokens)
    # A directory holding a different run (input, plan, generation settings, target) is refused unless set.
    overwrite: bool = False
    # Rank 0 waits this long for the other ranks' shards before giving up on the manifest.
    wait_timeout_s: float = 3600.0
    progress: bool = True
    # Generate nothing: write the manifest over the shards finished so far (it records the missing ones,
    # "complete": false) so the next stages can start while a long regen is still unfinished. A later
    # plain rerun finishes the missing shards and rewrites the manifest (the dump must then be redone).
    finalize_partial: bool = False
    openai: OpenAIBackendConfig = field(default_factory=OpenAIBackendConfig)
