"""The tokens stage's config on the tiny target (test_tokens.py and the rank processes it starts, which import
it from the repository root)."""
from __future__ import annotations

import dataclasses

from pipeline.config import EagletConfig
from pipeline.hidden_states.config import DumpConfig
from tests.support.tiny_runs import EXPERIMENT, tiny_data, tiny_target


def config(root, model_dir, shared_data, **data) -> EagletConfig:
    cfg = EagletConfig(stage="dump", name=EXPERIMENT, output_root=str(root), target=tiny_target(model_dir),
                       data=tiny_data(shared_data, 24), dump=DumpConfig(input="data"))
    cfg.data = dataclasses.replace(cfg.data, **data)
    return cfg
