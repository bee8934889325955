"""Prompt lookup (n-gram) drafting: the training-free baseline of Spec-Bench and of vLLM's `ngram` method.

The draft is copied from the context itself: the longest suffix n-gram of the tokens so far (prompt and
answer, n from `max_ngram` down to `min_ngram`) is looked up earlier in the context, and what followed its
occurrences is proposed. Where vLLM and transformers' `prompt_lookup_num_tokens` propose one chain (the
continuation of one match), the tree decoder verifies several at once: the continuations of the `top_k`
most recent occurrences, merged into a trie (shared prefixes become one path), each up to `depth + 1`
tokens, at most `total_tokens - 1` nodes. Siblings are ordered most recent first, which is the order
verification tries them in.

The drafts are deterministic (no proposal distribution), so verification is lossless at any temperature
for the same reason as EAGLE-2's top-k trees (verify.py). No target states are needed: `feature_layers`
is empty. Nodes are scored by insertion order, so `tree.total_tokens=-1` chooses a lookup tree too: a tree of
smaller depth or size keeps exactly the first-inserted nodes of a bigger one.
"""
from __future__ import annotations

from typing import Optional

import torch

from .tree import DraftTree, TreeSpec

# Occurrences are told apart by this many following tokens (more than any tree's depth + 1 in practice).
DISTINCT_HORIZON = 16


class PromptLookupDrafter:
    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[int] = []

    def start(self, input_ids: torch.Tensor, states: Optional[torch.Tensor], next_token: int) -> None:
        self.context = [int(t) for t in input_ids.tolist()] + [int(next_token)]

    def accept(self, states: Optional[torch.Tensor], next_tokens: torch.Tensor) -> None:
        self.context.extend(int(t) for t in next_tokens.tolist())

    def continuations(self, top_k: int, length: int) -> list[list[int]]:
        """What followed the `top_k` most recent occurrences of the longest matching suffix n-gram, most recent
        first, each cut to `length` tokens. Occurrences count as distinct by what followed them over
        `DISTINCT_HORIZON` tokens (or `length`, if longer), not over `length`: which occurrences are taken then
        does not depend on the depth, so a shallower tree is exactly a part of a deeper one (autotree.py)."""
        ctx = self.context
        horizon = max(length, DISTINCT_HORIZON)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            seen: list[list[int]] = []
            # Occurrences ending before the suffix itself, newest first; each must be followed by a token.
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == suffix:
                    cont = ctx[start + n:start + n + horizon]
                    if cont not in seen:
                        seen.append(cont)
                    if len(seen) == top_k:
                        break
            if seen:
                return [cont[:length] for cont in seen]
        return []

    def draft(self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> DraftTree:
        tokens, parents = [self.context[-1]], [-1]
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for cont in self.continuations(spec.top_k, spec.depth + 1):
            node = 0
            for tok in cont:
                if (node, tok) not in children:
                    if len(tokens) == spec.total_tokens:
                        break
                    children[(node, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = children[(node, tok)]
        # Scores rank the nodes in insertion order (the root first): the tree of a smaller depth or size is
        # then the best-scored prefix of this one, which is what the tree choice (autotree.py) assumes.
        scores = -torch.arange(len(tokens), dtype=torch.float32)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), parents, scores=scores)
