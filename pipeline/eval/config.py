from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EvalConfig:
    # MT-bench format question file; empty: the demo questions shipped with the package.
    questions: str = ""
    limit: Optional[int] = None
    run_name: Optional[str] = None  # default: <questions stem>-T<temperature>
    temperature: float = 0.0
    max_new_tokens: int = 256
    top_k: int = 10
    depth: int = 6
    total_tokens: int = 60
    baseline: bool = True  # also run vanilla decoding for wall-clock speedup
    seed: int = 0
