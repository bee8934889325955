from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DumpConfig:
    # Input: "regen" reads this experiment's regen output; "data" tokenizes the data sources directly.
    input: str = "regen"
    # Input-to-layer ids (hidden_states[i] enters decoder layer i). None: [2, L//2, L-3].
    layer_ids: Optional[list] = None
    batch_tokens: int = 8192  # tokens per forward batch (padded length x rows)
    max_batch_size: int = 16
    shard_bytes: int = 256 * 1024 * 1024
    dtype: str = "auto"  # auto (= target dtype) | bfloat16 | float16 | float32
    limit: Optional[int] = None
    verify: bool = False
