"""EAGLE-3 training-time test: the efficient TTT (fused causal SDPA + diagonal sinks) against a plain
dense-mask reference written straight from the spec, plus alignment and loss-masking rules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.losses import align_batch, eagle3_round_loss, shift_left, simulated_tau
from pipeline.heads.ttt import causal_plus_diagonal_attention, eagle3_ttt_loss
from tests.support.ttt import reference_ttt_loss

H, HEADS, KV, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 120, 48


def make_eagle3(seed=0):
    torch.manual_seed(seed)
    cfg = DraftHeadConfig(
        kind="eagle3", hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
        intermediate_size=INTER, rms_norm_eps=1e-6, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=H, aux_layer_ids=[1, 2, 3],
    )
    head = build_draft_head(cfg)
    with torch.no_grad():
        head.embed_tokens.weight.normal_()
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    # a scattered draft vocabulary (a random subset of the target ids), so d2t/t2d mapping matters
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(DRAFT_VOCAB), t2d)
    return head


def make_batch(lengths, t, left_pad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for r, n in enumerate(lengths):
        if left_pad:
            valid[r, t - n :] = True
        else:
            valid[r, :n] = True
    input_ids = torch.randint(0, VOCAB, (b, t), generator=g) * valid
    loss_mask = (torch.rand(b, t, generator=g) < 0.8) & valid
    aux = torch.randn(b, t, 3 * H, generator=g) * valid[..., None]
    final = torch.randn(b, t, H, generator=g) * valid[..., None]
    lm_head_w = torch.randn(VOCAB, H, generator=g)
    return input_ids, loss_mask.long(), aux, final, valid.long(), lm_head_w


def _grads(head):
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("steps,left_pad", [(7, False), (3, True), (1, False)])
def test_efficient_ttt_matches_dense_reference(steps, left_pad):
    head = make_eagle3()
    input_ids, loss_mask, aux, final, valid, w = make_batch([20, 13, 7], t=20, left_pad=left_pad)

    out = eagle3_ttt_loss(head, align_batch(input_ids, loss_mask, aux, final, valid), w, ttt_steps=steps)
    out["loss"].backward()
    grads = _grads(head)
    head.zero_grad()
    ref_loss, ref_rounds, ref_correct, ref_total = reference_ttt_loss(
        head, input_ids, loss_mask, aux, final, valid, w, steps)
    ref_loss.backward()
    ref_grads = _grads(head)

    assert out["round_loss"].shape == (steps,)
    torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["round_loss"], ref_rounds.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out["round_correct"], ref_correct)
    assert torch.equal(out["round_total"], ref_total)
    assert int(out["round_total"][0]) > 0 and bool((out["round_counted"] <= out["round_total"]).all())
    assert set(grads) == set(ref_grads) and "fc.weight" in grads and "embed_tokens.weight" not in grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert grads["fc.weight"].abs().sum() > 0


@pytest.mark.parametrize("n,masked", [(1, False), (9, False), (4, True)])
def test_causal_plus_diagonal_attention_matches_dense(n, masked):
    """n diagonal keys (9 > 8 exercises the rounded-up extra channels), with and without a padding mask."""
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 11, 8
    q, k0, v0 = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    dk = [torch.randn(b, h, t, d, requires_grad=True) for _ in range(n)]
    dv = [torch.randn(b, h, t, d, requires_grad=True) for _ in range(n)]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    key_mask = None
    if masked:
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[0, :3] = False
        key_mask = ((causal & valid[:, None, None, :]) | torch.eye(t, dtype=torch.bool))
    out = causal_plus_diagonal_attention(q, k0, v0, dk, dv, key_mask)

    eye = torch.eye(t, dtype=torch.bool)
    block0 = (causal if key_mask is None else key_mask).expand(b, 1, t, t)
    mask = torch.cat([block0] + [eye.expand(b, 1, t, t)] * n, -1)
    ref = F.scaled_dot_product_attention(q, torch.cat([k0] + dk, 2), torch.cat([v0] + dv, 2), attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    leaves = [q, k0, v0, *dk, *dv]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_align_batch_shifts():
    """hidden[t] pairs with token t+1 to predict token t+2; the loss mask moves with the predicted token."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 0], [0, 0, 20, 21, 22, 23]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
    final = torch.arange(12, dtype=torch.float).view(2, 6, 1)
    batch = align_batch(ids, loss_mask, final, final, valid)
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 0, 0], [0, 20, 21, 22, 23, 0]]
    assert batch.target_hidden[..., 0].tolist() == [[1, 2, 3, 4, 5, 0], [7, 8, 9, 10, 11, 0]]
    # row 0: tokens 2,3,4 trained -> positions 0,1,2; row 1: tokens 3,4,5 -> positions 1,2,3, but
    # position 1 is padding (its state is not a real prefix), so it is dropped.
    assert batch.loss_mask.int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert shift_left(batch.input_ids, 2).tolist() == [[13, 14, 0, 0, 0, 0], [21, 22, 23, 0, 0, 0]]


def test_round_loss_masking_rules():
    """A target whose top-1 is outside the draft vocabulary is excluded from the loss but counted as a
    miss in the accuracy; the draft argmax is mapped to target ids through d2t before comparing."""
    vd, v = 4, 10
    keep = torch.tensor([1, 3, 6, 8])  # draft ids 0..3 -> target ids 1, 3, 6, 8
    d2t, t2d = keep - torch.arange(vd), torch.zeros(v, dtype=torch.bool)
    t2d[keep] = True
    # 1 row, 5 positions; the "head" is the identity so out_hidden are the draft logits themselves.
    logits = torch.tensor([[[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0], [5.0, 0, 0, 0]]],
                          requires_grad=True)
    top1 = torch.tensor([[1, 6, 2, 8, 1]])  # pos 0 hit, pos 1 miss, pos 2 out of vocab, pos 3 hit, pos 4 unmasked
    probs = torch.softmax(torch.randn(1, 5, vd), -1)
    loss_mask = torch.tensor([[True, True, True, True, False]])
    loss, correct, total, counted = eagle3_round_loss(lambda x: x, logits, loss_mask, probs, top1, 0, t2d, d2t)
    assert (int(correct), int(total), int(counted)) == (2, 4, 3)
    rows = [0, 1, 3]
    expected = -(probs[0, rows] * logits[0, rows].log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 4].abs().sum() == 0
    assert logits.grad[0, 0].abs().sum() > 0

    # round 1 reads the targets at t+1: position 0 -> top1 6 (draft predicts 1: miss), position 2 -> 8
    # (draft predicts 6: miss); both in the vocabulary, so both counted, against probs[1] and probs[3].
    mask1 = torch.tensor([[True, False, True, False, False]])
    loss1, correct1, total1, counted1 = eagle3_round_loss(lambda x: x, logits, mask1, probs, top1, 1, t2d, d2t)
    assert (int(correct1), int(total1), int(counted1)) == (0, 2, 2)
    expected1 = -(probs[0, [1, 3]] * logits[0, [0, 2]].log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(loss1, expected1)


def test_simulated_tau():
    assert simulated_tau([0.8, 0.5, 0.0]) == pytest.approx(1 + 0.8 + 0.4)
    assert simulated_tau(torch.tensor([1.0, 1.0])) == pytest.approx(3.0)


def test_target_distribution_on_masked_rows_equals_full():
    """The teacher computed on the loss rows only (what TTT uses) equals the full computation there."""
    from pipeline.heads.losses import target_distribution

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 9, 16, generator=g), torch.randn(50, 16, generator=g)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[::3] = True
    mask = torch.rand(2, 9, generator=g) > 0.4
    full_p, full_top1 = target_distribution(hidden, weight, t2d, chunk_rows=4)
    p, top1 = target_distribution(hidden, weight, t2d, chunk_rows=4, rows_mask=mask)
    torch.testing.assert_close(p[mask], full_p[mask])
    assert torch.equal(top1[mask], full_top1[mask])
    assert torch.allclose(full_p.sum(-1), torch.ones(2, 9))
    assert (p[~mask] == 0).all() and (top1[~mask] == 0).all()
