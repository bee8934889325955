"""EAGLE-2 tree construction, tree attention masks and the one-forward tree verification on an HF target."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pipeline.decoding.decoder import keep_accepted_kv, target_forward
from pipeline.decoding.drafter import EagleDrafter
from pipeline.decoding.tree import DraftTree, TreeSpec, build_draft_tree
from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from tests.support.tiny import build_tiny_llama

V = 50


pytestmark = pytest.mark.usefixtures("single_thread")


def path_logprobs(path: tuple[int, ...]) -> torch.Tensor:
    """A deterministic pseudo-random draft distribution [V] for each token path below the root."""
    gen = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.log_softmax(2.0 * torch.randn(V, generator=gen), dim=-1)


def path_expand():
    """An ExpandFn backed by path_logprobs, tracking each frontier node's path through parent_slot."""
    frontier = [()]

    def expand(tokens, parent_slot):
        frontier[:] = [frontier[s] + (t,) for s, t in zip(parent_slot.tolist(), tokens.tolist())]
        return torch.stack([path_logprobs(p) for p in frontier])

    return expand


def reference_tree(spec: TreeSpec) -> dict[tuple[int, ...], float]:
    """Plain-Python EAGLE-2 selection: token path -> cumulative score of each kept node."""
    k = spec.top_k
    candidates = []  # (score, creation index, path)

    def children(path, score):
        lp = path_logprobs(path)
        top = torch.topk(lp, k)
        return [(score + float(v), path + (int(t),)) for v, t in zip(top.values, top.indices)]

    def best(items, n):
        return sorted(items, key=lambda c: (-c[0], c[1]))[:n]

    frontier = [(s, len(candidates) + i, p) for i, (s, p) in enumerate(children((), 0.0))]
    candidates += frontier
    for _ in range(spec.depth):
        new = [c for s, _, p in frontier for c in children(p, s)]
        new = [(s, len(candidates) + i, p) for i, (s, p) in enumerate(new)]
        candidates += new
        frontier = best(new, k)
    return {p: s for s, _, p in best(candidates, spec.total_tokens - 1)}


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path below the root of every node."""
    paths = [()]
    for i in range(1, len(tree)):
        paths.append(paths[tree.parents[i]] + (tree.token_list[i],))
    return paths


@pytest.mark.parametrize("spec", [TreeSpec(4, 3, 20), TreeSpec(10, 6, 60), TreeSpec(3, 2, 100), TreeSpec(1, 5, 4)])
def test_build_matches_reference_eagle2_selection(spec):
    tree = build_draft_tree(7, path_logprobs(()), path_expand(), spec)
    expected = reference_tree(spec)
    assert len(tree) == min(spec.total_tokens, 1 + spec.top_k + spec.depth * spec.top_k**2) == len(expected) + 1
    paths = node_paths(tree)
    assert tree.token_list[0] == 7 and tree.parents[0] == -1
    assert set(paths[1:]) == set(expected)
    for path, score in zip(paths[1:], tree.scores[1:].tolist()):
        assert score == pytest.approx(expected[path], abs=1e-5)
    # Topological, siblings in decreasing draft probability, distinct, depth bounded.
    for node, kids in enumerate(tree.children):
        assert all(c > node for c in kids)
        assert tree.scores[kids].tolist() == sorted(tree.scores[kids].tolist(), reverse=True)
        assert len({tree.token_list[c] for c in kids}) == len(kids)
    assert max(tree.depths) <= spec.depth + 1


def test_chain_follows_the_argmax():
    tree = build_draft_tree(3, path_logprobs(()), path_expand(), TreeSpec(top_k=1, depth=4, total_tokens=10))
    assert tree.parents == [-1, 0, 1, 2, 3, 4]
    path = ()
    for token in tree.token_list[1:]:
        assert token == int(path_logprobs(path).argmax())
        path += (token,)


def test_ties_between_parent_and_child_keep_ancestors():
    """A certain draft token (log-prob exactly 0) gives a child the score of its parent; the pruned tree
    must still contain every kept node's parent."""
    certain = torch.full((V,), float("-inf"))
    certain[5] = 0.0
    certain[6] = -3.0
    tree = build_draft_tree(1, certain, lambda tokens, slot: certain.expand(len(tokens), V),
                            TreeSpec(top_k=2, depth=5, total_tokens=5))
    assert tree.token_list == [1, 5, 5, 5, 5]  # the chain of certain tokens, not orphaned deep copies
    assert tree.parents == [-1, 0, 1, 2, 3]


def test_mask_positions_and_paths_of_a_hand_built_tree():
    #      0
    #    1   2
    #   3 4   5
    #   6
    tree = DraftTree(tokens=torch.arange(7), parents=[-1, 0, 0, 1, 1, 2, 3])
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert tree.paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    anc = tree.ancestor_mask()
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, ancestors in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5],
                            6: [0, 1, 3, 6]}.items():
        expected[node, ancestors] = True
    assert torch.equal(anc, expected)
    assert tree.position_ids(10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    mask = tree.attention_mask(3, torch.float32, "cpu")
    assert mask.shape == (1, 1, 7, 10)
    assert (mask[0, 0, :, :3] == 0).all()
    assert torch.equal(mask[0, 0, :, 3:] == 0, expected)
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.arange(3), parents=[-1, 2, 0])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_matches_each_path_run_alone(attn):
    """One forward over the whole tree with the 4D mask = running each root-to-leaf path as a plain
    sequence; and keeping one path's KV leaves the cache a plain forward over that path would build."""
    model = build_tiny_llama(V, seed=1, num_layers=3)
    model.config._attn_implementation = attn
    prompt = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(0))
    tree = build_draft_tree(11, path_logprobs(()), path_expand(), TreeSpec(top_k=3, depth=3, total_tokens=16))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        target_forward(model, prompt, cache)
        n = prompt.shape[1]
        tree_logits, tree_states = target_forward(model, tree.tokens[None], cache, (1, -1), tree.position_ids(n),
                                                  tree.attention_mask(n, torch.float32, "cpu"))
        for path in tree.paths():
            seq = torch.cat([prompt, tree.tokens[path][None]], dim=1)
            out = model(seq, output_hidden_states=True)
            torch.testing.assert_close(tree_logits[path], out.logits[0, n:], atol=1e-4, rtol=1e-4)
            states = torch.cat([out.hidden_states[1], out.hidden_states[-1]], dim=-1)[0, n:]
            torch.testing.assert_close(tree_states[path], states, atol=1e-4, rtol=1e-4)

        path = max(tree.paths(), key=lambda p: (len(p), p[-1]))  # a deep path off the first-child chain
        assert path != list(range(len(path)))
        keep_accepted_kv(cache, n, path)
        plain = DynamicCache(config=model.config)
        model(torch.cat([prompt, tree.tokens[path][None]], dim=1), cache=plain, use_cache=True)
        assert cache.get_seq_length() == plain.get_seq_length() == n + len(path)
        for got, want in zip(cache.layers, plain.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_eagle_drafter_tree_scores_equal_sequential_head_runs(kind):
    """Drafting a tree with the head's tree mask over its KV cache gives every node the cumulative
    log-prob that running the head along that node's path, one token at a time, gives; and the head's
    cache is cropped back to the accepted prefix afterwards."""
    target = build_tiny_llama(V, seed=2, num_layers=4)
    cfg = DraftHeadConfig.from_target(target.config, kind, draft_vocab_size=None if kind == "eagle1" else 40,
                                      aux_layer_ids=None)
    torch.manual_seed(3)
    head = build_draft_head(cfg).eval()
    head.copy_from_target(target)
    if kind == "eagle3":  # a non-trivial draft vocabulary: draft id i -> target id 10 + i
        head.set_draft_vocab(torch.full((40,), 10), torch.arange(V) >= 10)
    drafter = EagleDrafter(head)
    prompt = torch.randint(3, V, (8,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, states = target_forward(target, prompt[None], DynamicCache(config=target.config), drafter.feature_layers)
        drafter.start(prompt, states, next_token=17)
        spec = TreeSpec(top_k=3, depth=3, total_tokens=20)
        tree = drafter.draft(spec)
        assert drafter.cache.length == len(prompt)
        assert len(tree) == 20 and tree.token_list[0] == 17
        if kind == "eagle3":
            assert min(tree.token_list[1:]) >= 10
        for path in tree.paths():
            # Replay: a fresh cache over the accepted pairs, then the path fed back one node at a time.
            replay = EagleDrafter(head)
            replay.start(prompt, states, next_token=17)
            hidden, score = replay.root_hidden, 0.0
            logprobs = replay._target_logprobs(replay.root_logits, 0.0)
            for depth, node in enumerate(path[1:], start=1):
                token = tree.token_list[node]
                score += float(logprobs[token])
                assert tree.scores[node].item() == pytest.approx(score, abs=1e-4)
                position = torch.tensor([[len(prompt) + depth - 1]])
                out, logits = head(hidden[None], torch.tensor([[token]]), position, cache=replay.cache)
                hidden, logprobs = out[0], replay._target_logprobs(logits[0, -1], 0.0)
