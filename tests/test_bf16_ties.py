"""bf16 speculative decoding parts from bf16 vanilla decoding only at numerical ties (tests/support/bf16_ties.py
derives the bound), and the check has teeth: a verifier that emits a draft the target does not rank first
is caught. The exact (token for token) lossless tests stay in fp32 (test_decoder.py)."""
from __future__ import annotations

import pytest
import torch

import pipeline.decoding.decoder as decoder
from tests.support import bf16_ties
from tests.support.bf16_ties import divergences, oracle
from tests.support.tiny import build_tiny_llama


@pytest.fixture(scope="module")
def bf16_model(tiny_tokenizer):
    return build_tiny_llama(len(tiny_tokenizer)).to(dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return bf16_ties.prompts(tiny_tokenizer)


def test_every_bf16_divergence_starts_at_a_tie(bf16_model, prompts):
    rows = divergences(bf16_model, prompts, 96, oracle(bf16_model.config.vocab_size))
    parted = [r for r in rows if not r["identical"]]
    print("\n" + "\n".join(str(r) for r in rows))
    # The trees really accept drafts (multi-token verification forwards). How many prompts part depends on
    # the machine's bf16 kernels (here most do); the broken verifier below shows the check is not vacuous.
    assert all(r["tau"] > 1.0 for r in rows)
    assert all(r["tie"] for r in parted), [r for r in parted if not r["tie"]]


def test_a_broken_verifier_is_caught(bf16_model, prompts, monkeypatch):
    """A verifier that trusts the drafter (accepts its most likely child at every level, unchecked) emits
    tokens the target did not rank first: the sequences part by margins far outside the tie bound."""
    def trusting_verifier(tree, logits):
        path = [0]
        while tree.children[path[-1]]:
            path.append(tree.children[path[-1]][0])
        return path, int(logits[path[-1]].argmax())

    monkeypatch.setattr(decoder, "verify_greedy", trusting_verifier)
    rows = divergences(bf16_model, prompts, 96, oracle(bf16_model.config.vocab_size))
    assert any(not r["identical"] and not r["tie"] for r in rows), rows
