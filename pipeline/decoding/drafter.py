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


def target_logprobs(logits: torch.Tensor, temperature: float, draft_to_target: Optional[torch.Tensor],
                    vocab_size: int) -> torch.Tensor:
    """Draft logits [..., V_draft] -> log-probs over the target vocabulary [..., V] (-inf off the draft vocab).
    Top-k trees rank by the plain softmax (as EAGLE); sampled chains draw from the softmax at T."""
    logprobs = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    if draft_to_target is None:
        return logprobs
    full = logprobs.new_full((*logprobs.shape[:-1], vocab_size), float("-inf"))
    full[..., draft_to_target] = logprobs
    return full


def vocab_map(head: torch.nn.Module) -> Optional[torch.Tensor]:
    """Draft-vocabulary id -> target id, or None when the vocabularies coincide."""
    c = head.config
    ids = torch.arange(c.draft_vocab_size, device=next(head.parameters()).device)
    mapped = head.draft_to_target(ids)
    return None if c.draft_vocab_size == c.vocab_size and bool((mapped == ids).all()) else mapped


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
        self.draft_to_target = vocab_map(head)

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
        return target_logprobs(logits, temperature, self.draft_to_target, self.head.config.vocab_size)

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


class MedusaDrafter:
    """Medusa heads (pipeline/heads/medusa.py) as a drafter. From the target's final feature at the last
    accepted position, head i scores the tokens at depth i + 1 below the root; the EAGLE-2 builder then keeps
    each frontier node's top_k children by cumulative score, the same head's distribution for every parent,
    so the tree is Medusa's cartesian product of per-head candidates pruned to the best `total_tokens`.
    Paths are at most K deep (depth is capped at K - 1 expansions)."""

    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, head: torch.nn.Module):
        self.head = head.eval()
        self.param = next(head.parameters())
        self.draft_to_target = vocab_map(head)

    @torch.no_grad()
    def _read(self, state: torch.Tensor, root_token: int) -> None:
        self.logits = [lg[0] for lg in self.head(state[None].to(self.param.device))]  # K x [V_draft]
        self.root_token = root_token

    def start(self, input_ids: torch.Tensor, states: Optional[torch.Tensor], next_token: int) -> None:
        self._read(states[-1], next_token)  # the state at n - 1, whose lm_head gave the root

    def accept(self, states: Optional[torch.Tensor], next_tokens: torch.Tensor) -> None:
        self._read(states[-1], int(next_tokens[-1]))  # the last accepted node's state; the bonus is the root

    @torch.no_grad()
    def draft(self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> DraftTree:
        spec = TreeSpec(spec.top_k, min(spec.depth, len(self.logits) - 1), spec.total_tokens)
        sampled = _sampled_chain(spec, temperature, generator)
        temp = temperature if sampled is not None else 0.0
        vocab = self.head.config.vocab_size
        rows = [target_logprobs(lg, temp, self.draft_to_target, vocab) for lg in self.logits]
        round_ = iter(range(1, len(rows)))

        def expand(tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
            return rows[next(round_)].expand(len(tokens), -1)  # [F, V]: heads ignore the drafted tokens

        return build_draft_tree(self.root_token, rows[0], expand, spec, sampled)


DRAFTERS = {"eagle": EagleDrafter, "medusa": MedusaDrafter}


def make_drafter(head: torch.nn.Module):
    """The drafter of a trained head's kind (HeadSpec.drafter)."""
    return DRAFTERS[head_spec(head.config.kind).drafter](head)


class LockstepDrafter:
    """A drafter on the ranks of a tensor-parallel target (pipeline.dist.TargetLayout): every rank drafts, then the
    group verifies its first rank's tree. The sharded forwards then always get one input on every rank, even where
    a rank's own draft differed by a rounding (its head saw the same states; GPU kernels need not be bitwise
    reproducible); the drafter's state past a verification depends only on the accepted tokens and states, which
    the replicated logits make the same on every rank."""

    def __init__(self, drafter, layout):
        self.drafter, self.layout = drafter, layout
        self.feature_layers = drafter.feature_layers

    def start(self, input_ids: torch.Tensor, states: Optional[torch.Tensor], next_token: int) -> None:
        self.drafter.start(input_ids, states, next_token)

    def accept(self, states: Optional[torch.Tensor], next_tokens: torch.Tensor) -> None:
        self.drafter.accept(states, next_tokens)

    def draft(self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> DraftTree:
        tree = self.drafter.draft(spec, temperature, generator)
        fields = ("tokens", "scores", "proposal")
        device = {f: getattr(tree, f).device for f in fields if getattr(tree, f) is not None}
        cpu = self.layout.agree(DraftTree(*(t.cpu() if torch.is_tensor(t) else t for t in
                                            (tree.tokens, tree.parents, tree.scores, tree.proposal))))
        return DraftTree(cpu.tokens.to(device["tokens"]), cpu.parents,
                         *(None if getattr(cpu, f) is None else getattr(cpu, f).to(device[f]) for f in fields[1:]))


def lockstep(drafter, layout):
    """`drafter` as the ranks of `layout`'s tensor-parallel target run it (itself without TP)."""
    return LockstepDrafter(drafter, layout) if layout is not None and layout.sharded else drafter
