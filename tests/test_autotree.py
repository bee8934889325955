"""Tree size for the hardware (pipeline/decoding/autotree.py): the sub-tree simulation gives exactly the accepted
length a smaller tree would have had at the same step, the choice follows the cost table, and the eval stage
runs with tree.depth=-1 and tree.total_tokens=-1, records the table, and stays lossless."""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Optional

import pytest
import torch

from pipeline.config import WandbConfig
from pipeline.decoding.autotree import StepRecord, calibrate, choose, subtree_accepted
from pipeline.decoding.tree import DraftTree, TreeSpec, build_draft_tree
from pipeline.eval.config import EvalConfig, TreeConfig
from pipeline.manifest import load_manifest
from tests.support.decoding import QUESTIONS, chat_ids, hf_greedy
from tests.support.exports import fake_train_stage, make_head, stage_config

pytestmark = pytest.mark.usefixtures("single_thread")


class ContextDrafter:
    """Log-probs a pure function of the context (seeded by it), with the reference's next token lifted on most
    contexts along the reference: any two trees drafted from one state share their candidates."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, reference: list[int], vocab: int):
        self.reference, self.vocab = reference, vocab

    def start(self, input_ids, states, next_token):
        self.seq = input_ids.tolist() + [next_token]

    def accept(self, states, next_tokens):
        self.seq += next_tokens.tolist()

    def logprobs(self, context: list[int]) -> torch.Tensor:
        rng = random.Random(hash(tuple(context)))
        logits = torch.tensor([rng.gauss(0, 2) for _ in range(self.vocab)])
        n = len(context)
        if n < len(self.reference) and context == self.reference[:n] and rng.random() < 0.8:
            logits[self.reference[n]] = logits.max() + rng.uniform(-1.0, 2.0)  # often, not always, the top one
        return torch.log_softmax(logits, dim=-1)

    def draft(self, spec: TreeSpec, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> DraftTree:
        frontier = [self.seq]

        def expand(tokens, parent_slot):
            frontier[:] = [frontier[s] + [t] for s, t in zip(parent_slot.tolist(), tokens.tolist())]
            return torch.stack([self.logprobs(c) for c in frontier])

        return build_draft_tree(self.seq[-1], self.logprobs(self.seq), expand, spec)


def walk(tree: DraftTree, continuation: list[int]) -> int:
    """Draft tokens greedy verification accepts: the longest tree path spelling the target's continuation."""
    node, n = 0, 0
    for tok in continuation:
        node = next((c for c in tree.children[node] if tree.token_list[c] == tok), None)
        if node is None:
            return n
        n += 1
    return n


def test_every_sub_tree_accepts_what_the_simulation_says(tiny_model, tiny_tokenizer):
    prompt = chat_ids(tiny_tokenizer, QUESTIONS[1])
    expected = hf_greedy(tiny_model, prompt, 40)
    reference = prompt.tolist() + expected
    big = TreeSpec(top_k=4, depth=5, total_tokens=40)
    steps, _ = calibrate(tiny_model, ContextDrafter(reference, tiny_model.config.vocab_size), [prompt], big, 40, ())
    assert sum(len(s.path) - 1 for s in steps) > len(steps)  # drafts are accepted: paths are exercised
    emitted, checked, unknown = 1, 0, 0  # the first generated token comes from the prefill
    for step in steps:
        context = reference[:len(prompt) + emitted]
        emitted += len(step.path)  # accepted drafts + the bonus token
        if len(reference) - len(context) <= big.depth + 1:
            continue  # the token budget cut this step's path short (decoder.generate counts what it emitted)
        for depth in range(1, 6):
            for total in (2, 3, 5, 8, 12, 20, 30, 40):
                sim = subtree_accepted(step, depth, total)
                if sim is None:
                    unknown += 1
                    continue
                drafter = ContextDrafter(reference, tiny_model.config.vocab_size)
                drafter.start(torch.tensor(context[:-1]), None, context[-1])
                small = drafter.draft(TreeSpec(4, depth, total))
                assert sim == walk(small, reference[len(context):]), (emitted, depth, total)
                checked += 1
    assert checked > 10 * unknown


def test_the_choice_follows_the_cost_of_verification():
    # Two steps of a 4-node chain tree accepted to the end: larger trees always accept more.
    chain = StepRecord(scores=[0.0, -0.1, -0.2, -0.3, -0.4, -0.5], depths=[0, 1, 2, 3, 4, 5],
                       path=[0, 1, 2, 3, 4, 5], capacity=5, top_k=1)
    flat = choose([chain] * 2, {2: 0.010, 4: 0.010, 6: 0.010}, 0.0, top_k=1, depths=[5])
    assert (flat.depth, flat.total_tokens) == (5, 6)  # verification costs the same: take the largest
    steep = choose([chain] * 2, {2: 0.010, 4: 0.030, 6: 0.100}, 0.0, top_k=1, depths=[5])
    assert steep.total_tokens == 2  # 2 tokens in 10 ms beat 4 in 30 ms and 6 in 100 ms
    drafty = choose([chain] * 2, {6: 0.010}, 0.020, top_k=1, depths=[1, 5])
    assert drafty.depth == 1  # drafting rounds cost more than they bring: 3 in 70 ms > 6 in 150 ms
    assert {(r["depth"], r["total_tokens"]) for r in drafty.table} == {(1, 6), (5, 6)}


def test_tree_config_takes_minus_one_and_names_it_auto():
    assert TreeConfig(depth=-1, total_tokens=-1).is_auto
    assert TreeConfig(total_tokens=-1).fixed("probe") == TreeSpec(10, 6, 60)
    assert TreeConfig(top_k=4, depth=-1).spec(depth=3) == TreeSpec(4, 3, 60)
    with pytest.raises(ValueError, match="or -1"):
        TreeConfig(total_tokens=-2)


def test_eval_stage_chooses_the_tree_records_it_and_stays_lossless(tiny_model, tiny_model_dir, tmp_path):
    from pipeline.eval.run import main
    from pipeline.eval.subjects import TREE_CHOICE

    cfg = stage_config(tmp_path, tiny_model_dir)
    fake_train_stage(cfg, make_head(tiny_model))
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [q]})
                                   for i, q in enumerate(QUESTIONS[:2])) + "\n")
    cfg = dataclasses.replace(
        cfg, stage="eval", tree=TreeConfig(top_k=3, depth=-1, total_tokens=-1, max_depth=3, max_total_tokens=12,
                                           auto_prompts=1, auto_max_new_tokens=12),
        eval=EvalConfig(questions=str(questions), max_new_tokens=16), wandb=WandbConfig(mode="disabled"))
    summary = main(cfg)
    out = cfg.stage_dir("eval")
    assert out.name.endswith("-tree3xautoxauto")
    choice = summary["tree_choice"]
    assert 1 <= choice["depth"] <= 3 and 2 <= choice["total_tokens"] <= 12
    assert max(choice["table"], key=lambda r: r["tokens_per_s"])["total_tokens"] == choice["total_tokens"]
    assert set(choice["verify_ms"]) == {"2", "4", "6", "8", "10", "12"}
    assert json.loads((out / TREE_CHOICE).read_text()) == choice
    assert summary["greedy_matches_baseline"] == "2/2"


def test_eval_compares_drafters_side_by_side_with_their_own_trees_and_resumes(tiny_model, tiny_model_dir, tmp_path):
    """eval.compare (pipeline/eval/compare.py, the method bench's engine): every drafter decodes the same turns
    as vanilla decoding, each with the tree chosen for it, losslessly in fp32; a rerun continues the journal and
    a rerun with other drafters is refused."""
    from pipeline.eval.run import main

    cfg = stage_config(tmp_path, tiny_model_dir)
    for name, seed in (("a", 0), ("b", 1)):
        fake_train_stage(dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, name=name)),
                         make_head(tiny_model, seed=seed))
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [q, "And then?"]})
                                   for i, q in enumerate(QUESTIONS[:2])) + "\n")
    cfg = dataclasses.replace(
        cfg, stage="eval", tree=TreeConfig(top_k=3, depth=-1, total_tokens=-1, max_depth=2, max_total_tokens=8,
                                           auto_prompts=1, auto_max_new_tokens=8),
        eval=EvalConfig(questions=str(questions), max_new_tokens=12, compare=["prompt_lookup", "a", "b"],
                        time_budget_s=0), wandb=WandbConfig(mode="disabled"))
    out = cfg.stage_dir("eval")
    assert out.parent.name == "compare"
    first = main(cfg)  # the budget ends the run after its first turn
    assert first["turns"] == 1 and set(first["tree_choices"]) == {"prompt_lookup", "a", "b"}
    summary = main(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, time_budget_s=None)))
    journal = [json.loads(line) for line in (out / "turns.jsonl").read_text().splitlines()]
    assert [(t["question_id"], t["turn"]) for t in journal] == [("0", 0), ("1", 0), ("0", 1), ("1", 1)]
    assert summary["turns"] == 4 and summary["turns_by_index"] == {"1": 2, "2": 2}
    for name in ("prompt_lookup", "a", "b"):
        row, tree = summary["rows"][name], summary["tree_choices"][name]
        assert row["identical_to_vanilla"] == "4/4"  # fp32 greedy: lossless whatever the drafter
        assert row["tree"] == {k: tree[k] for k in ("depth", "top_k", "total_tokens")} and tree["depth"] <= 2
        assert row["tau"] == sum(a + 1 for t in journal for a in t[name]["accept_lengths"]) / sum(
            t[name]["forwards"] for t in journal)
    assert summary["rows"]["vanilla"]["speedup"] == 1.0 and "| a | **" in summary["table"]
    assert load_manifest(out)["stage"] == "eval"
    with pytest.raises(ValueError, match="holds a comparison with other compare, drafters"):
        main(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, compare=["a"])))
