"""Acceptance rules: which root-to-node path of a draft tree the target accepts, and the bonus token after it.

Greedy: follow the children equal to the target's argmax; the bonus is the argmax at the last accepted node.
Output equals plain greedy decoding token for token.

Sampling: multi-candidate speculative sampling (SpecInfer; EAGLE `evaluate_posterior`). At an accepted node
with target distribution p, try its children x_1, x_2, ... in order, each drawn from a proposal q_i:
accept x_i with probability min(1, p(x_i) / q_i(x_i)); on rejection set p <- norm(max(p - q_i, 0)) and
q_{i+1} <- q_i without x_i, renormalized; when every child is rejected, the bonus is sampled from p.

Why this is exact: a single round is standard speculative sampling, so if x_i ~ q_i its output is a token
with distribution p when accepted, and otherwise the rejection leaves exactly the residual norm(max(p - q_i,
0)) to be sampled. The next round does not sample that residual directly but runs the same exact procedure
against it, with a proposal q_{i+1} that is the true law of x_{i+1} given the earlier (rejected) draws. By
induction over siblings the emitted token has law p, and by induction over depth so has every token, given
the tree was drafted without looking at the verifier's coins. Two kinds of proposal keep x_i ~ q_i true:
  * children sampled without replacement from the drafter's q (DraftTree.proposal; chains only, see tree.py);
  * children picked deterministically (EAGLE-2 top-k trees): the law of x_i is a point mass on x_i, so the
    rule becomes "accept with probability p(x_i), else zero p(x_i) and renormalize". This is what the
    official EAGLE-2/3 code does (qx = 1.0). Using the drafter's softmax as q for top-k picked children
    would NOT be exact: top-k children are not draws from that q.
"""
from __future__ import annotations

from typing import Optional

import torch

from .tree import DraftTree


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Target sampling distribution [..., V] (fp32): softmax(logits / T), optionally nucleus-filtered
    (the smallest set of top tokens whose mass reaches top_p, as HF's TopPLogitsWarper)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens strictly above it already reach top_p (the top token always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a (possibly unnormalized) distribution [V], using a CPU generator."""
    return int(torch.multinomial(probs.to("cpu", torch.float64), 1, generator=generator))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What is left of p after a rejected draw from q: norm(max(p - q, 0))."""
    r = (p - q).clamp_min_(0.0)
    return r / r.sum()


def verify_greedy(tree: DraftTree, logits) -> tuple[list[int], int]:
    """logits [N, V] of the tree's nodes (a tensor, or RowLogits: only the rows on the path are read)
    -> (accepted path of node ids starting at the root, bonus token)."""
    path = [0]
    while True:
        target = int(logits[path[-1]].argmax())
        nxt = next((c for c in tree.children[path[-1]] if tree.token_list[c] == target), None)
        if nxt is None:
            return path, target
        path.append(nxt)


def verify_sampling(
    tree: DraftTree,
    logits,
    temperature: float,
    generator: torch.Generator,
    top_p: float = 1.0,
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over the tree (module docstring). logits [N, V] (tensor or
    RowLogits)."""
    path = [0]
    while True:
        node = path[-1]
        # fp64 on CPU: the residual arithmetic and the coin flips stay exact and device independent.
        p = logits_to_probs(logits[node], temperature, top_p).to("cpu", torch.float64)
        q: Optional[torch.Tensor] = None
        if tree.proposal is not None:
            q = tree.proposal[node].to("cpu", torch.float64)
        accepted = None
        for child in tree.children[node]:
            x = tree.token_list[child]
            qx = 1.0 if q is None else float(q[x])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * qx < float(p[x]):
                accepted = child
                break
            if q is None:  # point-mass proposal on x
                point = torch.zeros_like(p)
                point[x] = 1.0
                p = residual(p, point)
            else:
                p = residual(p, q)
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum()
        if accepted is None:
            return path, sample(p, generator)
        path.append(accepted)
