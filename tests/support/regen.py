"""Regen inputs and settings on the tiny target (test_regen.py, shared with the tests that regenerate answers):
every record shape regen must handle, and a small run's config."""
from __future__ import annotations

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.regen.config import RegenConfig
from pipeline.target import TargetConfig

QUESTIONS = [
    "Hello! How can I help you today?", "What is 12 times 7?", "Write a short poem about the sea.",
    "def add(a, b):", "The quick brown fox", "Answer briefly and precisely.", "Speculative decoding drafts tokens.",
    "Why?", "Tell me about the wind and the stars, and then about the lazy dog.", "Hi", "What is 7?",
    "Write a poem.", "Explain speculative decoding with a small head.", "The lazy dog.",
]


def _records() -> list[dict]:
    """Every shape regen must handle: prompt only, ShareGPT with original answers to discard, system prompts,
    MT-bench with a follow-up turn, OpenAI messages."""
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": q}]} for i, q in enumerate(QUESTIONS)]
    rows += [
        {"id": "sg-multi", "conversations": [
            {"from": "system", "value": "You are terse."}, {"from": "human", "value": "What is 12 times 7?"},
            {"from": "gpt", "value": "ORIGINAL ANSWER ONE"}, {"from": "human", "value": "And times 8?"},
            {"from": "gpt", "value": "ORIGINAL ANSWER TWO"}]},
        {"question_id": "mt-1", "category": "math", "turns": ["What is 12 times 7?", "Now explain it."]},
        {"id": "oa-1", "messages": [{"role": "user", "content": "Write a short poem."},
                                    {"role": "assistant", "content": "ORIGINAL POEM"}]},
    ]
    return rows


def _cfg(tmp_path, tiny_model_dir, source, name="run", **regen) -> EagletConfig:
    settings = dict(batch_size=2, batches_per_shard=2, max_new_tokens=8, progress=False)
    settings.update(regen)
    return EagletConfig(
        name=name, output_root=str(tmp_path / "out"),
        target=TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None),
        data=DataConfig(sources=[str(source)]), regen=RegenConfig(**settings))
