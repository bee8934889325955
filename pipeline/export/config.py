"""Hydra schema of the export stage (see pipeline/export/run.py and docs/export.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ExportConfig:
    format: Optional[str] = None  # sglang | vllm | eagle1; None: sglang for eagle3, eagle1 for eagle1
    dtype: str = "bfloat16"  # bfloat16 | float32
    verify: bool = False  # print the tensor table and the round-trip logit difference
    verifier: Optional[str] = None  # vllm speculators_config verifier; None: target.hub_id
    # vLLM speculators `proposal_methods[0].speculative_tokens`, also the printed vLLM command's value.
    speculative_tokens: int = 3
    # How SGLang reads custom `eagle_config.eagle_aux_hidden_state_layer_ids` (docs/export.md):
    # "output" = layer outputs (input index - 1), SGLang's historic rule; "input" = input indices, what SGLang
    # after PR #25454 uses unless the first id is 1. Only matters when the aux layers are custom and exclude
    # layer 2; otherwise eaglet writes ids that every SGLang version reads the same way.
    sglang_aux_convention: str = "output"
