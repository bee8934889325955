"""Prompt lookup (pipeline/decoding/lookup.py), the training-free baseline: what it drafts (the continuations of the
longest matching suffix n-gram, merged into a trie), that greedy decoding with it equals HF greedy decoding
token for token, and the eval stage running it without a trained head. Its trees carry no proposal (drafts
are deterministic), so sampling verifies them by the path test_sampling.py's top-k trees check."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.decoding.decoder import generate
from pipeline.decoding.lookup import PromptLookupDrafter
from pipeline.decoding.tree import TreeSpec
from pipeline.run import run_stages
from tests.support.config import compose_cfg
from tests.support.decoding import QUESTIONS, chat_ids, hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")


def drafter_on(context: list[int], **kw) -> PromptLookupDrafter:
    d = PromptLookupDrafter(**kw)
    d.start(torch.tensor(context[:-1]), None, context[-1])
    return d


def test_the_longest_suffix_match_wins_and_its_occurrences_come_newest_first():
    # Suffix 3-gram [1, 2, 3] occurs at 4 (then 5, 1, 2) and at 0 (then 4, 1, 2); the 1-gram [3] has more.
    d = drafter_on([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    assert d.continuations(top_k=4, length=3) == [[5, 1, 2], [4, 1, 2]]
    assert d.continuations(top_k=1, length=2) == [[5, 1]]
    assert drafter_on([9, 8, 7]).continuations(4, 3) == []  # nothing repeats: no draft
    assert drafter_on([1, 2, 3, 1, 2, 3], min_ngram=1, max_ngram=1).continuations(4, 2) == [[1, 2]]


def test_continuations_merge_into_a_trie_capped_at_total_tokens():
    # [1, 2] was followed by 5 7 1 (newest) and 5 6 1: one node for the shared 5, siblings newest first.
    d = drafter_on([1, 2, 5, 6, 1, 2, 5, 7, 1, 2])
    tree = d.draft(TreeSpec(top_k=4, depth=2, total_tokens=60))
    assert tree.token_list == [2, 5, 7, 1, 6, 1] and tree.parents == [-1, 0, 1, 2, 1, 4]
    capped = d.draft(TreeSpec(top_k=4, depth=2, total_tokens=4))
    assert capped.token_list == [2, 5, 7, 1] and capped.parents == [-1, 0, 1, 2]
    assert drafter_on([9, 8, 7]).draft(TreeSpec()).token_list == [7]  # the root alone: a plain decoding step


@pytest.mark.parametrize("top_k", [1, 4])
def test_greedy_prompt_lookup_equals_hf_generate(tiny_model, tiny_tokenizer, top_k):
    accepted = 0
    for q in QUESTIONS:
        prompt = chat_ids(tiny_tokenizer, q)
        expected = hf_greedy(tiny_model, prompt, 48)
        result = generate(tiny_model, PromptLookupDrafter(), prompt, 48, tree=TreeSpec(top_k, 5, 20),
                          eos_token_ids=())
        assert result.tokens == expected
        accepted += sum(result.accept_lengths)
    assert accepted > 0  # drafts were accepted: verification of the looked-up paths is exercised


def test_eval_stage_runs_prompt_lookup_without_a_head(tiny_model_dir, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [q]})
                                   for i, q in enumerate(QUESTIONS[:2])) + "\n")
    cfg = compose_cfg(["stage=eval", "experiment=demo", f"output_root={tmp_path}", "target=hf",
                       f"target.path={tiny_model_dir}", "target.name=tiny", "eval.drafter=prompt_lookup",
                       f"eval.questions={questions}", "eval.max_new_tokens=24", "wandb.mode=disabled"])
    run_stages(cfg)
    runs = list((tmp_path / cfg.name / "eval" / "prompt_lookup").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("-ngram1to3")
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["head"]["kind"] == "prompt_lookup" and summary["greedy_matches_baseline"] == "2/2"
    assert json.loads((runs[0] / "manifest.json").read_text())["inputs"] == []
    assert not (tmp_path / cfg.name / "train").exists()


def test_a_smaller_lookup_tree_accepts_what_the_tree_choice_simulates():
    # tree.total_tokens=-1 calibrates with one big tree and derives every smaller one (autotree.py): for prompt
    # lookup that holds when a smaller tree is the first-inserted part of the big one. Contexts with many
    # repeats (a small alphabet) give tries with shared prefixes, distinct long continuations and full trees.
    from pipeline.decoding.autotree import StepRecord, subtree_accepted

    rng = torch.Generator().manual_seed(0)
    big, checked = TreeSpec(top_k=6, depth=7, total_tokens=24), 0
    for trial in range(40):
        context = torch.randint(0, 3 + trial % 4, (80,), generator=rng).tolist()
        truth = torch.randint(0, 3 + trial % 4, (big.depth + 1,), generator=rng).tolist()
        tree = drafter_on(context).draft(big)
        path = [0]
        for tok in truth:  # the big tree's accepted path: the longest one spelling the target's continuation
            nxt = next((c for c in tree.children[path[-1]] if tree.token_list[c] == tok), None)
            if nxt is None:
                break
            path.append(nxt)
        step = StepRecord(tree.scores.tolist(), tree.depths, path, big.total_tokens - 1, big.top_k)
        for depth in range(0, big.depth + 1):
            for total in (2, 3, 5, 8, 13, 24):
                sim = subtree_accepted(step, depth, total)
                if sim is None:
                    continue
                small = drafter_on(context).draft(TreeSpec(big.top_k, depth, total))
                node, accepted = 0, 0
                for tok in truth:
                    node = next((c for c in small.children[node] if small.token_list[c] == tok), None)
                    if node is None:
                        break
                    accepted += 1
                assert sim == accepted, (trial, depth, total)
                checked += 1
    assert checked > 500
