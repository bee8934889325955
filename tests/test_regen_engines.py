"""Regen through the in-process engines that run their own conversion of the target (CTranslate2, OpenVINO
GenAI): a real 2-conversation regen on the tiny Llama, converted once, whose greedy answers equal the hf
backend's fp32 answers; the fingerprint is the target's own; a second make reuses the conversion.
An engine that is not installed here (or, for OpenVINO, has no optimum-intel environment to convert with) is
skipped with the reason its `unavailable` gives."""
from __future__ import annotations

import importlib
import json

import pytest

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.dist import RankInfo
from pipeline.regen.batching import to_item
from pipeline.regen.config import RegenConfig
from pipeline.regen.hf_backend import HFBackend
from pipeline.regen.waves import regen_batch
from pipeline.target import TargetConfig, load_target

MAX_NEW = 16
CONVERSATIONS = [  # data-layer conversations: a single turn, and a system prompt with a follow-up turn
    {"id": "one", "messages": [{"role": "user", "content": "What is 12 times 7?"}]},
    {"id": "two", "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a short poem."},
        {"role": "assistant", "content": "ORIGINAL ANSWER"}, {"role": "user", "content": "And another one."}]},
]
ENGINES = {"ctranslate2": "CTranslate2Config", "openvino": "OpenVINOConfig"}


def _items():
    return [to_item(c) for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None, dtype="float32"))


@pytest.fixture(scope="module")
def hf_result(tiny_target):
    return regen_batch(HFBackend(tiny_target, MAX_NEW), _items(), seed=0)


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("engines")


def _cfg(tmp_path, tiny_model_dir, engine: str, cache, **options) -> EagletConfig:
    cfg = EagletConfig(name="engines", output_root=str(tmp_path / "out"),
                       target=TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None),
                       data=DataConfig(sources=[]),
                       regen=RegenConfig(batch_size=2, batches_per_shard=1, max_new_tokens=MAX_NEW, progress=False))
    module = importlib.import_module(f"pipeline.regen.{engine}_backend")
    options.setdefault("threads", 2)
    setattr(cfg.regen, engine, getattr(module, ENGINES[engine])(cache_dir=str(cache / engine), **options))
    return cfg


def _module(engine: str, cfg):
    module = importlib.import_module(f"pipeline.regen.{engine}_backend")
    reason = module.unavailable(cfg)
    if reason is not None:
        pytest.skip(f"regen.backend={engine} unavailable here: {reason}")
    return module


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_regen_equals_hf_fp32_greedy(engine, tmp_path, tiny_model_dir, tiny_target, hf_result, engine_cache):
    cfg = _cfg(tmp_path, tiny_model_dir, engine, engine_cache)
    module = _module(engine, cfg)
    backend, fingerprint, generation = module.make(cfg, RankInfo(0, 1, 0))
    try:
        assert fingerprint == tiny_target.fingerprint  # the target's own identity, from the files converted
        assert generation["stop_token_ids"] == HFBackend(tiny_target, MAX_NEW).stop_ids
        assert generation["precision"] == "float32" and "{target}" in generation["engine"]["conversion"]
        json.dumps(generation)  # goes into the manifest
        result = regen_batch(backend, _items(), seed=0)
        assert result.failures == []
        assert result.records == hf_result.records
        assert result.stats["tokens"] == hf_result.stats["tokens"]
        if getattr(backend, "concurrency", 0) > 0:  # the wave schedule through the same engine answers alike
            backend.concurrency = 0
            assert regen_batch(backend, _items(), seed=0).records == hf_result.records
    finally:
        backend.close()
    again, _, generation = module.make(cfg, RankInfo(0, 1, 0))  # the conversion is cached
    again.close()
    assert generation["server"]["convert_s"] == 0.0


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_sampling_follows_the_seed(engine, tmp_path, tiny_model_dir, engine_cache):
    cfg = _cfg(tmp_path, tiny_model_dir, engine, engine_cache)
    cfg.regen.temperature, cfg.regen.top_p = 1.0, 0.9
    module = _module(engine, cfg)
    backend, _, _ = module.make(cfg, RankInfo(0, 1, 0))
    try:
        first = regen_batch(backend, _items(), seed=1)
        again = regen_batch(backend, _items(), seed=1)
        assert first.failures == [] and first.stats["tokens"] > 0
        if engine == "ctranslate2":  # one random stream per worker thread, seeded once (module docstring)
            assert backend._seeded
        else:  # OpenVINO GenAI seeds each request (rng_seed)
            assert again.records == first.records
    finally:
        backend.close()


def test_registry_lists_the_engines():
    from pipeline.regen import backends

    for engine in ENGINES:
        assert engine in backends.names() and callable(backends.module(engine).version)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_stage_regen_through_the_engine(engine, tmp_path, tiny_model_dir, hf_result, engine_cache):
    """The whole stage (plan, shards, manifest) with regen.backend=<engine>, once the registry lists it."""
    from pipeline.data.bad_records import BadRecordReport
    from pipeline.data.readers import read_sources
    from pipeline.manifest import load_manifest
    from pipeline.regen import run as regen_run
    from pipeline.regen.shards import regen_sources

    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    cfg = _cfg(tmp_path, tiny_model_dir, engine, engine_cache)
    cfg.data = DataConfig(sources=[str(source)])
    cfg.regen.backend = engine
    _module(engine, cfg)
    regen_run.main(cfg)
    manifest = load_manifest(cfg.stage_dir("regen"))
    assert manifest["generation"]["backend"] == engine
    answers = {c["id"]: [m["content"] for m in c["messages"] if m["role"] == "assistant"]
               for c in read_sources(DataConfig(sources=regen_sources(cfg.stage_dir("regen"))), BadRecordReport())}
    expected = {r["id"]: [t["value"] for t in r["conversations"] if t["from"] == "gpt"] for r in hf_result.records}
    assert answers == expected


def test_openvino_without_a_converter_environment_says_how_to_make_one(tmp_path, tiny_model_dir):
    pytest.importorskip("openvino_genai")
    cfg = _cfg(tmp_path, tiny_model_dir, "openvino", tmp_path / "empty", converter_python=str(tmp_path / "none"))
    reason = importlib.import_module("pipeline.regen.openvino_backend").unavailable(cfg)
    assert reason is not None and "optimum-intel" in reason


def test_ctranslate2_groups_a_wave_by_prompt_length():
    """CTranslate2 forwards prompt tokens past a batch's shortest prompt one step at a time: a wave is split."""
    from types import SimpleNamespace

    from pipeline.regen.ctranslate2_backend import CTranslate2Backend

    groups = CTranslate2Backend._groups(SimpleNamespace(length_spread=10), [(5, 0), (562, 1), (12, 2), (15, 3)])
    assert groups == [[0, 2, 3], [1]]
