"""Padding of training batches (issue 38): the collate pads on the right, but a left-padded batch must train the
same. EAGLE-1's attention hides pad keys (layers.padded_causal_mask, as EAGLE-3's TTT does) and its positions
count from each row's first real token; Medusa has no attention and pairs each state with the tokens after it
inside its row. Either way a batch gives, per head and per statistic, what its rows give one by one."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.heads import build_draft_head, losses
from pipeline.heads.layers import padded_causal_mask
from pipeline.heads.losses import align_batch, eagle1_loss
from pipeline.heads.medusa import MedusaObjective
from pipeline.heads.vocab import vocab_from_ids
from tests.support.heads import VOCAB, H, make_head, tiny_config

LENGTHS = [9, 6, 4]
T = 9


def rows(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Real rows of LENGTHS: (input_ids [n], loss_mask [n], final_hidden [n,H])."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, VOCAB, (n,), generator=g), (torch.rand(n, generator=g) < 0.8).long(),
             torch.randn(n, H, generator=g)) for n in LENGTHS]


def padded(rows_, side: str):
    """The rows in one batch of length T, padded on `side` (zeros, as collate pads)."""
    b = len(rows_)
    ids, mask, valid = (torch.zeros(b, T, dtype=torch.long) for _ in range(3))
    final = torch.zeros(b, T, H)
    for r, (i, m, f) in enumerate(rows_):
        at = slice(0, len(i)) if side == "right" else slice(T - len(i), T)
        ids[r, at], mask[r, at], valid[r, at], final[r, at] = i, m, 1, f
    return ids, mask, valid, final


def eagle1_stats(head, ids, mask, valid, final) -> dict:
    out = eagle1_loss(head, align_batch(ids, mask, final, final, valid))
    n = out["total"].double()
    return {"feature_sum": out["feature_loss"].double() * n, "token_sum": out["token_loss"].double() * n,
            "correct": out["correct"], "total": out["total"]}


def one_by_one(stats_of, rows_) -> dict:
    """The statistics of each row alone (a batch of one, no padding), summed."""
    each = [stats_of(*(x[None] for x in (i, m, torch.ones_like(m), f))) for i, m, f in rows_]
    return {k: sum(s[k] for s in each) for k in each[0]}


def assert_same(got: dict, want: dict) -> None:
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=1e-5, atol=1e-5, msg=k)


def test_right_padding_needs_no_mask_and_left_padding_gets_one():
    right, left = padded(rows(), "right")[2], padded(rows(), "left")[2]
    assert padded_causal_mask(right) is None  # causal attention is exact: SDPA's fused causal kernel stays
    mask = padded_causal_mask(left)[:, 0]
    for r, n in enumerate(LENGTHS):
        pads = T - n
        assert not mask[r, pads:, :pads].any()  # no real query sees a pad key
        assert torch.equal(mask[r, pads:, pads:], torch.ones(n, n, dtype=torch.bool).tril())
        assert mask[r].diagonal().all()  # a pad query keeps its own key: no empty softmax row


@pytest.mark.parametrize("side", ["right", "left"])
def test_eagle1_trains_a_padded_batch_as_its_rows_one_by_one(side):
    head = make_head("eagle1").eval()  # eval: no feature noise, so the rows are comparable
    data = rows()
    with torch.no_grad():
        assert_same(eagle1_stats(head, *padded(data, side)), one_by_one(lambda *b: eagle1_stats(head, *b), data))


def test_eagle1_per_token_outputs_of_a_left_padded_batch_are_the_unpadded_rows(monkeypatch):
    head = make_head("eagle1").eval()
    data = rows(1)
    ids, mask, valid, final = padded(data, "left")
    batch = align_batch(ids, mask, final, final, valid)
    with torch.no_grad():
        out = head.forward_hidden(batch.hidden, batch.input_ids, batch.position_ids,
                                  attn_mask=padded_causal_mask(batch.attention_mask))
        naive = head.forward_hidden(batch.hidden, batch.input_ids, batch.position_ids)  # pads visible
        for r, (i, m, f) in enumerate(data):
            alone = align_batch(i, m, f, f)
            want = head.forward_hidden(alone.hidden, alone.input_ids, alone.position_ids)[0]
            real = slice(T - len(i), T)
            torch.testing.assert_close(out[r, real], want, rtol=1e-5, atol=1e-5)
            if len(i) < T:  # the check has teeth: attention over the pads changes the outputs
                assert not torch.allclose(naive[r, real], want, atol=1e-3)
    # And the loss: without the mask the left-padded batch trains differently from its rows.
    monkeypatch.setattr(losses, "padded_causal_mask", lambda attention_mask: None)
    with torch.no_grad():
        broken = eagle1_stats(head, ids, mask, valid, final)
        want = one_by_one(lambda *b: eagle1_stats(head, *b), data)
    assert abs(float(broken["feature_sum"]) - float(want["feature_sum"])) > 1e-3  # vs 1e-5 when masked


def medusa(seed: int = 0):
    cfg = dataclasses.replace(tiny_config("medusa", medusa_num_heads=3), draft_vocab_size=40)
    torch.manual_seed(seed)
    head = build_draft_head(cfg)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:40]
    head.set_draft_vocab(*vocab_from_ids(kept, VOCAB))
    with torch.no_grad():
        for block in (b for h in head.heads for b in h.blocks):
            block.linear.weight.normal_(0, 0.05)
    return head.eval()


@pytest.mark.parametrize("side", ["right", "left"])
def test_medusa_trains_a_padded_batch_as_its_rows_one_by_one(side):
    objective = MedusaObjective(medusa(), decay=0.8)

    def stats(ids, mask, valid, final):
        out = objective(ids, mask, valid, None, final)
        # round_loss is a mean over the rows that count: weigh it back to a sum to add rows up.
        counted = torch.stack([((objective.head.target_to_draft(ids[:, i + 2:]) >= 0)
                                & (mask * valid).bool()[:, i + 2:] & valid.bool()[:, :-(i + 2)]).sum()
                               for i in range(3)]).double()
        return {"loss_sum": out["round_loss"].double() * counted, "correct": out["round_correct"],
                "total": out["round_total"]}

    data = rows(2)
    with torch.no_grad():
        assert_same(stats(*padded(data, side)), one_by_one(stats, data))
