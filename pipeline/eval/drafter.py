"""Drafters: what the tree decoder asks for a draft tree after each verification.

Protocol (batch size 1). The decoder feeds the drafter (target state at position t, token t+1) pairs:
  start(input_ids [n], states [n, F] | None, next_token)   prefill: states of the prompt positions and the
                                                            first generated token
  accept(states [m, F] | None, next_tokens [m])            after a verification: states of the accepted
                                                            nodes (root first) and the tokens that follow
                                                            each (the accepted drafts, then the bonus)
  draft(spec, temperature, generator) -> DraftTree          tree rooted at the last token fed in

`feature_layers` says which target hidden states make up `states` (concatenated along the feature axis):
input-to-layer ids as in docs/design.md, -1 = the final feature (after the target's final norm).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from pipeline.heads import head_spec
from pipeline.heads.layers import KVCache

from .tree import DraftTree, TreeSpec, build_draft_tree


class Drafter(Protocol):
    feature_layers: tuple[int, ...]

    def start(self, input_ids: torch.Tensor, states: Optional[torch.Tensor], next_token: int) -> None: ...

    def accept(self, states: Optional[torch.Tensor], next_tokens: torch.Tensor) -> None: ...

    def draft(
        self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None
    ) -> DraftTree: ...


def _sampled_chain(spec: TreeSpec, temperature: float, generator: Optional[torch.Generator]):
    """Chains at temperature > 0 are sampled from the drafter (classic speculative sampling); trees are
    always top-k (EAGLE-2), see tree.build_draft_tree."""
    return generator if temperature > 0 and spec.top_k == 1 else None


class EagleDrafter:
    """An eaglet draft head (pipeline/heads) as a drafter.

    The head keeps its own KV cache over the accepted sequence, extended by `accept` with the true target
    states; each `draft` appends the speculative frontier entries on top and crops them away at the end."""

    def __init__(self, head: torch.nn.Module):
        self.head = head.eval()
        c = head.config
        # EAGLE-3 fuses the residual stream entering the aux layers; EAGLE-1 reads the final feature.
        self.feature_layers = tuple(c.aux_layer_ids) if head_spec(c.kind).fuses_target_layers else (-1,)
        self.param = next(head.parameters())
        # Draft-vocabulary id -> target id, or None when the vocabularies coincide.
        ids = torch.arange(c.draft_vocab_size, device=self.param.device)
        mapped = head.draft_to_target(ids)
        self.draft_to_target = None if c.draft_vocab_size == c.vocab_size and bool((mapped == ids).all()) else mapped

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, states: Optional[torch.Tensor], next_token: int) -> None:
        self.cache = KVCache(1)
        next_tokens = torch.cat([input_ids[1:], input_ids.new_tensor([next_token])])
        self.accept(states, next_tokens)

    @torch.no_grad()
    def accept(self, states: Optional[torch.Tensor], next_tokens: torch.Tensor) -> None:
        device = self.param.device
        n_seen, m = self.cache.length, len(next_tokens)
        hidden = self.head.fuse(states[None].to(device))  # [1, m, H]
        positions = torch.arange(n_seen, n_seen + m, device=device)[None]
        out_hidden, logits = self.head(hidden, next_tokens[None].to(device), positions, cache=self.cache)
        # The last pair's output predicts the children of the next tree's root.
        self.root_hidden, self.root_logits = out_hidden[0, -1:], logits[0, -1]
        self.root_token = int(next_tokens[-1])

    def _target_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Draft logits [..., V_draft] -> log-probs over the target vocabulary [..., V] (-inf off the draft vocab).
        Top-k trees rank by the plain softmax (as EAGLE); sampled chains draw from the softmax at T."""
        logprobs = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
        if self.draft_to_target is None:
            return logprobs
        full = logprobs.new_full((*logprobs.shape[:-1], self.head.config.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = logprobs
        return full

    @torch.no_grad()
    def draft(self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> DraftTree:
        device = self.param.device
        n_seen = self.cache.length
        sampled = _sampled_chain(spec, temperature, generator)
        temp = temperature if sampled is not None else 0.0
        # Per expansion round: the head outputs the next frontier continues, and each node's visibility row
        # over the speculative cache entries (one entry per frontier node per round, in slot order).
        prev_hidden, prev_mask, round_ = self.root_hidden, torch.zeros(1, 0, dtype=torch.bool, device=device), 0

        def expand(tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
            nonlocal prev_hidden, prev_mask, round_
            f = len(tokens)
            hidden = prev_hidden[parent_slot]  # [F, H]: each node continues its parent's output
            # A frontier node sees the accepted prefix, its ancestors among the speculative entries, itself.
            spec_mask = torch.cat([prev_mask[parent_slot], torch.eye(f, dtype=torch.bool, device=device)], dim=1)
            mask = torch.cat([torch.ones(f, n_seen, dtype=torch.bool, device=device), spec_mask], dim=1)
            # Pair (state of token t, token t+1) sits at position t: depth-d nodes at n_seen + d - 1.
            positions = torch.full((1, f), n_seen + round_, device=device)
            out_hidden, logits = self.head(
                hidden[None], tokens[None], positions, cache=self.cache, attn_mask=mask[None, None])
            prev_hidden, prev_mask, round_ = out_hidden[0], spec_mask, round_ + 1
            return self._target_logprobs(logits[0], temp)

        root_logprobs = self._target_logprobs(self.root_logits, temp)
        try:
            return build_draft_tree(self.root_token, root_logprobs, expand, spec, sampled)
        finally:
            self.cache.crop(n_seen)  # drop the speculative entries: the cache holds the accepted prefix only
