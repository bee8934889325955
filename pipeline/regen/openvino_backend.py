"""Generation through OpenVINO GenAI's continuous-batching pipeline (`regen.backend=openvino`), in process.

Runtime: `openvino-genai` in eaglet's own environment (a wheel with openvino and openvino-tokenizers; it changes
no pinned package). Conversion: the target is exported once with optimum-intel,

    optimum-cli export openvino --model <target HF dir> --task text-generation-with-past --weight-format fp32 <out>

cached by converted.py. optimum-intel pins its own transformers (2.2.0: transformers < 5.6), so it runs from a
separate environment, `<eaglet cache>/engines/openvino/venv` (`regen.openvino.converter_python`), made once with

    python3 -m venv <eaglet cache>/engines/openvino/venv
    <venv>/bin/pip install <the CPU torch wheel eaglet uses>        # torch==2.13.0+cpu here
    <venv>/bin/pip install -c <constraints: torch==2.13.0+cpu> "optimum-intel[openvino]==2.2.0" \
        openvino==<the runtime's version> openvino-tokenizers==<the same>
    <venv>/bin/pip uninstall -y torchvision   # pulled in for a torch it does not match; unused for text models

Weights: fp32 by default (`weight_format`; optimum-cli would otherwise compress a small model's weights to int8),
fp16/bf16 on request; compute and KV cache precision are set explicitly (`INFERENCE_PRECISION_HINT`,
`KV_CACHE_PRECISION`: f32 by default; the CPU plugin would otherwise pick bf16 on AMX CPUs and a u8 KV cache).

Scheduling: one engine thread owns the pipeline and runs `step()` while requests are in flight; `complete`
(called from `concurrency` conversation threads, waves.py's per-conversation schedule) adds a request with
`add_request` and waits for it, so a conversation's next turn joins the running batch as soon as its previous
answer is back. Prompts are eaglet's own rendering (pipeline/data/chat.py `render_prompt`) handed over as ids;
generation stops at the target's stop tokens or max_new_tokens; greedy at temperature 0, else multinomial
sampling over the whole vocabulary with temperature and top_p, seeded per request (`rng_seed`).
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Optional, Union

from pipeline.data.chat import ThinkingMode
from pipeline.regen.config import OpenVINOConfig
from pipeline.regen.in_process import TokenBackend
from pipeline.regen.waves import Answer, Failure, Request

log = logging.getLogger(__name__)

OPTIMUM_INTEL = "2.2.0"  # the converter version the venv recipe above installs (and the tests used)
WEIGHT_FORMATS = ("fp32", "fp16", "bf16")  # never int8/int4 here: regen answers must come from the target
PRECISIONS = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def version() -> Optional[str]:
    try:
        import openvino_genai
    except ImportError:
        return None
    return openvino_genai.__version__


def _options(cfg) -> OpenVINOConfig:
    return cfg.regen.openvino


def converter_python(cfg, options: OpenVINOConfig) -> Path:
    from pipeline.target import cache_root

    if options.converter_python:
        return Path(options.converter_python).expanduser()
    return cache_root(cfg.target) / "engines" / "openvino" / "venv" / "bin" / "python"


def unavailable(cfg) -> Optional[str]:
    if version() is None:
        return "openvino-genai is not installed (pip install openvino-genai)"
    options = _options(cfg)
    if options.weight_format not in WEIGHT_FORMATS:
        return f"regen.openvino.weight_format={options.weight_format}: one of {', '.join(WEIGHT_FORMATS)}"
    for key, value in (("precision", options.precision), ("kv_cache_precision", options.kv_cache_precision)):
        if value not in PRECISIONS:
            return f"regen.openvino.{key}={value}: one of {', '.join(PRECISIONS)}"
    import openvino as ov

    if options.device.split(".")[0] not in ov.Core().available_devices:
        return f"regen.openvino.device={options.device} is not available here ({ov.Core().available_devices})"
    python = converter_python(cfg, options)
    if not _converted_already(cfg, options) and not python.is_file():
        return (f"no optimum-intel environment at {python.parent.parent} to convert the target (see "
                f"pipeline/regen/openvino_backend.py for the two pip commands; or set regen.openvino.converter_python)")
    return None


def _settings(options: OpenVINOConfig) -> dict:
    import openvino

    return {"openvino": openvino.__version__.split("-")[0], "optimum_intel": OPTIMUM_INTEL,
            "weight_format": options.weight_format}


def _converted_already(cfg, options: OpenVINOConfig) -> bool:
    from pipeline.regen.converted import DONE, conversion_dir, target_files

    try:
        files = target_files(cfg.target)
    except Exception:  # noqa: BLE001 - make() reports it
        return False
    return (conversion_dir(cfg.target, "openvino", options.cache_dir, files.fingerprint, _settings(options))
            / DONE).is_file()


def conversion_command(weight_format: str) -> list[str]:
    return ["optimum-cli", "export", "openvino", "--model", "{target}", "--task", "text-generation-with-past",
            "--weight-format", weight_format, "{out}"]


def make(cfg, info):
    """(backend, target fingerprint, generation parameters)."""
    import os
    import time

    from pipeline.regen.converted import conversion_dir, convert_once, target_files

    reason = unavailable(cfg)
    if reason is not None:
        raise RuntimeError(f"regen.backend=openvino: {reason}")
    rcfg, options = cfg.regen, _options(cfg)
    t0 = time.perf_counter()
    files = target_files(cfg.target)
    settings = _settings(options)
    out = conversion_dir(cfg.target, "openvino", options.cache_dir, files.fingerprint, settings)
    command = conversion_command(options.weight_format)
    python = converter_python(cfg, options)
    cli = python.parent / "optimum-cli"
    argv = [str(cli), *[a.replace("{target}", files.location) for a in command[1:]]]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", str(options.threads or 2))
    convert_s = convert_once(out, argv, settings, env=env)
    backend = OpenVINOBackend(str(out), files.tokenizer, files.stop_ids, rcfg.max_new_tokens, rcfg.temperature,
                              rcfg.top_p, options, files.max_positions,
                              thinking=getattr(rcfg, "thinking", ThinkingMode.template))
    # The backend-specific keys; run.py adds the common ones (backend, max_new_tokens, temperature, ...).
    generation = {"stop_token_ids": files.stop_ids, "precision": PRECISIONS[options.precision],
                  "engine": {"name": "openvino-genai", "version": version(), **settings,
                             "precision": options.precision, "kv_cache_precision": options.kv_cache_precision,
                             "device": options.device, "conversion": command},
                  # timings and paths: under "server", which run.py leaves out of the run's identity
                  "server": {"convert_s": round(convert_s, 2), "startup_s": round(time.perf_counter() - t0, 2),
                             "threads": backend.threads, "concurrency": backend.concurrency,
                             "model_dir": str(out)}}
    return backend, files.fingerprint, generation


class EngineDied(RuntimeError):
    pass


class OpenVINOBackend(TokenBackend):
    name = "openvino"

    def __init__(self, model_dir: str, tokenizer, stop_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, options: Optional[OpenVINOConfig] = None,
                 max_positions: Optional[int] = None, thinking=ThinkingMode.template):
        import openvino_genai as genai

        from pipeline.regen.converted import default_threads

        if max_new_tokens < 1:
            raise ValueError(f"regen.max_new_tokens must be >= 1, got {max_new_tokens}")
        options = options or OpenVINOConfig()
        self.tokenizer, self.stop_ids, self.max_new_tokens = tokenizer, list(stop_ids), max_new_tokens
        self.temperature, self.top_p, self.max_positions = temperature, top_p, max_positions
        self.set_thinking(thinking)
        self.concurrency = max(0, options.concurrency)
        self.threads = options.threads or default_threads()
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = max(1, int(round(options.kv_cache_gb)))
        scheduler.max_num_batched_tokens = options.max_num_batched_tokens
        scheduler.dynamic_split_fuse = True
        scheduler.enable_prefix_caching = False
        properties = {"INFERENCE_NUM_THREADS": self.threads, "INFERENCE_PRECISION_HINT": options.precision,
                      "KV_CACHE_PRECISION": options.kv_cache_precision}
        self.pipe = genai.ContinuousBatchingPipeline(model_dir, scheduler, options.device, properties)
        self._ids = itertools.count()
        self._new: list[tuple[int, list[int], object, Future]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._error: Optional[BaseException] = None
        self._engine = threading.Thread(target=self._loop, name="regen-openvino", daemon=True)
        self._engine.start()

    # -- the engine thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        import numpy as np
        import openvino as ov
        import openvino_genai as genai

        active: dict[int, tuple[object, Future]] = {}
        done = (genai.GenerationStatus.FINISHED, genai.GenerationStatus.STOP, genai.GenerationStatus.CANCEL,
                genai.GenerationStatus.IGNORED)
        try:
            while True:
                with self._wake:
                    while not self._new and not active and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        break
                    new, self._new = self._new, []
                for rid, ids, gen_config, fut in new:
                    tensor = ov.Tensor(np.asarray([ids], dtype=np.int64))
                    active[rid] = (self.pipe.add_request(rid, tensor, gen_config), fut)
                self.pipe.step()
                for rid, (handle, fut) in list(active.items()):
                    status = handle.get_status()
                    if status in done:
                        del active[rid]
                        outputs = handle.read_all()
                        if status == genai.GenerationStatus.IGNORED or not outputs:
                            fut.set_result(Failure("engine_ignored", f"OpenVINO GenAI dropped the request "
                                                   f"({status.name}; KV cache too small for it?)"))
                        else:
                            fut.set_result(outputs[0])
        except BaseException as e:  # noqa: BLE001 - every waiting conversation gets the error
            self._error = e
            log.error("OpenVINO GenAI engine failed: %s: %s", type(e).__name__, e)
        finally:
            with self._wake:
                self._closed = True
                pending = self._new
                self._new = []
            for _, _, _, fut in pending:
                fut.set_exception(EngineDied(f"OpenVINO GenAI engine stopped: {self._error!r}"))
            for _, fut in active.values():
                fut.set_exception(EngineDied(f"OpenVINO GenAI engine stopped: {self._error!r}"))

    def _submit(self, ids: list[int], seed: int) -> Future:
        fut: Future = Future()
        with self._wake:
            if self._closed:
                raise EngineDied(f"OpenVINO GenAI engine stopped: {self._error!r}")
            self._new.append((next(self._ids), ids, self._generation_config(seed), fut))
            self._wake.notify()
        return fut

    def _generation_config(self, seed: int):
        import openvino_genai as genai

        c = genai.GenerationConfig()
        c.max_new_tokens = self.max_new_tokens
        c.min_new_tokens = 0
        c.stop_token_ids = set(self.stop_ids)
        c.eos_token_id = self.stop_ids[0]
        c.repetition_penalty = 1.0
        if self.temperature > 0:  # top_k stays at its default, no cut (as hf's top_k=0)
            c.do_sample = True
            c.temperature = self.temperature
            c.top_p = self.top_p
            c.rng_seed = seed
        else:
            c.do_sample = False
        return c

    # -- the Backend protocol ---------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]:
        pending: list[Union[Failure, Future]] = []
        for r in requests:
            ids = self.prompt_ids(r.messages)
            pending.append(self.too_long(ids) or self._submit(ids, r.seed))
        return [p if isinstance(p, Failure) else self._answer(p.result()) for p in pending]

    def _answer(self, output) -> Union[Answer, Failure]:
        return output if isinstance(output, Failure) else self.answer(list(output.generated_ids))

    def complete(self, request: Request) -> Union[Answer, Failure]:
        return self.generate([request])[0]

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._engine.join(timeout=60)
        self.pipe = None
