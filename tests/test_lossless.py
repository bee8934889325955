"""Greedy tree speculative decoding is lossless: token for token what HF `generate` produces."""
from __future__ import annotations

import pytest
import torch

from pipeline.decoding.decoder import generate, vanilla_generate
from pipeline.decoding.drafter import EagleDrafter
from pipeline.decoding.tree import TreeSpec
from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from tests.support.decoding import QUESTIONS, chat_ids, hf_greedy
from tests.support.oracle_drafter import OracleDrafter

N_NEW = 256


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def references(tiny_model, tiny_tokenizer):
    """(prompt, HF greedy continuation of N_NEW tokens with EOS disabled) per question."""
    torch.set_num_threads(1)
    prompts = [chat_ids(tiny_tokenizer, q) for q in QUESTIONS]
    return [(p, hf_greedy(tiny_model, p, N_NEW)) for p in prompts]


@pytest.mark.parametrize("case", range(len(QUESTIONS)))
def test_tree_decoding_equals_hf_generate(tiny_model, references, case):
    prompt, expected = references[case]
    drafter = OracleDrafter(prompt.tolist() + expected, tiny_model.config.vocab_size, miss_rate=0.1, seed=case)
    result = generate(tiny_model, drafter, prompt, N_NEW, tree=TreeSpec(10, 6, 60), eos_token_ids=())
    assert result.tokens == expected
    mean_accepted = sum(result.accept_lengths) / len(result.accept_lengths)
    assert mean_accepted >= 3, result.accept_lengths
    assert result.n_target_forwards == len(result.accept_lengths) < N_NEW / 4
    assert result.tau == pytest.approx(mean_accepted + 1)
    assert max(result.accept_lengths) <= 7  # depth + 1 draft tokens at most
    assert len(result.acceptance_by_depth()) == max(result.accept_lengths)  # a level per accepted depth
    assert all(0 <= a <= 1 for a in result.acceptance_by_depth())


@pytest.mark.parametrize("top_k,depth,total_tokens", [(1, 5, 7), (1, 3, 3), (2, 4, 9)])
def test_chains_and_small_trees_are_lossless(tiny_model, references, top_k, depth, total_tokens):
    prompt, expected = references[0]
    drafter = OracleDrafter(prompt.tolist() + expected, tiny_model.config.vocab_size, miss_rate=0.2)
    result = generate(tiny_model, drafter, prompt, N_NEW, tree=TreeSpec(top_k, depth, total_tokens),
                      eos_token_ids=())
    assert result.tokens == expected
    assert max(result.accept_lengths) <= min(depth + 1, total_tokens - 1)
    assert sum(result.accept_lengths) > len(result.accept_lengths)  # drafts were accepted


def test_vanilla_generate_equals_hf_generate(tiny_model, references):
    prompt, expected = references[1]
    result = vanilla_generate(tiny_model, prompt, N_NEW, eos_token_ids=())
    assert result.tokens == expected
    assert result.n_target_forwards == N_NEW - 1  # the first token comes from the prefill


def test_stops_exactly_at_eos_and_at_max_new_tokens(tiny_model, references):
    prompt, expected = references[2]
    reference = prompt.tolist() + expected
    # EOS: a token first seen mid-way through the continuation; everything after it must be dropped, even
    # tokens accepted in the same verification step.
    eos_at = next(i for i in range(20, N_NEW) if expected[i] not in expected[:i])
    eos = expected[eos_at]
    result = generate(tiny_model, OracleDrafter(reference, 384, miss_rate=0.0), prompt, N_NEW, eos_token_ids=[eos])
    assert result.tokens == expected[: eos_at + 1] == hf_greedy(tiny_model, prompt, N_NEW, eos=eos)
    assert vanilla_generate(tiny_model, prompt, N_NEW, eos_token_ids=[eos]).tokens == result.tokens
    for limit in (1, 2, 37):
        result = generate(tiny_model, OracleDrafter(reference, 384, miss_rate=0.0), prompt, limit, eos_token_ids=())
        assert result.tokens == expected[:limit]


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_eagle_drafter_is_lossless(tiny_model, references, kind):
    """A randomly initialized head drafts garbage; the output must still be the target's own."""
    prompt, expected = references[1]
    cfg = DraftHeadConfig.from_target(tiny_model.config, kind, draft_vocab_size=None if kind == "eagle1" else 200,
                                      aux_layer_ids=None)
    torch.manual_seed(0)
    head = build_draft_head(cfg).eval()
    head.copy_from_target(tiny_model)
    result = generate(tiny_model, EagleDrafter(head), prompt, 64, tree=TreeSpec(4, 3, 16),
                      eos_token_ids=())
    assert result.tokens == expected[:64]
    assert result.draft_time > 0 and result.target_time > 0


@pytest.mark.slow
def test_tree_decoding_equals_hf_generate_on_smollm2(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompt = chat_ids(tokenizer, "Write a long story about a lighthouse keeper and a storm.").to(smollm2.device)
    expected = hf_greedy(model, prompt, N_NEW)
    drafter = OracleDrafter(prompt.tolist() + expected, model.config.vocab_size, miss_rate=0.1)
    result = generate(model, drafter, prompt, N_NEW, eos_token_ids=())
    assert result.tokens == expected
    assert sum(result.accept_lengths) / len(result.accept_lengths) >= 3


def test_row_logits_equal_the_full_lm_head(tiny_model, references):
    """Verification reads lm_head rows lazily (RowLogits); each row equals the forward's own logits."""
    from pipeline.decoding.decoder import RowLogits, _new_cache, supports_row_logits, target_forward

    assert supports_row_logits(tiny_model)
    prompt, _ = references[1]
    prompt = prompt.to(tiny_model.device)
    full, states = target_forward(tiny_model, prompt[None], _new_cache(tiny_model), (1, -1))
    lazy, lazy_states = target_forward(tiny_model, prompt[None], _new_cache(tiny_model), (1, -1), row_logits=True)
    assert isinstance(lazy, RowLogits) and len(lazy) == len(prompt) and not lazy.rows
    torch.testing.assert_close(lazy_states, states)
    for node in (0, 5, len(prompt) - 1):
        torch.testing.assert_close(lazy[node], full[node], rtol=1e-5, atol=1e-5)
    assert sorted(lazy.rows) == [0, 5, len(prompt) - 1]  # only the rows asked for were computed
