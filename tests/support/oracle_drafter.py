"""A test drafter: the EAGLE-2 tree builder with scripted log-probs along a known greedy continuation, so the
lossless tests control acceptance without a trained head."""
from __future__ import annotations

import random
from typing import Optional, Sequence

import torch

from pipeline.decoding.tree import DraftTree, TreeSpec, build_draft_tree


class OracleDrafter:
    """Test drafter that knows the target's greedy continuation `reference` (prompt + generated ids).

    It drafts through the real EAGLE-2 tree builder with scripted log-probs: on the reference path the
    correct next token gets probability 0.6 and `top_k - 1` wrong tokens share the rest; with probability
    `miss_rate` the correct token is left out, so acceptance stops there. Off the path all candidates are
    wrong. It needs no target states."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, reference: Sequence[int], vocab_size: int, miss_rate: float = 0.1, seed: int = 0):
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.miss_rate = miss_rate
        self.rng = random.Random(seed)

    def start(self, input_ids: torch.Tensor, states: Optional[torch.Tensor], next_token: int) -> None:
        self.seq = input_ids.tolist() + [next_token]

    def accept(self, states: Optional[torch.Tensor], next_tokens: torch.Tensor) -> None:
        self.seq += next_tokens.tolist()

    def _logprobs(self, context: list[int], k: int) -> torch.Tensor:
        n = len(context)
        on_path = n < len(self.reference) and context == self.reference[:n]
        right = self.reference[n] if on_path else None
        wrong = [t for t in self.rng.sample(range(self.vocab_size), k + 1) if t != right][: k - 1 if on_path else k]
        probs = torch.full((self.vocab_size,), 1e-6)
        probs[wrong] = 0.4 / max(len(wrong), 1)
        if on_path:
            probs[right] = 0.6 if self.rng.random() >= self.miss_rate else 0.0
        return probs.log()

    def draft(self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> DraftTree:
        contexts = {"frontier": [self.seq]}

        def expand(tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
            frontier = contexts["frontier"]
            contexts["frontier"] = [frontier[s] + [t] for s, t in zip(parent_slot.tolist(), tokens.tolist())]
            return torch.stack([self._logprobs(c, spec.top_k) for c in contexts["frontier"]])

        return build_draft_tree(self.seq[-1], self._logprobs(self.seq, spec.top_k), expand, spec)
