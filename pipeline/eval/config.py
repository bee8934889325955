from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from pipeline.choices import Choice
from pipeline.decoding.tree import TreeSpec
from pipeline.files import check_name

log = logging.getLogger(__name__)


@dataclass
class TreeConfig:
    """The EAGLE-2 dynamic draft tree (the `tree` section): eval decodes with it, train's tau probe too, and
    export writes it into the serving commands (SGLang's --speculative-num-steps/-eagle-topk/-num-draft-tokens)."""
    top_k: int = 10  # children kept per expanded node
    depth: int = 6  # expansion steps after the root's (a path holds up to depth + 1 drafts); -1: eval chooses
    total_tokens: int = 60  # nodes verified per forward (root included); -1: eval chooses (autotree.py)
    # -1 above: eval measures this device's verification cost by tree size and the head's acceptance on the
    # first `auto_prompts` questions (first turns, `auto_max_new_tokens` each), up to these bounds.
    max_depth: int = 8
    max_total_tokens: int = 128
    auto_prompts: int = 3
    auto_max_new_tokens: int = 64

    def __post_init__(self) -> None:
        for key in ("depth", "total_tokens"):
            if getattr(self, key) < 0 and getattr(self, key) != -1:
                raise ValueError(f"tree.{key}={getattr(self, key)}: a size, or -1 to let eval choose it")

    @property
    def is_auto(self) -> bool:
        return self.depth == -1 or self.total_tokens == -1

    def spec(self, depth: Optional[int] = None, total_tokens: Optional[int] = None) -> TreeSpec:
        """The shape decoding uses (`TreeSpec`, the one tree type below the config): this section's, with eval's
        measured choice in place of a -1."""
        return TreeSpec(self.top_k, self.depth if depth is None else depth,
                        self.total_tokens if total_tokens is None else total_tokens)

    def fixed(self, what: str) -> TreeSpec:
        """The tree of a fixed-tree consumer (`what`: train's tau probe, export's serve command): a -1 becomes
        the default, said in the log, since only eval measures its choice."""
        default = TreeConfig()
        spec = self.spec(default.depth if self.depth == -1 else None,
                         default.total_tokens if self.total_tokens == -1 else None)
        if self.is_auto:
            log.warning("%s: tree %dx%dx%d (tree.depth/total_tokens=-1 is chosen by eval, see its summary.json "
                        "tree_choice)", what, spec.top_k, spec.depth, spec.total_tokens)
        return spec


# Keys that moved out of `eval`, with their new names: an old override fails naming the new key.
MOVED = {"top_k": "tree.top_k", "depth": "tree.depth", "total_tokens": "tree.total_tokens"}


class DrafterKind(Choice):
    head = "head"  # the trained head `head.name` (outputs/<exp>/train/<head>)
    prompt_lookup = "prompt_lookup"  # n-gram lookup in the context (lookup.py): training-free, no head


@dataclass
class LookupConfig:
    """eval.drafter=prompt_lookup: the longest suffix n-gram, max_ngram down to min_ngram, is looked up."""
    max_ngram: int = 3
    min_ngram: int = 1


@dataclass
class EvalConfig:
    # MT-bench format question file; empty: the demo questions shipped with the package.
    questions: str = ""
    limit: Optional[int] = None
    # What drafts: the trained head, or a training-free baseline on the same decoder (lossless either way).
    drafter: DrafterKind = DrafterKind.head
    # drafter=head: an exported head's folder (an export's files with its manifest.json, e.g. heads/<name>) instead
    # of this experiment's train/<head.name>: the head as shipped, evaluated under eval/<folder name>/.
    head_dir: str = ""
    # Several drafters side by side on the same turns in one run (`prompt_lookup` or head names under this
    # experiment's train/; pipeline/eval/compare.py), into eval/compare/<run>. Empty: `drafter` alone.
    compare: list[str] = field(default_factory=list)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    # default: <questions stem>[-n<limit>]-T<temperature>-m<max_new_tokens>-<precision>-tree<top_k>x<depth>x<total>
    run_name: Optional[str] = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    baseline: bool = True  # also run vanilla decoding for wall-clock speedup
    # T=0: each answer of the first `greedy_check` questions (null: all) is followed with the target's one-token
    # forwards, as plain greedy decoding computes them (pipeline/decoding/ties.py); every question with a baseline
    # is checked too (the check is its baseline, the same forwards). A token the target does not rank first fails
    # the eval, unless its margin is a numerical tie of the precision (none in fp32). 0: the baseline's partings
    # are recorded, none fails the eval.
    greedy_check: Optional[int] = 10
    # A turn whose answer repeats itself (a share of its token 4-grams seen earlier in it above this) is flagged:
    # the summary gives tau without such turns too, since a loop inflates tau.
    loop_share: float = 0.5
    # Vanilla baseline on the first N questions only (None: all). Speedup compares the same turns both ways;
    # tau always covers every question. Halves a long CPU eval at the cost of a smaller speedup sample.
    baseline_limit: Optional[int] = None
    seed: int = 0
    # Stop after the question that crosses this many seconds; a rerun continues from answers.partial.jsonl.
    time_budget_s: Optional[float] = None
    # A partial run with other settings or another head is refused unless set (it is then discarded).
    overwrite: bool = False
    # Decode with a head trained under another chat template than target.chat_template gives: refused unless
    # set (the template experiment, docs/results/analyses.md; the vocabulary must still match).
    allow_template_mismatch: bool = False
    # Decode with a head trained under another regen.thinking mode than this run's (the head's train manifest
    # records it): refused unless set (measures what serving in the other mode costs).
    allow_thinking_mismatch: bool = False
    # Moved to `tree` (MOVED); kept only to name the new key when an old override sets them.
    top_k: Optional[int] = None
    depth: Optional[int] = None
    total_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        self.drafter = DrafterKind.parse(self.drafter, "eval.drafter")
        if self.run_name:  # a folder under eval/<subject>/ (empty: the derived name, EagletConfig.eval_run_name)
            check_name(self.run_name, "eval.run_name")
        for name in self.compare:  # head names under train/, and parts of file names in the run folder
            check_name(name, "eval.compare")
        for old, new in MOVED.items():
            if getattr(self, old) is not None:
                raise ValueError(f"eval.{old} is now {new} (one tree for eval, train's tau probe and export)")
