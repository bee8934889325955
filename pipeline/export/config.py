from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ExportConfig:
    format: Optional[str] = None  # sglang | vllm | eagle1; None: sglang for eagle3, eagle1 for eagle1
    dtype: str = "bfloat16"  # bfloat16 | float32
    verify: bool = False
    verifier: Optional[str] = None  # vllm speculators_config verifier; None: target.hub_id
