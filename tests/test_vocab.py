"""Draft vocabulary: most frequent loss-masked (predicted) tokens, d2t/t2d maps, cap and tie-breaking."""
from __future__ import annotations

import logging

import pytest
import torch

from pipeline.heads.vocab import build_draft_vocab, count_predicted_tokens, vocab_from_ids


def samples():
    # (input_ids, loss_mask): only masked positions count. Masked counts: 7:3, 2:2, 9:2, 4:1, 5:1.
    # Token 1 is frequent but never loss-masked, so it must never enter the vocabulary.
    return [
        (torch.tensor([1, 1, 1, 7, 7, 2]), torch.tensor([0, 0, 0, 1, 1, 1])),
        (torch.tensor([1, 9, 7, 2, 9, 4, 5]), torch.tensor([0, 1, 1, 1, 1, 1, 1])),
    ]


def test_counts_only_loss_masked_positions():
    counts = count_predicted_tokens(samples(), vocab_size=12)
    assert counts.tolist() == [0, 0, 2, 0, 1, 1, 0, 3, 0, 2, 0, 0]


def test_top_n_sorted_by_id_with_id_tie_break():
    vocab = build_draft_vocab(samples(), vocab_size=12, draft_vocab_size=4)
    # by count: 7(3), then 2 and 9 (2 each), then 4 and 5 (1 each): the tie at the cut keeps the lower id 4
    assert vocab.target_ids().tolist() == [2, 4, 7, 9]
    assert vocab.d2t.dtype == torch.long and vocab.t2d.dtype == torch.bool
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 4, 7, 9]
    assert vocab.coverage == pytest.approx(8 / 9)
    # deterministic: the same input in another order gives the same vocabulary
    again = build_draft_vocab(list(reversed(samples())), vocab_size=12, draft_vocab_size=4)
    assert torch.equal(again.d2t, vocab.d2t)


def test_d2t_t2d_round_trip():
    ids = torch.tensor([3, 17, 0, 42, 8])
    d2t, t2d = vocab_from_ids(ids, vocab_size=50)
    draft = torch.arange(5)
    target = draft + d2t[draft]
    assert target.tolist() == sorted(ids.tolist())
    assert bool(t2d[target].all()) and int(t2d.sum()) == 5
    # inverse: a target id in the vocabulary maps back to its draft id by rank among kept ids
    assert torch.equal(torch.cumsum(t2d.long(), 0)[target] - 1, draft)


def test_cap_at_distinct_tokens(caplog):
    with caplog.at_level(logging.INFO, logger="pipeline.heads.vocab"):
        vocab = build_draft_vocab(samples(), vocab_size=12, draft_vocab_size=100)
    assert vocab.size == 5 and vocab.target_ids().tolist() == [2, 4, 5, 7, 9]
    assert vocab.coverage == pytest.approx(1.0)
    assert any("capped at 5" in r.getMessage() for r in caplog.records)


def test_no_masked_tokens_is_an_error():
    with pytest.raises(ValueError):
        build_draft_vocab([(torch.tensor([1, 2]), torch.tensor([0, 0]))], vocab_size=4, draft_vocab_size=2)
