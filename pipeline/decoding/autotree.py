"""Tree size for the hardware (`tree.total_tokens=-1`, `tree.depth=-1`; the official EAGLE code's
`total_token=-1`): pick the tree with the most expected tokens per second on this device and precision.

Two measurements, both at the start of an eval:
1. Cost. A verification forward of N tree tokens over a cached prefix, timed for N on a grid (interleaved
   repeats, median), on the eval's own target; the drafter's time per expansion round from the calibration
   decodes below.
2. Acceptance. The head decodes a few calibration prompts greedily with the largest candidate tree
   (`tree.top_k`, `tree.max_depth`, `tree.max_total_tokens`). Every smaller EAGLE-2 tree of the same state is
   a sub-tree of that one: a depth-d tree has the same candidates up to node depth d + 1, and keeps the best
   N - 1 of them by score, an ancestor-closed set. Greedy verification of the sub-tree accepts exactly the
   longest prefix of the big tree's accepted path that lies inside it (children have distinct tokens). So one
   calibration run gives the accepted length of every (depth, N) at every step, exactly, as long as the big
   tree kept at least N - 1 nodes of depth <= d + 1 (otherwise the pair is left out).

Expected tokens per verification E(d, N) = 1 + mean accepted length; time per step = draft(d) + verify(N);
the choice maximizes E / time. The table behind it goes into the eval summary.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .decoder import (
    _new_cache,
    generate,
    keep_accepted_kv,
    supports_row_logits,
    target_forward,
    tree_attention_mask,
)
from .tree import DraftTree, TreeSpec

log = logging.getLogger(__name__)

PREFIX_TOKENS = 256  # cached context of the cost measurement: a typical chat prompt


@dataclass
class StepRecord:
    """One calibration step: the big tree's node scores and depths, its accepted path (node ids), how many
    nodes it could keep (its total_tokens - 1) and its top_k."""

    scores: list[float]
    depths: list[int]
    path: list[int]
    capacity: int
    top_k: int


@dataclass
class TreeChoice:
    top_k: int
    depth: int
    total_tokens: int
    table: list[dict] = field(default_factory=list)  # every (depth, total_tokens) evaluated
    verify_ms: dict = field(default_factory=dict)  # N -> median verification forward, ms
    draft_ms_per_round: float = 0.0

    def as_dict(self) -> dict:
        return {"top_k": self.top_k, "depth": self.depth, "total_tokens": self.total_tokens, "table": self.table,
                "verify_ms": {str(k): v for k, v in self.verify_ms.items()},
                "draft_ms_per_round": self.draft_ms_per_round}


class RecordingDrafter:
    """Wraps a drafter and keeps every tree it drafts, for `accepted_paths`."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []
        self.feature_layers = inner.feature_layers
        self.draft_s = 0.0

    def start(self, input_ids, states, next_token):
        self.inner.start(input_ids, states, next_token)

    def accept(self, states, next_tokens):  # one head pass, timed with the drafting rounds
        t0 = time.perf_counter()
        self.inner.accept(states, next_tokens)
        self.draft_s += time.perf_counter() - t0

    def draft(self, spec, temperature=0.0, generator=None):
        t0 = time.perf_counter()
        tree = self.inner.draft(spec, temperature, generator)
        self.draft_s += time.perf_counter() - t0
        self.trees.append(tree)
        return tree


def accepted_paths(trees: Sequence[DraftTree], tokens: Sequence[int], accept_lengths: Sequence[int]) -> list[list[int]]:
    """The accepted node path of each step, found by walking each tree with the tokens it emitted (the first
    generated token comes from the prefill; step s emits accept_lengths[s] drafts and a bonus)."""
    paths, pos = [], 1
    for tree, n in zip(trees, accept_lengths):
        path = [0]
        for tok in tokens[pos:pos + n]:
            path.append(next(c for c in tree.children[path[-1]] if tree.token_list[c] == tok))
        paths.append(path)
        pos += n + 1
    return paths


def subtree_accepted(step: StepRecord, depth: int, total_tokens: int) -> Optional[int]:
    """Draft tokens the (depth, total_tokens) sub-tree accepts at this step, or None when the big tree kept too
    few nodes of depth <= depth + 1 to know that sub-tree."""
    eligible = [i for i in range(1, len(step.scores)) if step.depths[i] <= depth + 1]
    # The big tree kept a prefix of the score ranking: if it kept N - 1 nodes of that depth, the sub-tree's
    # best N - 1 are among them. If it kept fewer, they are exact only when no candidate of that depth was
    # pruned: all k + depth * k^2 of them kept, or nothing pruned at all.
    candidates = step.top_k + depth * step.top_k ** 2
    if len(eligible) < min(total_tokens - 1, candidates) and len(step.scores) - 1 == step.capacity:
        return None
    ranked = sorted(eligible, key=lambda i: (-step.scores[i], i))[:total_tokens - 1]
    kept = set(ranked)
    accepted = 0
    for node in step.path[1:]:
        if node not in kept:
            break
        accepted += 1
    return accepted


def calibrate(target, drafter, prompts: Sequence[torch.Tensor], spec: TreeSpec, max_new_tokens: int,
              eos_token_ids) -> tuple[list[StepRecord], float]:
    """Greedy decodes with the big tree -> (every step's record, drafter seconds per round: a step's `accept`
    and its depth + 1 drafting passes count depth + 2)."""
    steps, rounds, draft_s = [], 0, 0.0
    for prompt in prompts:
        rec = RecordingDrafter(drafter)
        result = generate(target, rec, prompt, max_new_tokens, tree=spec, eos_token_ids=eos_token_ids)
        if any(tree.scores is None for tree in rec.trees):
            raise ValueError("tree.depth/total_tokens=-1 needs a drafter that scores its tree (EAGLE-2's builder); "
                             "set a fixed tree")
        for tree, path in zip(rec.trees, accepted_paths(rec.trees, result.tokens, result.accept_lengths)):
            steps.append(StepRecord(tree.scores.tolist(), tree.depths, path, spec.total_tokens - 1, spec.top_k))
        rounds += len(rec.trees) * (spec.depth + 2)
        draft_s += rec.draft_s
    return steps, draft_s / max(rounds, 1)


@torch.no_grad()
def verify_costs(target, sizes: Sequence[int], repeats: int = 5, prefix_tokens: int = PREFIX_TOKENS,
                 vocab: Optional[int] = None) -> dict[int, float]:
    """Median seconds of a verification forward of N tree tokens over a cached prefix, per N; repeats are
    interleaved across sizes, so a slow spell of the machine spreads over all of them."""
    device, dtype = target.device, target.dtype
    vocab = vocab or target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, prefix_tokens), generator=gen).to(device)
    cache = _new_cache(target)
    target_forward(target, prefix, cache, logits_to_keep=1)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # the first pass warms up
        for n in sizes:
            tree = DraftTree(torch.randint(0, vocab, (n,), generator=gen), [-1] + list(range(n - 1)))
            mask = tree_attention_mask(target, tree, prefix_tokens, dtype, device)
            _sync(device)
            t0 = time.perf_counter()
            target_forward(target, tree.tokens[None].to(device), cache, (), tree.position_ids(prefix_tokens, device),
                           mask, row_logits=supports_row_logits(target))
            _sync(device)
            if rep:
                times[n].append(time.perf_counter() - t0)
            keep_accepted_kv(cache, prefix_tokens, [])  # back to the prefix, as verification truncates it
    return {n: statistics.median(t) for n, t in times.items()}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def size_grid(max_total_tokens: int) -> list[int]:
    grid = [n for n in (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60, 64, 80, 96, 128, 160, 192, 256)
            if n <= max_total_tokens]
    return grid if max_total_tokens in grid else grid + [max_total_tokens]


def choose(steps: Sequence[StepRecord], verify_s: dict[int, float], draft_s_per_round: float, top_k: int,
           depths: Sequence[int]) -> TreeChoice:
    """The (depth, N) with the most expected tokens per second, and the table of all evaluated pairs."""
    table = []
    for depth in depths:
        for n, verify in sorted(verify_s.items()):
            acc = [subtree_accepted(s, depth, n) for s in steps]
            if not steps or any(a is None for a in acc):
                continue
            tokens = 1 + sum(acc) / len(acc)
            step_s = draft_s_per_round * (depth + 2) + verify
            table.append({"depth": depth, "total_tokens": n, "tokens_per_step": tokens,
                          "step_ms": 1e3 * step_s, "tokens_per_s": tokens / step_s})
    if not table:
        raise RuntimeError("tree choice: no calibration step to estimate acceptance from")
    best = max(table, key=lambda r: r["tokens_per_s"])
    return TreeChoice(top_k, best["depth"], best["total_tokens"], table,
                      {n: 1e3 * s for n, s in verify_s.items()}, 1e3 * draft_s_per_round)


def choose_tree(target, drafter, prompts: Sequence[torch.Tensor], top_k: int, depth: int, total_tokens: int,
                max_depth: int, max_total_tokens: int, max_new_tokens: int, eos_token_ids) -> TreeChoice:
    """The eval's tree: `depth` / `total_tokens` of -1 are chosen (up to max_depth / max_total_tokens), the
    others kept."""
    big_depth = max_depth if depth == -1 else depth
    big_total = max_total_tokens if total_tokens == -1 else total_tokens
    t0 = time.perf_counter()
    steps, draft_round_s = calibrate(target, drafter, prompts, TreeSpec(top_k, big_depth, big_total), max_new_tokens,
                                     eos_token_ids)
    sizes = size_grid(big_total) if total_tokens == -1 else [total_tokens]
    verify_s = verify_costs(target, sizes)
    depths = range(1, big_depth + 1) if depth == -1 else [depth]
    choice = choose(steps, verify_s, draft_round_s, top_k, depths)
    log.info("tree chosen for %s on %s: top_k %d, depth %d, total_tokens %d (%.1f s: %d calibration steps, "
             "verify ms by size %s)", target.dtype, target.device, choice.top_k, choice.depth, choice.total_tokens,
             time.perf_counter() - t0, len(steps), {n: round(v, 1) for n, v in choice.verify_ms.items()})
    return choice
