"""Medusa-1 heads (pipeline/heads/medusa.py), the EAGLE papers' baseline: the loss reads the right tokens, the
heads train on a dump through the train stage, the Medusa tree is what the drafter says, decoding with it is
lossless, and export says it has no serving format."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pipeline.decoding.decoder import generate
from pipeline.decoding.drafter import MedusaDrafter, make_drafter
from pipeline.decoding.tree import TreeSpec
from pipeline.export.formats.base import ExportError, format_for_head
from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.io import load_head
from pipeline.heads.medusa import MedusaObjective
from pipeline.heads.vocab import vocab_from_ids
from pipeline.target import load_target
from pipeline.train.run import main as train_main
from tests.support.decoding import QUESTIONS, chat_ids, hf_greedy
from tests.support.tiny_runs import EXPERIMENT, as_config, build_tiny_dump, overrides, train_losses

pytestmark = pytest.mark.usefixtures("single_thread")


def medusa_head(model, heads: int = 3, draft_vocab: int = 120, seed: int = 0):
    cfg = DraftHeadConfig.from_target(model.config, "medusa", draft_vocab, None, medusa_num_heads=heads)
    torch.manual_seed(seed)
    head = build_draft_head(cfg)
    head.copy_from_target(model)
    kept = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    head.set_draft_vocab(*vocab_from_ids(kept, cfg.vocab_size))
    with torch.no_grad():  # non-zero residual blocks, so every head differs from the target's lm_head
        for block in (b for h in head.heads for b in h.blocks):
            block.linear.weight.normal_(0, 0.05)
    return head.eval()


def test_head_i_learns_the_token_i_plus_2_ahead_and_starts_from_the_target_rows(tiny_model):
    head = medusa_head(tiny_model)
    ids = head.draft_to_target(torch.arange(120))
    assert torch.equal(head.heads[2].lm_head.weight, tiny_model.get_output_embeddings().weight[ids])
    t, h = 9, head.config.target_hidden_size
    gen = torch.Generator().manual_seed(1)
    input_ids = ids[torch.randint(0, 120, (1, t), generator=gen)]  # every token inside the draft vocabulary
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    final = torch.randn(1, t, h, generator=gen)
    out = MedusaObjective(head, decay=0.5)(input_ids, loss_mask, torch.ones_like(loss_mask), None, final)
    for i in range(3):
        rows = [s for s in range(t - i - 2) if loss_mask[0, s + i + 2]]  # the predicted token is an answer token
        logits = head.head_logits(i, final[0, rows])
        want = F.cross_entropy(logits, head.target_to_draft(input_ids[0, [s + i + 2 for s in rows]]))
        torch.testing.assert_close(out["round_loss"][i], want)
        assert out["round_total"][i] == len(rows)
    torch.testing.assert_close(out["loss"], sum(0.5**i * out["round_loss"][i] for i in range(3)))


def test_the_tree_is_the_heads_cartesian_product_pruned_by_score(tiny_model):
    head = medusa_head(tiny_model)
    drafter = MedusaDrafter(head)
    state = torch.randn(5, head.config.target_hidden_size)
    drafter.start(torch.arange(5), state, next_token=7)
    tree = drafter.draft(TreeSpec(top_k=3, depth=6, total_tokens=200))
    assert tree.token_list[0] == 7 and max(tree.depths) == 3  # 3 heads: paths at most 3 deep
    second = [{tree.token_list[c] for c in tree.children[n]} for n in tree.children[0]]
    assert len(tree.children[0]) == 3 and all(s == second[0] for s in second)  # head 1's top 3 under each
    assert len(tree) == 1 + 3 + 9 + 9  # round 2 expands the best 3 of the 9 depth-2 nodes


def test_greedy_decoding_with_medusa_heads_is_lossless(tiny_model, tiny_tokenizer):
    head = medusa_head(tiny_model)
    prompt = chat_ids(tiny_tokenizer, QUESTIONS[2])
    result = generate(tiny_model, MedusaDrafter(head), prompt, 32, tree=TreeSpec(3, 2, 10),
                      eos_token_ids=())
    assert result.tokens == hf_greedy(tiny_model, prompt, 32)


def test_the_train_stage_trains_medusa_heads_and_eval_decodes_with_them(tmp_path_factory, tiny_model,
                                                                       tiny_model_dir, shared_data):
    root = build_tiny_dump(tmp_path_factory.mktemp("medusa"), tiny_model_dir, shared_data)
    cfg = as_config(overrides(root, tiny_model_dir, "medusa", "medusa", epochs=3, lr=3e-3, tau_prompts=1,
                              eval_every=7))
    metrics = train_main(cfg)
    train_dir = root / EXPERIMENT / "train" / "medusa"
    losses = train_losses(train_dir)
    assert losses[max(losses)] < 0.8 * losses[1]  # the heads learn the regenerated answers
    assert {"val/acc_0", "val/acc_2", "eval/tau"} <= set(metrics)
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert manifest["head_config"]["kind"] == "medusa" and manifest["head_config"]["medusa_num_heads"] == 4
    head = load_head(train_dir, load_target(cfg.target))
    assert isinstance(make_drafter(head), MedusaDrafter)
    prompt = chat_ids(load_target(cfg.target).tokenizer, QUESTIONS[0])
    result = generate(tiny_model, make_drafter(head), prompt, 24, tree=TreeSpec(4, 3, 16),
                      eos_token_ids=())
    assert result.tokens == hf_greedy(tiny_model, prompt, 24)
    with pytest.raises(ExportError, match="medusa heads have no serving export"):
        format_for_head(None, "medusa")
