"""EAGLE-2 dynamic draft trees: construction from a drafter's log-probabilities, and the tensors a target
needs to verify one (ancestor attention mask, position ids, root-to-leaf paths).

Node 0 is the root: the last token already emitted but not yet in the target's KV cache. Nodes are stored
in creation order, so every parent precedes its children (a topological order) and siblings appear in
decreasing draft probability: the order verification tries them in.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 tree shape (the names and meaning of EAGLE's `top_k`, `depth`, `total_token`).

    Round 0 takes the `top_k` best children of the root; then `depth` expansion rounds each run the drafter
    over the `top_k` frontier nodes, so draft paths hold up to `depth + 1` tokens. The final tree keeps the
    `total_tokens - 1` best nodes plus the root. `top_k = 1` is a chain."""

    top_k: int = 10
    depth: int = 6
    total_tokens: int = 60

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 0 or self.total_tokens < 2:
            raise ValueError(f"invalid tree spec {self}: need top_k >= 1, depth >= 0, total_tokens >= 2")


DEFAULT_TREE = TreeSpec()  # EAGLE-2's 10 x 6 x 60


@dataclass
class DraftTree:
    """tokens: target ids [N] (node 0 = root); parents: parent node of each node (-1 for the root).

    scores: optional [N] cumulative draft log-probs (root 0), the EAGLE-2 ranking key.
    proposal: optional [N, V] float, row u = the distribution the children of u were *sampled* from (one
    draw per child, without replacement). None means children were picked deterministically (top-k), i.e.
    each child's proposal is a point mass on itself; see verify.py for why both are exact."""

    tokens: torch.Tensor
    parents: list[int]
    scores: Optional[torch.Tensor] = None
    proposal: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError("parents must be topological: parents[0] == -1 and parents[i] < i")

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def token_list(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def depths(self) -> list[int]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    @cached_property
    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in range(len(self))]
        for i in range(1, len(self)):
            children[self.parents[i]].append(i)
        return children

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists (EAGLE's retrieve indices, unpadded), leaves in node order."""
        out = []
        for leaf in (i for i, c in enumerate(self.children) if not c):
            path = [leaf]
            while path[-1] != 0:
                path.append(self.parents[path[-1]])
            out.append(path[::-1])
        return out

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [N, N]: entry (i, j) is True when j is i or an ancestor of i."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool, device=device)
        parents = torch.tensor(self.parents, device=device)
        depths = torch.tensor(self.depths, device=device)
        for d in range(1, max(self.depths) + 1):  # a node's row is its parent's row plus itself
            rows = (depths == d).nonzero().squeeze(1)
            mask[rows] |= mask[parents[rows]]
        return mask

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, N]: a node sits at the position after its ancestors, prefix_len + depth."""
        return (prefix_len + torch.tensor(self.depths, device=device))[None]

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device: torch.device | str,
                       sliding_window: Optional[int] = None) -> torch.Tensor:
        """Additive float mask [1, 1, N, prefix_len + N] for an HF target whose KV cache holds the prefix:
        0 where a node may attend (the whole prefix, its ancestors, itself), dtype-min elsewhere. With a
        `sliding_window` W, a node at position p also sees only keys at positions > p - W (HF's sliding
        window: the W most recent positions, itself included), as a sliding-window layer would in one-token
        decoding.

        Additive rather than bool: a 4D mask reaches the attention kernel untouched (masking_utils returns
        it as is), and eager attention *adds* it to the scores while SDPA accepts both; so one float mask is
        exact on both paths. Masked scores underflow to exactly 0 after the softmax's max-subtraction."""
        allowed = torch.cat([
            torch.ones(len(self), prefix_len, dtype=torch.bool, device=device),
            self.ancestor_mask(device),
        ], dim=1)  # [N, prefix_len + N]
        if sliding_window is not None:
            query_pos = self.position_ids(prefix_len, device)[0]  # [N]
            key_pos = torch.cat([torch.arange(prefix_len, device=device), query_pos])  # [prefix_len + N]
            allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]


# expand(frontier target ids [F], parent_slot [F]) -> log-probs over the target vocabulary [F, V].
# parent_slot[j] is the row, in the previous expand call's frontier, of frontier node j's parent (for the
# first call: 0, the root). A drafter uses it to pick the hidden state and attention row each node extends.
ExpandFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rank(scores: torch.Tensor) -> torch.Tensor:
    """Indices by decreasing score, ties broken by lower index. A child's cumulative log-prob never exceeds
    its parent's (adding a log-prob <= 0 rounds monotonically) and parents have lower indices, so any
    prefix of this ranking is closed under taking ancestors."""
    return torch.sort(scores, descending=True, stable=True).indices


def build_draft_tree(
    root_token: int,
    root_logprobs: torch.Tensor,
    expand: ExpandFn,
    spec: TreeSpec,
    generator: Optional[torch.Generator] = None,
) -> DraftTree:
    """EAGLE-2 dynamic tree (SafeAILab/EAGLE `topK_genrate`): scores are cumulative draft log-probs; each
    round expands the `top_k` best nodes of the previous round, and the tree keeps the best
    `total_tokens - 1` of all candidates.

    With a `generator` (sampling at temperature > 0, chain only) each child is *sampled* from the drafter's
    distribution instead of taken as its argmax, and the tree records those distributions as `proposal`,
    so verification can use the classic min(1, p/q) rule. Sampled trees are limited to chains because
    EAGLE-2's score-based pruning would make which sampled children survive depend on their values,
    breaking the exactness of that rule."""
    k = spec.top_k
    if generator is not None and k != 1:
        raise ValueError("sampled drafting is exact only for chains (top_k=1); use top-k trees otherwise")
    device = root_logprobs.device
    proposals: list[torch.Tensor] = []

    def pick(logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logprobs [F, V] -> (scores [F, k], tokens [F, k]) of each row's children."""
        if generator is None:
            return torch.topk(logprobs, k, dim=-1)
        probs = logprobs.float().exp()
        proposals.append(probs)
        tokens = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        return logprobs.gather(-1, tokens), tokens

    root_scores, root_children = pick(root_logprobs[None].float())
    # Candidates in creation order: node ids 1.. (0 is the root, score 0).
    tokens, parents, scores = [root_children[0]], [torch.zeros(k, dtype=torch.long, device=device)], [root_scores[0]]
    frontier_ids = torch.arange(1, k + 1, device=device)
    frontier_scores, frontier_tokens = root_scores[0], root_children[0]
    parent_slot = torch.zeros(k, dtype=torch.long, device=device)
    next_id = k + 1
    for _ in range(spec.depth):
        child_scores, child_tokens = pick(expand(frontier_tokens, parent_slot).float())  # [k, k] each
        cumulative = (frontier_scores[:, None] + child_scores).flatten()  # [k*k], row-major by parent slot
        tokens.append(child_tokens.flatten())
        parents.append(frontier_ids.repeat_interleave(k))
        scores.append(cumulative)
        best = _rank(cumulative)[:k]
        parent_slot = best // k
        frontier_ids = next_id + best
        frontier_scores, frontier_tokens = cumulative[best], child_tokens.flatten()[best]
        next_id += k * k

    all_tokens, all_parents, all_scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)
    keep = _rank(all_scores)[: spec.total_tokens - 1].sort().values  # candidate rows, creation order
    # Renumber: candidate row r is node id r + 1; kept node i (1-based) takes the i-th kept row.
    new_id = torch.full((len(all_scores) + 1,), -1, dtype=torch.long, device=device)
    new_id[0] = 0
    new_id[keep + 1] = torch.arange(1, len(keep) + 1, device=device)
    kept_parents = new_id[all_parents[keep]]
    assert bool((kept_parents >= 0).all()), "pruned tree lost an ancestor"
    tree_tokens = torch.cat([torch.tensor([root_token], device=device), all_tokens[keep]])
    proposal = None
    if generator is not None:  # chain: node d's children were drawn from proposals[d]
        n = len(keep) + 1
        proposal = torch.zeros(n, root_logprobs.shape[-1], device=device)
        rows = torch.cat(proposals)[: n]
        proposal[: len(rows)] = rows
    tree_scores = torch.cat([all_scores.new_zeros(1), all_scores[keep]])
    return DraftTree(tokens=tree_tokens, parents=[-1] + kept_parents.tolist(), scores=tree_scores, proposal=proposal)
