"""EAGLE-3 training-time test (TTT): unroll the draft head for `ttt_steps` rounds on its own outputs.

Round i at position t: hidden = the target's fused state of tokens <= t (round 0, through `fc`) or the
pre-norm midlayer output of round i-1 at t (no detach: gradients flow through all rounds); input token
t+1+i; it predicts token t+2+i. Its query sees the round-0 keys 0..t (causal) plus its own keys of
rounds 1..i at position t -- the diagonal tree mask of the EAGLE-3 paper, i.e. what the chain of drafts
rooted at t would see at decode time.

Attention never materializes the dense [T, rounds*T] mask or scores. The causal block runs in a fused
SDPA kernel; the i diagonal keys of a query are folded into the same kernel call as per-query "sink" keys:
the query gets i extra channels holding its raw diagonal dot products q.k_j[t], i sink keys (one-hot in
those channels) are prepended, so SDPA's own softmax scores them exactly and merges them with the causal
block (its internal log-sum-exp). The sinks' values are one-hot too, so SDPA returns the diagonal
softmax weights, which then multiply the per-position diagonal values. Everything is differentiable with
public ops; i dummy queries in front keep the causal alignment, so `is_causal=True` still applies.

RoPE positions advance by one per round (round i uses position_ids + i), as in the official trainer
(SafeAILab/EAGLE eagle/traineagle3/cnets.py: `position_ids + lck`, lck = rounds so far), in SpecForge's
(specforge/modeling/draft/llama3_eagle.py) and in decoding, where the draft's k-th step from a root at
position n runs at n + k (as SGLang's draft steps do).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from .layers import padded_causal_mask, repeat_kv
from .losses import AlignedBatch, eagle3_round_loss, shift_left, target_distribution

TTT_STEPS = 7
ROUND_DECAY = 0.8


class TTTAttention:
    """The attention kernel of successive TTT rounds (an `attend(q, k, v)` for the head's layer).

    The first call is round 0 (causal; its keys/values are kept); each later call is the next round."""

    def __init__(self, key_mask: Optional[torch.Tensor] = None):
        self.key_mask = key_mask
        self.k0: Optional[torch.Tensor] = None
        self.v0: Optional[torch.Tensor] = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if self.k0 is None:
            self.k0, self.v0 = repeat_kv(k, groups), repeat_kv(v, groups)
            return F.scaled_dot_product_attention(
                q, self.k0, self.v0, attn_mask=self.key_mask, is_causal=self.key_mask is None
            )
        self.diag_k.append(repeat_kv(k, groups))
        self.diag_v.append(repeat_kv(v, groups))
        return causal_plus_diagonal_attention(q, self.k0, self.v0, self.diag_k, self.diag_v, self.key_mask)


def causal_plus_diagonal_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax over {q_t.k0_s : s <= t} U {q_t.k_j[t] : j = 1..n} applied to the matching values.

    q, k0, v0 and each diag_k/diag_v: [B,h,T,D] (kv heads already expanded). key_mask: bool [B,1,T,T]
    over the round-0 keys, or None for causal. Returns [B,h,T,D]."""
    b, h, t, d = q.shape
    n = len(diag_k)
    extra = -(-n // 8) * 8  # extra channels, rounded up so fused kernels keep an aligned head_dim
    dk = torch.stack(diag_k, dim=3)  # [B,h,T,n,D]
    dv = torch.stack(diag_v, dim=3)  # [B,h,T,n,D]
    raw = torch.einsum("bhtd,bhtnd->bhtn", q, dk)  # unscaled diagonal scores; SDPA applies the scale
    q_aug = torch.cat([q, F.pad(raw, (0, extra - n))], dim=-1)  # [B,h,T,D+E]
    k_aug = F.pad(k0, (0, extra))  # zero extra channels: causal scores unchanged
    v_aug = F.pad(v0, (0, extra))
    # Sink j: key and value one-hot in extra channel j -> score scale*raw_j, output channel D+j = its weight.
    sink = F.pad(torch.eye(n, extra, dtype=q.dtype, device=q.device), (d, 0)).expand(b, h, n, d + extra)
    dummy_q = q.new_zeros(b, h, n, d + extra)
    mask = None
    if key_mask is not None:  # sinks visible to every query, dummy rows see all (their output is dropped)
        mask = F.pad(key_mask, (n, 0, n, 0), value=True)
    out = F.scaled_dot_product_attention(
        torch.cat([dummy_q, q_aug], dim=2),
        torch.cat([sink, k_aug], dim=2),
        torch.cat([sink, v_aug], dim=2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=d**-0.5,  # the head's scale, not that of the augmented width
    )[:, :, n:]  # [B,h,T,D+E]
    weights = out[..., d : d + n]  # [B,h,T,n] softmax weights of the diagonal keys
    return out[..., :d] + torch.einsum("bhtn,bhtnd->bhtd", weights, dv)


def ttt_forward(head, batch: AlignedBatch, ttt_steps: int = TTT_STEPS) -> Iterator[torch.Tensor]:
    """Yield the pre-norm midlayer output [B,T,H] of each round; round i reads token t+1+i at position
    position_ids + i, and its output is the hidden input of round i+1."""
    hidden = head.fuse(batch.hidden)
    attend = TTTAttention(padded_causal_mask(batch.attention_mask))
    for i in range(ttt_steps):
        hidden = head.layer(hidden, shift_left(batch.input_ids, i), batch.position_ids + i, attend)
        yield hidden


def eagle3_ttt_loss(
    head,
    batch: AlignedBatch,
    target_lm_head_weight: torch.Tensor,
    ttt_steps: int = TTT_STEPS,
    round_decay: float = ROUND_DECAY,
) -> dict[str, torch.Tensor]:
    """EAGLE-3 TTT objective on an aligned batch.

    target_lm_head_weight [V,H]: the frozen target lm_head (the dump stores final hidden states only).
    Returns tensors (counts reduce by sum across ranks):
      loss           sum_i round_decay**i * round_loss[i] (differentiable)
      round_loss     [R] per-round mean soft CE over the counted positions (detached)
      round_correct  [R] draft argmax (mapped to target ids) == target argmax over the full vocabulary
      round_total    [R] loss-masked positions (the accuracy denominator)
      round_counted  [R] positions in the loss (loss-masked and target top-1 inside the draft vocab)"""
    # Round i reads the teacher at t+i where loss_mask[t+i] holds: the round-0 loss rows are all it needs.
    probs, top1 = target_distribution(batch.target_hidden, target_lm_head_weight, head.t2d,
                                      rows_mask=batch.loss_mask & batch.attention_mask)
    losses, correct, total, counted = [], [], [], []
    for i, out in enumerate(ttt_forward(head, batch, ttt_steps)):
        mask = shift_left(batch.loss_mask, i, False) & batch.attention_mask
        loss, c, n_total, n_counted = eagle3_round_loss(head.logits, out, mask, probs, top1, i, head.t2d, head.d2t)
        losses.append(loss)
        correct.append(c)
        total.append(n_total)
        counted.append(n_counted)
    weights = torch.tensor([round_decay**i for i in range(ttt_steps)], device=losses[0].device)
    round_loss = torch.stack(losses)
    return {
        "loss": (weights * round_loss).sum(),
        "round_loss": round_loss.detach(),
        "round_correct": torch.stack(correct),
        "round_total": torch.stack(total),
        "round_counted": torch.stack(counted),
    }
