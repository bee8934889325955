from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TreeConfig:
    """The EAGLE-2 dynamic draft tree (the `tree` section): eval decodes with it, train's tau probe too, and
    export writes it into the serving commands (SGLang's --speculative-num-steps/-eagle-topk/-num-draft-tokens)."""
    top_k: int = 10  # children kept per expanded node
    depth: int = 6  # expansion steps after the root's (a path holds up to depth + 1 drafts)
    total_tokens: int = 60  # draft tokens verified per forward (the tree's size, root excluded)


# Keys that moved out of `eval`, with their new names: an old override fails naming the new key.
MOVED = {"top_k": "tree.top_k", "depth": "tree.depth", "total_tokens": "tree.total_tokens"}


@dataclass
class EvalConfig:
    # MT-bench format question file; empty: the demo questions shipped with the package.
    questions: str = ""
    limit: Optional[int] = None
    # default: <questions stem>[-n<limit>]-T<temperature>-m<max_new_tokens>-<precision>-tree<top_k>x<depth>x<total>
    run_name: Optional[str] = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    baseline: bool = True  # also run vanilla decoding for wall-clock speedup
    # Vanilla baseline on the first N questions only (None: all). Speedup compares the same turns both ways;
    # tau always covers every question. Halves a long CPU eval at the cost of a smaller speedup sample.
    baseline_limit: Optional[int] = None
    seed: int = 0
    # Stop after the question that crosses this many seconds; a rerun continues from answers.partial.jsonl.
    time_budget_s: Optional[float] = None
    # A partial run with other settings or another head is refused unless set (it is then discarded).
    overwrite: bool = False
    # Moved to `tree` (MOVED); kept only to name the new key when an old override sets them.
    top_k: Optional[int] = None
    depth: Optional[int] = None
    total_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for old, new in MOVED.items():
            if getattr(self, old) is not None:
                raise ValueError(f"eval.{old} is now {new} (one tree for eval, train's tau probe and export)")
