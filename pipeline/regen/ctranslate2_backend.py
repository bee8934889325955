"""Generation through CTranslate2 (`regen.backend=ctranslate2`), in process, one batch per wave.

The target is converted once with CTranslate2's own converter (`ct2-transformers-converter ... --quantization
float32`, cached by converted.py) and run by `ctranslate2.Generator`. Weights are stored fp32; `compute_type`
chooses the precision at load (float32, or bfloat16 where the CPU/GPU computes it: CTranslate2 lists what the
device supports, `ctranslate2.get_supported_compute_types`). Prompts are eaglet's own rendering
(pipeline/data/chat.py `render_prompt`, as hf does), handed over as token lists; generation stops at the
target's stop tokens (`stop_token_ids`) or max_new_tokens. Greedy at temperature 0 (answers equal hf's fp32
ones on the tiny test model and on 8 SmolLM2 chats). Sampling draws from the whole vocabulary (top_k 0) with
temperature and top_p, but is NOT reproducible per batch: CTranslate2 keeps one random generator per worker
thread, seeded from `ctranslate2.set_random_seed` when the thread first samples, so a later seed is ignored
(measured: the same wave twice in one process differs; two fresh processes seeded alike draw alike). Sampling
is seeded once per process (from the first wave's seeds) and records `"sampling": "seeded per process"`: a run
from scratch repeats, a resumed run's remaining batches are fresh draws.

A wave is one `generate_batch` call: the faster mode on the 2-core probe (8 SmolLM2 chats, 96 new tokens:
77 tok/s as one batch vs 28 tok/s for 8 asynchronous single requests on 1 worker x 2 threads, 34 on 2 x 1).
CTranslate2 forwards a batch's prompts up to the shortest one's length at once and the rest token by token, so
a wave is split into groups of prompts within `length_spread` tokens of the group's shortest, one
`generate_batch` each (measured: 7 chats of ~40 prompt tokens and one of 562, 48 new tokens: 55 s as one batch,
23 s as two groups, same answers).
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, Union

from pipeline.data.chat import ThinkingMode
from pipeline.regen.batching import derive_seed
from pipeline.regen.config import CTranslate2Config
from pipeline.regen.in_process import TokenBackend
from pipeline.regen.waves import Answer, Failure, Request

log = logging.getLogger(__name__)

CONVERTER = "ct2-transformers-converter"  # = python -m ctranslate2.converters.transformers
STORED = "float32"  # the conversion's weight format; compute_type converts at load


def version() -> Optional[str]:
    try:
        import ctranslate2
    except ImportError:
        return None
    return ctranslate2.__version__


def _options(cfg) -> CTranslate2Config:
    return cfg.regen.ctranslate2


def _device(cfg, options: CTranslate2Config) -> str:
    if options.device != "auto":
        return options.device
    import ctranslate2

    from pipeline.target import resolve_device

    if resolve_device(cfg.target.device).type == "cuda" and ctranslate2.get_cuda_device_count() > 0:
        return "cuda"
    return "cpu"


def unavailable(cfg) -> Optional[str]:
    if version() is None:
        return "ctranslate2 is not installed (pip install ctranslate2)"
    import ctranslate2
    from ctranslate2.converters import transformers as converters
    from transformers import AutoConfig

    from pipeline.target import materialize

    options = _options(cfg)
    device = _device(cfg, options)
    supported = ctranslate2.get_supported_compute_types(device)
    if options.compute_type not in supported:
        return (f"regen.ctranslate2.compute_type={options.compute_type} is not supported on {device} here "
                f"(supported: {', '.join(sorted(supported))})")
    location, _ = materialize(cfg.target)
    hf_config = AutoConfig.from_pretrained(location, revision=cfg.target.revision)
    if type(hf_config).__name__ not in converters._MODEL_LOADERS:
        return f"CTranslate2 {version()} cannot convert a {type(hf_config).__name__} model"
    return None


def make(cfg, info):
    """(backend, target fingerprint, generation parameters)."""
    import time

    from pipeline.regen.converted import conversion_dir, convert_once, target_files

    reason = unavailable(cfg)
    if reason is not None:
        raise RuntimeError(f"regen.backend=ctranslate2: {reason}")
    rcfg, options = cfg.regen, _options(cfg)
    t0 = time.perf_counter()
    files = target_files(cfg.target)
    settings = {"engine": "ctranslate2", "version": version(), "quantization": STORED}
    out = conversion_dir(cfg.target, "ctranslate2", options.cache_dir, files.fingerprint, settings)
    command = [CONVERTER, "--model", "{target}", "--output_dir", "{out}", "--quantization", STORED]
    argv = [sys.executable, "-m", "ctranslate2.converters.transformers",
            *[a.replace("{target}", files.location) for a in command[1:]]]
    convert_s = convert_once(out, argv, settings)
    backend = CTranslate2Backend(str(out), files.tokenizer, files.stop_ids, rcfg.max_new_tokens, rcfg.temperature,
                                 rcfg.top_p, options, _device(cfg, options), files.max_positions,
                                 thinking=getattr(rcfg, "thinking", ThinkingMode.template))
    # The backend-specific keys; run.py adds the common ones (backend, max_new_tokens, temperature, ...).
    generation = {"stop_token_ids": files.stop_ids, "precision": options.compute_type,
                  "engine": {"name": "ctranslate2", "version": version(), "compute_type": options.compute_type,
                             "device": backend.device, "conversion": command},
                  **({"sampling": "seeded per process"} if rcfg.temperature > 0 else {}),
                  # timings and paths: under "server", which run.py leaves out of the run's identity
                  "server": {"convert_s": round(convert_s, 2), "startup_s": round(time.perf_counter() - t0, 2),
                             "threads": backend.threads, "model_dir": str(out)}}
    return backend, files.fingerprint, generation


class CTranslate2Backend(TokenBackend):
    name = "ctranslate2"
    concurrency = 0  # one generate_batch per wave (waves.py)

    def __init__(self, model_dir: str, tokenizer, stop_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, options: Optional[CTranslate2Config] = None,
                 device: str = "cpu", max_positions: Optional[int] = None, thinking=ThinkingMode.template):
        import ctranslate2

        from pipeline.regen.converted import default_threads

        if max_new_tokens < 1:
            raise ValueError(f"regen.max_new_tokens must be >= 1, got {max_new_tokens}")
        options = options or CTranslate2Config()
        self.tokenizer, self.stop_ids, self.max_new_tokens = tokenizer, list(stop_ids), max_new_tokens
        self.temperature, self.top_p, self.max_positions = temperature, top_p, max_positions
        self.set_thinking(thinking)
        self.max_batch_size, self.device = options.max_batch_size, device
        self.length_spread = max(0, options.length_spread)
        self.threads = options.threads or default_threads()
        self.generator = ctranslate2.Generator(model_dir, device=device, compute_type=options.compute_type,
                                               intra_threads=self.threads, inter_threads=1)
        self._seeded = False
        if temperature > 0:  # full vocabulary (no top-k cut), as hf's top_k=0
            self.sampling = dict(sampling_topk=0, sampling_temperature=temperature, sampling_topp=top_p)
        else:
            self.sampling = dict(sampling_topk=1)

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]:
        import ctranslate2

        prompts = [self.prompt_ids(r.messages) for r in requests]
        results, runnable = self.split_runnable(prompts)
        if runnable:
            if self.temperature > 0 and not self._seeded:  # only the first seed counts (see the docstring)
                ctranslate2.set_random_seed(derive_seed(*(requests[i].seed for i in runnable)))
                self._seeded = True
            for group in self._groups([(len(prompts[i]), i) for i in runnable]):
                out = self.generator.generate_batch(
                    [self.tokenizer.convert_ids_to_tokens(prompts[i]) for i in group],
                    max_length=self.max_new_tokens, include_prompt_in_result=False, end_token=self.stop_ids,
                    return_end_token=True, max_batch_size=self.max_batch_size, beam_size=1,
                    repetition_penalty=1.0, no_repeat_ngram_size=0, **self.sampling)
                for i, result in zip(group, out):
                    results[i] = self.answer(result.sequences_ids[0])
        return results

    def _groups(self, lengths: list[tuple[int, int]]) -> list[list[int]]:
        """Request indices grouped so that each group's prompts are within length_spread of its shortest."""
        groups: list[list[int]] = []
        start = None
        for length, i in sorted(lengths):
            if start is None or length - start > self.length_spread:
                groups.append([])
                start = length
            groups[-1].append(i)
        return groups

    def complete(self, request: Request) -> Union[Answer, Failure]:
        return self.generate([request])[0]

    def close(self) -> None:
        self.generator = None
