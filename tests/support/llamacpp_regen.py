"""A small regen run on the SmolLM2 GGUF through llama.cpp's server (test_regen_llamacpp.py and the regen
processes it starts, which import it from the repository root): multi-turn conversations in three formats."""
from __future__ import annotations

import json

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.regen.config import LlamaCppConfig, RegenConfig
from pipeline.target import TargetConfig

ROWS = [
    {"question_id": "mt", "turns": ["Name a fruit.", "What colour is it?", "And its taste?"]},
    {"id": "cats", "conversations": [{"from": "human", "value": "Why do cats purr?"},
                                     {"from": "gpt", "value": "ORIGINAL"}]},
    {"id": "hi", "messages": [{"role": "user", "content": "Say hi."}]},
]


def _cfg(tmp_path, backend: str, target: TargetConfig = None, **llamacpp) -> EagletConfig:
    source = tmp_path / "convs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return EagletConfig(name=f"llamacpp-{backend}", output_root=str(tmp_path / "out"),
                        target=target or TargetConfig(device="cpu"), data=DataConfig(sources=[str(source)]),
                        regen=RegenConfig(backend=backend, batch_size=3, batches_per_shard=1, max_new_tokens=16,
                                          progress=False, llamacpp=LlamaCppConfig(slots=2, ctx_per_slot=1024,
                                                                                  **llamacpp)))
