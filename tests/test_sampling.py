"""Speculative sampling is exact: the joint law of generated tokens 2 and 3 equals the target's, computed by
enumeration on a 32-token vocabulary; and the test has power: a verifier that forgets to renormalize the
residual after a rejection fails it."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache

from pipeline.decoding import verify
from pipeline.decoding.decoder import generate, target_forward
from pipeline.decoding.drafter import EagleDrafter
from pipeline.decoding.tree import DraftTree, TreeSpec, build_draft_tree
from pipeline.decoding.verify import logits_to_probs
from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from tests.support.tiny import build_tiny_llama

V = 32
T = 0.5  # moderately peaked: a few tokens share most of the mass, so siblings are rejected often
PROMPT = [1, 7, 20, 11]
TRIALS = 2000
NOISE = 0.5  # draft logits = target logits / T + NOISE * fixed Gaussian noise: q ranks tokens roughly like p


pytestmark = pytest.mark.usefixtures("single_thread")


class TableDrafter:
    """Drafts from q(. | context) = softmax(target logits / T + fixed noise), looked up in a table of the
    contexts that decide tokens 2 and 3 (prompt + 1 or 2 tokens); deeper contexts get pure noise. Top-k
    trees, or sampled chains (top_k = 1 at temperature > 0) drawn from q."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, table: dict[tuple[int, ...], torch.Tensor]):
        self.table = table

    def logprobs(self, context: list[int]) -> torch.Tensor:
        key = tuple(context)
        if key not in self.table:
            gen = torch.Generator().manual_seed(hash(key) % (2**31))
            self.table[key] = torch.log_softmax(torch.randn(V, generator=gen), dim=-1)
        return self.table[key]

    def start(self, input_ids: torch.Tensor, states, next_token: int) -> None:
        self.seq = input_ids.tolist() + [next_token]

    def accept(self, states, next_tokens: torch.Tensor) -> None:
        self.seq += next_tokens.tolist()

    def draft(self, spec: TreeSpec, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> DraftTree:
        frontier = [self.seq]

        def expand(tokens, parent_slot):
            frontier[:] = [frontier[s] + [t] for s, t in zip(parent_slot.tolist(), tokens.tolist())]
            return torch.stack([self.logprobs(c) for c in frontier])

        sampled = generator if spec.top_k == 1 and temperature > 0 else None
        return build_draft_tree(self.seq[-1], self.logprobs(self.seq), expand, spec, sampled)


@pytest.fixture(scope="module")
def setup():
    """(target, exact joint law [V, V] of tokens 2 and 3, draft table)."""
    model = build_tiny_llama(V, seed=5, num_layers=2)
    prompt = torch.tensor(PROMPT)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        p1 = logits_to_probs(model(prompt[None]).logits[0, -1], T).double()
        ctx2 = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)  # [V, n+1]: prompt, t1
        logits2 = model(ctx2).logits[:, -1]
        ctx3 = torch.cat([ctx2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], dim=1)  # prompt, t1, t2
        logits3 = model(ctx3).logits[:, -1]
    p2 = logits_to_probs(logits2, T).double()  # [t1, t2]
    p3 = logits_to_probs(logits3, T).double().view(V, V, V)  # [t1, t2, t3]
    joint = torch.einsum("a,ab,abc->bc", p1, p2, p3)
    table = {}
    for ctx, logits in [*zip(ctx2.tolist(), logits2), *zip(ctx3.tolist(), logits3)]:
        table[tuple(ctx)] = torch.log_softmax(logits / T + NOISE * torch.randn(V, generator=noise), dim=-1)
    return model, (joint / joint.sum()).numpy(), table


def sample_tokens_2_3(model, table, spec: TreeSpec) -> tuple[np.ndarray, list[int]]:
    """Counts [V, V] of (token 2, token 3) over TRIALS seeded generations, and all accept lengths."""
    counts = np.zeros((V, V))
    accepted = []
    for seed in range(TRIALS):
        result = generate(model, TableDrafter(table), torch.tensor(PROMPT), 3, temperature=T, tree=spec,
                          eos_token_ids=(), seed=seed)
        counts[result.tokens[1], result.tokens[2]] += 1
        accepted += result.accept_lengths
    return counts, accepted


def chi_square_pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    """Pearson chi-square of observed counts against the exact law; cells expecting < 5 are pooled."""
    expected = joint * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    return float(chisquare(observed, expected).pvalue)


TREE = TreeSpec(top_k=4, depth=2, total_tokens=12)
CHAIN = TreeSpec(top_k=1, depth=2, total_tokens=4)


@pytest.mark.parametrize("spec", [TREE, CHAIN], ids=["topk-tree", "sampled-chain"])
def test_sampling_matches_target_joint_law(setup, spec):
    model, joint, table = setup
    counts, accepted = sample_tokens_2_3(model, table, spec)
    accepted = np.array(accepted)
    # Both branches are exercised: drafts accepted, and rejections down to the residual.
    assert 0.1 < (accepted == 0).mean() < 0.9, np.bincount(accepted)
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_verifier_without_residual_renormalisation_fails(setup, monkeypatch):
    model, joint, table = setup
    monkeypatch.setattr(verify, "residual", lambda p, q: (p - q).clamp_min(0.0))
    counts, _ = sample_tokens_2_3(model, table, TREE)
    assert chi_square_pvalue(counts, joint) < 1e-6


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_target_distribution_matches_hf_warpers(top_p):
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    logits = 4.0 * torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    warped = TemperatureLogitsWarper(T)(None, logits)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    torch.testing.assert_close(logits_to_probs(logits, T, top_p), torch.softmax(warped, dim=-1))


def test_eagle_drafter_sampled_chain_and_seeded_reproducibility():
    """At temperature > 0 a chain is sampled from the head's softmax at T, which the tree records as the
    proposal; generation is reproducible for a fixed seed, in chain and tree mode alike."""
    model = build_tiny_llama(V, seed=5, num_layers=2)
    cfg = DraftHeadConfig.from_target(model.config, "eagle3", draft_vocab_size=24, aux_layer_ids=[0, 1, 1])
    torch.manual_seed(0)
    head = build_draft_head(cfg).eval()
    head.copy_from_target(model)
    head.set_draft_vocab(torch.full((24,), 8), torch.arange(V) >= 8)  # draft id i -> target id 8 + i
    drafter = EagleDrafter(head)
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        _, states = target_forward(model, prompt[None], DynamicCache(config=model.config), drafter.feature_layers)
    drafter.start(prompt, states, next_token=3)
    tree = drafter.draft(CHAIN, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert tree.parents == [-1, 0, 1, 2]
    expected_root = torch.zeros(V)
    expected_root[8:] = torch.softmax(drafter.root_logits / 0.7, dim=-1)
    torch.testing.assert_close(tree.proposal[0], expected_root)
    for node in range(1, len(tree)):
        assert tree.proposal[tree.parents[node], tree.token_list[node]] > 0
        assert tree.proposal[tree.parents[node]].sum().item() == pytest.approx(1.0, abs=1e-5)

    for spec in (CHAIN, TREE):
        runs = [generate(model, drafter, prompt, 24, temperature=0.8, tree=spec, eos_token_ids=(), seed=seed).tokens
                for seed in (7, 7, 8)]
        assert runs[0] == runs[1] and len(runs[0]) == 24
        assert runs[0] != runs[2]
