from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EvalConfig:
    # MT-bench format question file; empty: the demo questions shipped with the package.
    questions: str = ""
    limit: Optional[int] = None
    # default: <questions stem>[-n<limit>]-T<temperature>-m<max_new_tokens>-<precision>-tree<top_k>x<depth>x<total>
    run_name: Optional[str] = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    top_k: int = 10
    depth: int = 6
    total_tokens: int = 60
    baseline: bool = True  # also run vanilla decoding for wall-clock speedup
    # Vanilla baseline on the first N questions only (None: all). Speedup compares the same turns both ways;
    # tau always covers every question. Halves a long CPU eval at the cost of a smaller speedup sample.
    baseline_limit: Optional[int] = None
    seed: int = 0
    # Stop after the question that crosses this many seconds; a rerun continues from answers.partial.jsonl.
    time_budget_s: Optional[float] = None
    # A partial run with other settings or another head is refused unless set (it is then discarded).
    overwrite: bool = False
